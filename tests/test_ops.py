"""Operating the agents: rqpctl status / metrics / queues / send / receive, the Prometheus
endpoint, and SIGHUP reload, on simulated hosts with a route that works and one that breaks."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

import rqp
from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.sender import (
    QUEUE_MEMORY, ROUTE_CACHE, ROUTE_STATES, WAITING_FOR_ROUTE_MAX, budget_size,
)
from rqp_agents.sender import NOTE_BURST, NOTE_INTERVAL, WAITING_FULL_REPEAT
from rqp_agents.telemetry import QueueFigures
from tests.agents import (
    HOLDING_SIGNALS, PORT, held_signals, log_lines, make_queue, receive, send, start_receiver,
    send_sequence, start_sender, write_rqprc,
)
from tests.testbed import wait_for

Q1, Q2 = 0x52510001, 0x52510002
RQPCTL = [sys.executable, "-m", "rqp.tools.ctl"]


def rqpctl(host, *args, check=False):
    return host.run([*RQPCTL, *args], check=check, timeout=60)


def receiver_config(host, extra: str = "") -> str:
    return (f"control_socket: {host.workdir}/receiver.sock\nmetrics_listen: ':9747'\n"
            f"queues:\n  PROD_THE_SCHED_COMMON: {Q1:#x}\n{extra}")


@pytest.fixture
def site(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    receiver = start_receiver(b, config=receiver_config(b))
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b], queues={"PROD_THE_SCHED_COMMON": Q1},
                        metrics_listen=":9746")
    sender = start_sender(a, rqprc)
    return a, b, rqprc, sender, receiver


def test_status_of_healthy_agents(site):
    a, b, rqprc, sender, receiver = site
    send(a, rqprc, Q1, ["one", "two"])
    assert receive(b, Q1, 2) == ["one", "two"]
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    st = next(iter(json.loads(out.stdout).values()))
    [route] = st["routes"]
    assert (route["queue"], route["name"], route["peer"], route["state"]) == \
        ("0x52510001", "PROD_THE_SCHED_COMMON", f"{b.address}:{PORT}", "running")
    assert (route["sent"], route["sent_bytes"], route["delivered"], route["in_flight"]) == \
        (2, 6, 2, 0)
    assert 0 < route["rtt_p50_ms"] <= route["rtt_p99_ms"] and route["retry_in"] is None
    assert st["journal_depth"] == 0 and st["dead_letter_queue_depth"] == 0
    assert st["forgotten"] == {"queues": 0, "routes": 0, "sent": 0, "sent_bytes": 0,
                               "delivered": 0, "lost": 0, "unconfirmed_at_close": 0,
                               "dead_lettered": 0, "errors": 0, "route_changes": 0}
    assert (st["queue_memory"], st["route_cache"]) == (QUEUE_MEMORY, ROUTE_CACHE)
    text = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc)).stdout
    assert "PROD_THE_SCHED_COMMON" in text and "running" in text and "forgotten" not in text
    # a sending-only host: no receiver is no fault (a trial saw exit 3 here)
    out = rqpctl(a, "status", "--rqprc", str(rqprc))
    assert out.returncode == 0 and "receiver: none answers here" in out.stdout, out.stdout
    # (and where it looked, and how to name one run with a config elsewhere)
    assert "no receiver config at /etc/rqp/receiver.yaml, and no receiving MCA at " in \
        out.stdout and "--receiver-config FILE, or --socket PATH" in out.stdout, out.stdout
    # trace and metrics say it too (left alone a round ago: they left the receiver out
    # without a word); metrics as a comment, so the exposition stays valid
    out = rqpctl(a, "trace", "0x1", "--rqprc", str(rqprc))
    assert out.returncode == 1 and "receiver: none answers here" in out.stdout and \
        ": knows nothing of key 0x0000000000000001" in out.stdout, out.stdout
    out = rqpctl(a, "metrics", "--rqprc", str(rqprc))
    assert out.returncode == 0 and out.stdout.startswith("# receiver: none answers here ("), \
        out.stdout[:300]
    assert "\nrqp_" in out.stdout, out.stdout[:300]
    out = rqpctl(b, "status", "--agent", "receiver", "--receiver-config",
                 str(b.workdir / "receiver.yaml"), "--json")
    st = next(iter(json.loads(out.stdout).values()))
    assert out.returncode == 0 and st["stats"]["messages"] == 2
    assert [c["peer"].split(":")[0] for c in st["connections"]] == [a.address]
    assert {q["queue"]: q["offered"] for q in st["queues"]} == {"0x52510001": True}
    window = st["dedup_window"]  # the two SURE messages' keys, in a window far from full
    assert (window["keys"], window["max_keys"], window["max_age"], window["full"]) == \
        (2, 1_000_000, 86400.0, False) and 0 <= window["oldest_age"] < 600
    assert st["dedup_window_keys"] == 2  # (the same count, after the same expiry)
    text = rqpctl(b, "status", "--agent", "receiver", "--receiver-config",
                  str(b.workdir / "receiver.yaml")).stdout
    assert "de-duplication window: 2 of 1,000,000 keys, the oldest " in text, text
    assert "(kept 1d00h)" in text and "FULL" not in text, text


def test_a_receiving_only_host_says_why_no_sending_mca_is_shown(site):
    """A trial: with no .rqprc found, ``rqpctl status`` left the sending MCA out without a
    word (and skipped a broken one named by $RQPRC the same way). Now it says where it looked
    and asks the unit's socket; a broken .rqprc is an error naming it."""
    _a, b, _rqprc, _sender, _receiver = site
    env = {k: v for k, v in os.environ.items() if k != "RQPRC"} | {"HOME": str(b.workdir)}
    config = str(b.workdir / "receiver.yaml")
    out = b.run([*RQPCTL, "status", "--receiver-config", config], check=False, env=env,
                cwd=b.workdir, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sender: none answers here (no .rqprc found; looked at: $RQPRC (not set), " in \
        out.stdout and "/run/rqp/sender/control.sock: a receiving-only host" in out.stdout, \
        out.stdout
    assert "offers" in out.stdout  # (the receiver's own status follows)
    # with no receiver config either, nothing is optional: both missing, exit 3, and why
    out = b.run([*RQPCTL, "status"], check=False, env=env, cwd=b.workdir, timeout=60)
    assert out.returncode == 3 and "sender: not running" in out.stdout and \
        "(no .rqprc found; looked at" in out.stdout, out.stdout
    broken = b.workdir / "broken.rqprc"
    broken.write_text("hosts: [\n")
    out = b.run([*RQPCTL, "status", "--receiver-config", config], check=False,
                env=env | {"RQPRC": str(broken)}, cwd=b.workdir, timeout=60)
    assert out.returncode == 2 and str(broken) in out.stderr, out.stdout + out.stderr


def test_a_frozen_receiver_on_a_sending_host_is_not_taken_for_none(site, monkeypatch,
                                                                   capsys):
    """A trial: on a sending host with no receiver config, a receiving MCA that runs on the
    default socket but is frozen (SIGSTOP) was reported as 'none runs here', exit 0; the
    README says a not-answering agent means exit 3 (do not start a second one)."""
    from rqp.system.control import ControlNotAnswering
    from rqp.tools import ctl, ctl_agents

    a, _b, rqprc, _sender, _receiver = site
    real_ask = ctl_agents.ask

    def ask(candidates, command):  # (the default receiver sockets: a frozen one answers none)
        if any("receiver" in str(path) for path in candidates):
            raise ControlNotAnswering(f"{candidates[0]} took the connection but gave no "
                                      "answer within 5 s: it runs, but is frozen")
        return real_ask(candidates, command)
    monkeypatch.setattr(ctl_agents, "ask", ask)
    code = ctl.main(["status", "--rqprc", str(rqprc)])
    out = capsys.readouterr().out
    assert code == 3 and "receiver: not answering" in out, out
    assert "none answers here" not in out, out


def test_a_full_dedup_window_shows_how_long_it_keeps_a_key(testbed):
    """A window too small for its traffic keeps keys by count, not for dedup_window_age: status
    says for how long (a repeat arriving later is put twice), and metrics give what the
    RQPDedupWindowShort alert needs."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b, config=receiver_config(b, "dedup_window_keys: 3\n"))
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b], queues={"PROD_THE_SCHED_COMMON": Q1})
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["1", "2", "3", "4", "5"])
    assert receive(b, Q1, 5) == ["1", "2", "3", "4", "5"]
    config = str(b.workdir / "receiver.yaml")
    out = rqpctl(b, "status", "--agent", "receiver", "--receiver-config", config, "--json")
    window = next(iter(json.loads(out.stdout).values()))["dedup_window"]
    assert (window["keys"], window["max_keys"], window["full"]) == (3, 3, True), window
    text = rqpctl(b, "status", "--agent", "receiver", "--receiver-config", config).stdout
    assert re.search(r"de-duplication window: 3 of 3 keys, the oldest \d+s old \(kept "
                     r"1d00h\); FULL: each new key pushes out the oldest, before "
                     r"dedup_window_age: a SURE message sent again after its key left is put "
                     r"twice \(raise dedup_window_keys\)", text), text
    metrics = rqpctl(b, "metrics", "--agent", "receiver", "--socket",
                     str(b.workdir / "receiver.sock")).stdout
    assert re.search(r"^rqp_receiver_dedup_keys(\{[^}]*\})? 3(\.0)?$", metrics, re.M), metrics
    assert re.search(r"^rqp_receiver_dedup_max_keys(\{[^}]*\})? 3(\.0)?$", metrics, re.M), metrics
    assert re.search(r"^rqp_receiver_dedup_oldest_seconds(\{[^}]*\})? [0-9.]+$", metrics,
                     re.M), metrics


def test_a_broken_route_shows_in_status_exit_code_and_metrics(site):
    a, b, rqprc, sender, receiver = site
    send(a, rqprc, Q1, ["before"])
    assert receive(b, Q1, 1) == ["before"]
    b.kill(receiver)
    send(a, rqprc, Q1, ["refused"], UNSURE_MSG)  # tried at b, refused: a failed try there
    send(a, rqprc, Q1, ["stuck"])  # SURE: waits for a route
    def status():
        return next(iter(json.loads(rqpctl(a, "status", "--agent", "sender", "--rqprc",
                                            str(rqprc), "--json").stdout).values()))
    def state():
        return status()["routes"][0]
    # each host counts the failed tries of what was sent to it (the queue's figures, and its
    # metrics' peer label, follow the route wherever it goes next)
    [peer] = wait_for(lambda: [h["host"] for h in status()["hosts"] if h["failed_tries"]],
                      timeout=20, message="no host counted the refused message's failed try")
    assert re.search(rf"{re.escape(peer)} .*\(\d+ failed message tr(y|ies)\)",
                     rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc)).stdout)
    route = wait_for(lambda: (r := state())["state"] in ("retrying", "no route") and r,
                     timeout=20, message="the broken route never showed")
    assert route["last_error"] and route["waiting"] == 1
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc))
    assert out.returncode == 4
    metrics = a.python("import urllib.request; print(urllib.request.urlopen("
                       "'http://127.0.0.1:9746/metrics', timeout=5).read().decode())")
    lines = metrics.splitlines()
    states = [l for l in lines if l.startswith("rqp_sender_route_state{")]
    assert len(states) == len(ROUTE_STATES) == 9  # every state, 1 for the one it is in
    assert sum(float(l.rsplit(" ", 1)[1]) for l in states) == 1
    # (the route moves on while it retries, between the status above and this scrape: the
    # state it is in now is a broken one, not necessarily the same)
    [now] = [l for l in states if float(l.rsplit(" ", 1)[1]) == 1]
    assert 'state="running"' not in now and 'state="idle"' not in now, now
    assert any(l.startswith("rqp_journal_depth ") and float(l.split()[1]) == 1 for l in lines)
    assert "# TYPE rqp_sender_messages_total counter" in lines
    assert any(l.startswith(f'rqp_sender_host_errors_total{{peer="{peer}"}} ') and
               float(l.split()[-1]) >= 1 for l in lines), metrics
    assert 'rqp_sender_forgotten_total{what="queues"} 0.0' in lines
    # the receiver is not running: a clear message and exit 3
    out = rqpctl(b, "status", "--agent", "receiver", "--receiver-config",
                 str(b.workdir / "receiver.yaml"))
    assert out.returncode == 3 and "not running" in out.stdout


MANY_QUEUES = r"""
import sys, sysv_ipc
first, n, action = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
queues = [sysv_ipc.MessageQueue(first + i, sysv_ipc.IPC_CREAT, mode=0o600) for i in range(n)]
if action == "count":  # how many hold exactly one message
    print(sum(q.current_messages == 1 for q in queues))
"""

SEND_EACH = r"""
import sys, rqp
rqprc, first, n, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for i in range(n):  # one message to each of n queue keys from first on
    h = rqp.openConnection(first + i, rqprc=rqprc, start_sender=False)
    rqp.sendMessage(h, b"one", rqp.SURE_MSG if kind == "SURE" else rqp.UNSURE_MSG)
    rqp.closeConnection(h)
"""


def test_idle_queues_beyond_the_memory_are_added_up_in_status_and_metrics(testbed):
    """A producer writing to more queue keys than QUEUE_MEMORY, through real agents: status
    and metrics show the most recently busy QUEUE_MEMORY queues and add up the others
    (forgotten, in words, in --json and in rqp_sender_forgotten_total); the routes are kept,
    so rqpctl route still knows a queue whose figures were let go."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    a.sysctl("kernel.msgmnb", 1 << 22)  # (the transmission queue takes them all at once)
    start_receiver(b, config=receiver_config(b))
    first, n = 0x52600000, QUEUE_MEMORY + 40
    b.python(MANY_QUEUES, str(first), str(n), "make", timeout=60)
    rqprc = write_rqprc(a, [b], metrics_listen=":9746")
    start_sender(a, rqprc)
    a.python(SEND_EACH, str(rqprc), str(first), str(n), "UNSURE", timeout=120)
    wait_for(lambda: int(b.python(MANY_QUEUES, str(first), str(n), "count")) == n,
             timeout=120, message="not every queue got its message")
    st = next(iter(json.loads(rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc),
                                     "--json").stdout).values()))
    assert len(st["routes"]) == QUEUE_MEMORY
    assert {r["queue_key"] for r in st["routes"]} == set(range(first + 40, first + n))
    gone = st["forgotten"]
    assert (gone["queues"], gone["routes"], gone["sent"], gone["delivered"]) == (40, 0, 40, 40)
    text = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc)).stdout
    assert f"and idle queues let go (beyond the {QUEUE_MEMORY} most recently busy; 40 times " \
        "so far, a queue busy again counts anew): sent 40 (120 bytes), delivered 40" in text, \
        text[-600:]
    metrics = a.python("import urllib.request; print(urllib.request.urlopen("
                       "'http://127.0.0.1:9746/metrics', timeout=30).read().decode())")
    lines = metrics.splitlines()
    assert 'rqp_sender_forgotten_total{what="queues"} 40.0' in lines
    assert 'rqp_sender_messages_total{name="",peer="",queue="forgotten"} 40.0' in lines
    assert 'rqp_sender_route_changes_total{name="",peer="",queue="forgotten"} 40.0' in lines
    assert sum(float(line.rsplit(" ", 1)[1]) for line in lines  # the sum is the whole
               if line.startswith("rqp_sender_messages_total{")) == n
    out = rqpctl(a, "route", "stop", hex(first), "--rqprc", str(rqprc))  # its route is known
    assert out.returncode == 0 and "stopped" in out.stdout, out.stdout + out.stderr
    out = rqpctl(a, "route", "start", hex(first), "--rqprc", str(rqprc))
    assert out.returncode == 0, out.stdout + out.stderr
    # the receiving MCA keeps the figures of as many queues, the rest under "forgotten"
    lines = b.python("import urllib.request; print(urllib.request.urlopen("
                     "'http://127.0.0.1:9747/metrics', timeout=30).read().decode())").splitlines()
    assert 'rqp_receiver_forgotten_total{what="queues"} 40.0' in lines
    assert 'rqp_receiver_messages_total{outcome="put",queue="forgotten"} 40.0' in lines
    puts = [line for line in lines if line.startswith("rqp_receiver_messages_total{")]
    assert len(puts) == QUEUE_MEMORY + 1 and sum(float(p.rsplit(" ", 1)[1]) for p in puts) == n
    assert len([line for line in lines if line.startswith("rqp_receiver_queue_depth{")]) == \
        QUEUE_MEMORY  # (the queues of the figures kept; none is named in its config here)
    text = rqpctl(b, "status", "--agent", "receiver", "--receiver-config",
                  str(b.workdir / "receiver.yaml")).stdout
    assert f", and {n - 20} more (--json lists them)" in text, text[-300:]


def test_sure_messages_no_host_takes_do_not_stop_the_other_queues(testbed):
    """A trial: SURE messages for more queues than the sending MCA's budget that no host
    offers (mistyped keys, queues not made yet) filled the budget, and the sending MCA took
    nothing more off its transmission queue, for any queue, until a route came. They are
    held beyond the budget now: a queue that has a route still gets its messages, and
    status says how many wait for a route."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b, config=receiver_config(b))
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b], window=8, retry_backoff_initial="30s",
                        retry_backoff_max="30s")
    assert 100 > budget_size(8, 1)  # (more than the budget holds)
    start_sender(a, rqprc)
    a.python(SEND_EACH, str(rqprc), str(0x52700000), "100", "SURE", timeout=60)
    send(a, rqprc, Q1, [f"m{i}" for i in range(10)])
    assert receive(b, Q1, 10, timeout=30) == [f"m{i}" for i in range(10)]
    st = wait_for(lambda: (st := next(iter(json.loads(rqpctl(
        a, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json").stdout).values())))
        ["waiting_for_route"] == 100 and st, timeout=30, message="not all 100 wait for a route")
    assert st["journal_depth"] == 100 and st["transmission_queue_depth"] == 0
    text = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc)).stdout
    assert ", 100 waiting for a route" in text, text[:400]
    metrics = rqpctl(a, "metrics", "--agent", "sender", "--rqprc", str(rqprc)).stdout
    assert any(line.startswith("rqp_sender_waiting_for_route") and line.endswith(" 100.0")
               for line in metrics.splitlines()), metrics[-500:]


def test_a_stopped_route_does_not_stop_the_other_queues(testbed):
    """rqpctl route stop for longer than the budget lasts: the stopped route's messages wait
    beside the budget, another queue's messages still go; started again, they all go."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b, config=receiver_config(b))
    make_queue(b, Q1)
    make_queue(b, Q2)
    rqprc = write_rqprc(a, [b], window=8, queues={"PROD_THE_SCHED_COMMON": Q1})
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["first"])
    assert receive(b, Q1, 1) == ["first"]
    assert rqpctl(a, "route", "stop", hex(Q1), "--rqprc", str(rqprc)).returncode == 0
    held = [f"held-{i}" for i in range(budget_size(8, 1) + 8)]  # (more than the budget holds)
    send(a, rqprc, Q1, held)
    a.python(SEND_EACH, str(rqprc), str(Q1), "1", "UNSURE", timeout=60)  # (an UNSURE one too)
    send(a, rqprc, Q2, ["meanwhile"])
    assert receive(b, Q2, 1, timeout=30) == ["meanwhile"]
    assert rqpctl(a, "route", "start", hex(Q1), "--rqprc", str(rqprc)).returncode == 0
    assert receive(b, Q1, len(held) + 1, timeout=30) == held + ["one"]


def test_what_waits_for_a_route_is_held_up_to_a_bound_then_the_queue_waits(testbed):
    """Beyond WAITING_FOR_ROUTE_MAX messages waiting for a route, the rest count against the
    budget again: memory stays bounded, the transmission queue keeps what is not taken, and
    the log says why."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    a.sysctl("kernel.msgmnb", 1 << 22)
    start_receiver(b, config=receiver_config(b))
    rqprc = write_rqprc(a, [b], window=8, retry_backoff_initial="60s",
                        retry_backoff_max="60s")
    sender = start_sender(a, rqprc, log_level="INFO")
    started = time.monotonic()
    total = WAITING_FOR_ROUTE_MAX + budget_size(8, 1) + 50
    a.python(SEND_EACH, str(rqprc), str(0x52700000), str(total), "SURE", timeout=120)

    def status():
        return next(iter(json.loads(rqpctl(a, "status", "--agent", "sender", "--rqprc",
                                           str(rqprc), "--json").stdout).values()))
    st = wait_for(lambda: (st := status())["waiting_for_route"] == total - 50 and st,
                  timeout=120, message="the sending MCA did not take what its bounds allow")
    assert st["transmission_queue_depth"] == 50 and st["journal_depth"] == total - 50
    assert (st["window"], st["held_most"]) == (8, budget_size(8, 1))
    assert log_lines(a, sender, "; window 8; keys from incarnation")  # (its start-up line)
    assert log_lines(a, sender, "or in stopped routes: no more are held beside them")
    # each of those held was asked for and found no route: those lines are rate-limited
    windows = (time.monotonic() - started) // NOTE_INTERVAL + 1  # (begun since the start)
    assert 0 < len(log_lines(a, sender, "no route for the queue")) <= windows * NOTE_BURST


FILL_QUEUE = r"""
import sys, sysv_ipc
q = sysv_ipc.MessageQueue(int(sys.argv[1]), sysv_ipc.IPC_CREAT, mode=0o660)
while True:
    try:
        q.send(b"f" * 1024, block=False, type=1)
    except sysv_ipc.BusyError:
        break
"""


def test_the_line_that_the_route_waiting_is_full_comes_once_a_minute_not_per_retry(testbed):
    """A hostile-peer trial: a receiver refusing every message (DELIVERED_ERROR) made the line
    '4736 messages wait for a route ...' 6 times in 16 s, once per retry round (each takes them
    out of waiting and puts them back). Now at most once a minute (WAITING_FULL_REPEAT)."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    a.sysctl("kernel.msgmnb", 1 << 22)
    start_receiver(b, config=receiver_config(b, "put_retry_count: 1\n"
                                                "put_retry_interval: 0.05\n"))
    b.python(FILL_QUEUE, str(Q1))  # every put refused QUEUE_FULL: DELIVERED_ERROR, retried
    rqprc = write_rqprc(a, [b], window=8, retry_backoff_initial="0.3s",
                        retry_backoff_max="0.3s")
    sender = start_sender(a, rqprc, log_level="INFO")
    send_sequence(a, rqprc, Q1, "m", WAITING_FOR_ROUTE_MAX + budget_size(8, 1) + 50)

    def tries():
        st = next(iter(json.loads(rqpctl(a, "status", "--agent", "sender", "--rqprc",
                                         str(rqprc), "--json").stdout).values()))
        return st["hosts"][0]["failed_tries"]
    full = "or in stopped routes: no more are held beside them"
    wait_for(lambda: log_lines(a, sender, full), timeout=60, message="never full")
    said = time.monotonic()
    first = tries()
    wait_for(lambda: tries() >= first + 5, timeout=60, message="no retry rounds")
    lines = len(log_lines(a, sender, full))
    assert time.monotonic() - said < WAITING_FULL_REPEAT  # (else a second line is due)
    assert lines == 1


def test_a_frozen_receiver_makes_the_route_stalled_and_it_recovers_without_loss(testbed):
    """Issue 15: "it says running, but nothing moves". A receiving MCA frozen (SIGSTOP) under
    load: the connection is up and nothing times out yet, but after stall_after without a
    confirmation the route is "stalled" (rqpctl status exits 4, says why and how old the
    oldest message is; the metrics say it too); after SIGCONT it runs again, nothing lost."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    receiver = start_receiver(b, config=receiver_config(b))
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b], stall_after="2s", confirm_timeout="60s", metrics_listen=":9746")
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["warm"])
    assert receive(b, Q1, 1) == ["warm"]

    def route():
        out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json")
        return out.returncode, next(iter(json.loads(out.stdout).values()))["routes"][0]

    assert route()[0] == 0
    receiver.send_signal(signal.SIGSTOP)
    try:
        texts = [f"frozen-{i}" for i in range(200)]
        send(a, rqprc, Q1, texts)
        code, r = wait_for(lambda: (got := route())[1]["state"] == "stalled" and got,
                           timeout=20, message="the frozen route never showed as stalled")
        assert code == 4 and r["in_flight"] + r["waiting"] == 200 and r["lag"] >= 2.0, r
        assert r["stalled_why"].startswith(f"connected to {b.address}:{PORT}, no answer "
                                           "confirmed a message"), r["stalled_why"]
        text = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc)).stdout
        assert "stalled: nothing confirmed for" in text, text
        metrics = a.python("import urllib.request; print(urllib.request.urlopen("
                           "'http://127.0.0.1:9746/metrics', timeout=5).read().decode())")
        assert any(l.startswith("rqp_sender_route_state{") and 'state="stalled"' in l
                   and float(l.rsplit(" ", 1)[1]) == 1 for l in metrics.splitlines()), metrics
        lag = [float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines()
               if l.startswith("rqp_sender_lag_seconds{")]
        assert lag and lag[0] >= 2.0, metrics
    finally:
        receiver.send_signal(signal.SIGCONT)
    assert receive(b, Q1, 200) == texts  # nothing lost, in order
    code, r = wait_for(lambda: (got := route())[1]["state"] == "running" and got, timeout=20,
                       message="the route did not run again after SIGCONT")
    assert code == 0 and r["lag"] == 0.0 and r["stalled_since"] is None


def test_a_vanished_peer_on_an_idle_connection_is_found_by_the_heartbeat(testbed):
    """Issue 15: with nothing to send, a receiving MCA whose network went away is found by
    the heartbeat (a QUEUE_ASK for a key the route serves, every heartbeat_interval), not by
    the next message; once the network is back the connection is made again before a
    message needs it, and the next message goes through."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b, config=receiver_config(b))
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b], heartbeat_interval="1s", ask_timeout="1s")
    sender = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["before"])
    assert receive(b, Q1, 1) == ["before"]

    def host():
        out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json")
        return next(iter(json.loads(out.stdout).values()))["hosts"][0]

    wait_for(lambda: host()["heartbeats"] >= 2, timeout=20,
             message="no heartbeat on the idle connection")
    assert host()["heartbeat_failures"] == 0 and host()["connection"] == "up"
    a.link_down()
    try:
        wait_for(lambda: host()["heartbeat_failures"] >= 1, timeout=20,
                 message="the vanished peer was not found by the heartbeat")
        assert abs(host()["heartbeat_failed_at"] - time.time()) < 60  # (wall time)
        assert log_lines(a, sender, "no answer to heartbeat QUEUE_ASK within 1s")
        text = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc)).stdout
        assert "heartbeat(s) unanswered" in text, text
    finally:
        a.link_up()
    wait_for(lambda: host()["connection"] == "up", timeout=30,
             message="the connection was not made again after the network came back")
    send(a, rqprc, Q1, ["after"])
    assert receive(b, Q1, 1) == ["after"]


@pytest.mark.parametrize("frozen_first", [True, False])
def test_a_frozen_agent_is_not_also_said_to_be_missing_from_another_place(tmp_path,
                                                                          frozen_first):
    """A trial, the sending MCA frozen: 'not answering: ... it runs, but is frozen (SIGSTOP?)
    or hung; no agent is running here (/run/rqp/sender/control.sock does not exist)', the
    second of the places a control socket may be. One that took the connection is the answer."""
    import socket

    from rqp.system.control import ControlNotAnswering
    from rqp.tools.ctl_agents import ask
    frozen, missing = tmp_path / "frozen.sock", tmp_path / "missing.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(frozen))
        server.listen(1)  # (takes the connection, never answers: a frozen agent's socket)
        with pytest.raises(ControlNotAnswering) as info:
            ask([frozen, missing] if frozen_first else [missing, frozen], "status", timeout=0.2)
    said = str(info.value)
    assert "frozen (SIGSTOP?) or hung" in said and "no agent is running" not in said, said


def test_no_agent_at_any_of_the_places_is_said_once(tmp_path):
    """A trial: 'no agent is running here (A does not exist); no agent is running here (B does
    not exist)'."""
    from rqp.system.control import ControlError
    from rqp.tools.ctl_agents import ask
    with pytest.raises(ControlError) as info:
        ask([tmp_path / "a.sock", tmp_path / "b.sock"], "status", timeout=0.2)
    assert str(info.value) == (f"no agent is running here (nothing at {tmp_path / 'a.sock'} "
                               f"nor {tmp_path / 'b.sock'})")


def test_a_frozen_agent_is_not_answering_not_not_running(site):
    """A trial: with the receiving MCA frozen (SIGSTOP), rqpctl said 'not running' (an
    operator might start a second agent beside it). Its socket takes the connection and no
    answer comes: 'not answering', still exit 3 (it serves nothing)."""
    a, b, rqprc, sender, receiver = site
    config = b.workdir / "receiver.yaml"
    receiver.send_signal(signal.SIGSTOP)
    try:
        out = rqpctl(b, "status", "--agent", "receiver", "--receiver-config", str(config))
        assert out.returncode == 3, out.stdout + out.stderr
        assert out.stdout.startswith("receiver: not answering: the agent on ") and \
            "took the connection but gave no answer within 5 s" in out.stdout, out.stdout
        js = rqpctl(b, "status", "--agent", "receiver", "--receiver-config", str(config),
                    "--json")
        got = json.loads(js.stdout)["receiver"]
        assert (js.returncode, got["running"], got["answering"]) == (3, True, False)
    finally:
        receiver.send_signal(signal.SIGCONT)
    receiver.send_signal(signal.SIGKILL)  # (gone: now it is not running)
    receiver.wait(10)
    out = rqpctl(b, "status", "--agent", "receiver", "--receiver-config", str(config))
    assert out.returncode == 3 and out.stdout.startswith("receiver: not running: "), out.stdout


def test_status_watch_refreshes_until_interrupted(site):
    a, b, rqprc, sender, receiver = site
    send(a, rqprc, Q1, ["one"])
    assert receive(b, Q1, 1) == ["one"]
    # (started holding the signals, as a harness's thread would: it lets go of those it takes)
    watch = a.popen([*HOLDING_SIGNALS, *RQPCTL, "status", "--agent", "sender", "--rqprc",
                     str(rqprc), "--watch", "0.2"])
    # (three whole screens: a signal may come between a screen's header and its table)
    wait_for(lambda: a.output(watch).count("PROD_THE_SCHED_COMMON") >= 3, timeout=20,
             message="rqpctl status --watch did not refresh")
    watch.send_signal(signal.SIGINT)
    assert watch.wait(10) == 0
    assert a.output(watch).count("every 0.2s") >= 3
    bad = rqpctl(a, "status", "--watch", "1", "--json", "--rqprc", str(rqprc))
    assert bad.returncode == 2 and "--watch shows the table" in bad.stderr


def test_trace_follows_messages_by_key(site, testbed):
    """Issue 15: rqpctl trace KEY says where one message is, on the sending host (waiting, in
    flight, confirmed by which host, dead-lettered with which reason) and on the receiving
    host (a SURE message put, from which peer). Keys are the sending MCA's incarnation << 32
    | the number of the record it took (1, 2, ...)."""
    a, b, rqprc, sender, receiver = site
    status = json.loads(rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc),
                               "--json").stdout)
    base = int(next(iter(status.values()))["incarnation"], 16) << 32
    receiver_config = str(b.workdir / "receiver.yaml")

    def trace(host, key, *target):
        out = rqpctl(host, "trace", hex(key), *target, "--json")
        return out.returncode, next(iter(json.loads(out.stdout).values()))

    send(a, rqprc, Q1, ["one"])  # key 1: SURE, confirmed
    assert receive(b, Q1, 1) == ["one"]
    code, t = trace(a, base + 1, "--agent", "sender", "--rqprc", str(rqprc))
    assert code == 0 and t["state"] == "confirmed" and t["detail"] == f"{b.address}:{PORT}", t
    code, t = trace(b, base + 1, "--agent", "receiver", "--receiver-config", receiver_config)
    assert code == 0 and t["state"].startswith("put") and t["peer"] == a.address, t
    # another peer puts a SURE message under the same key (each peer's keys are its own):
    # both are named, the latest first (a trial: only the other peer's was)
    from tests.rqp_peer import Peer, answers, ask, msg
    c = testbed.add_host("c")
    other = Peer.start(c)
    assert other.connect("same-key", b.address, PORT)["connected"]
    assert answers(other.exchange("same-key", [ask(Q1), msg(Q1, b"same key", key=base + 1)])) \
        == ["QUEUE_YES", "DELIVERED_YES"]
    assert receive(b, Q1, 1) == ["same key"]
    code, t = trace(b, base + 1, "--agent", "receiver", "--receiver-config", receiver_config)
    assert code == 0 and t["peer"] == c.address, t
    assert [u["peer"] for u in t["also"]] == [a.address], t
    text = rqpctl(b, "trace", hex(base + 1), "--agent", "receiver", "--receiver-config",
                  receiver_config).stdout
    assert f", from {c.address}, " in text and f"; also put (SURE; its key is in the " \
        f"de-duplication window), from {a.address}, " in text, text
    send(a, rqprc, Q2, ["nowhere"], mtype=1)  # key 2: UNSURE, no host offers Q2
    code, t = wait_for(lambda: (got := trace(a, base + 2, "--agent", "sender", "--rqprc",
                                              str(rqprc)))[1] and got, timeout=20,
                       message="the UNSURE message never showed")
    assert t["state"] == "dead-lettered NO_ROUTE" and t["queue"] == "0x52510002", t
    # key 3: one SURE message through waiting -> in flight -> confirmed
    assert rqpctl(a, "route", "stop", "PROD_THE_SCHED_COMMON", "--rqprc",
                  str(rqprc)).returncode == 0
    send(a, rqprc, Q1, ["journey"])
    code, t = wait_for(lambda: (got := trace(a, base + 3, "--agent", "sender", "--rqprc",
                                              str(rqprc)))[1] and got, timeout=20,
                       message="the SURE message never showed")
    assert (t["state"], t["route_state"], t["queue"]) == ("waiting", "stopped", "0x52510001"), t
    text = rqpctl(a, "trace", hex(base + 3), "--agent", "sender", "--rqprc", str(rqprc)).stdout
    assert text.startswith("sender-52510000: waiting for queue 0x52510001 PROD_THE_SCHED_COMMON "
                           "(stopped), taken "), text
    receiver.send_signal(signal.SIGSTOP)
    try:
        assert rqpctl(a, "route", "start", "PROD_THE_SCHED_COMMON", "--rqprc",
                      str(rqprc)).returncode == 0
        code, t = wait_for(lambda: (got := trace(a, base + 3, "--agent", "sender", "--rqprc",
                                                  str(rqprc)))[1]["state"] == "in flight" and got,
                           timeout=20, message="the SURE message did not go in flight")
        assert (t["host"], t["attempts"]) == (f"{b.address}:{PORT}", 1)
        text = rqpctl(a, "trace", hex(base + 3), "--agent", "sender", "--rqprc",
                      str(rqprc)).stdout
        assert text.startswith(f"sender-52510000: in flight to {b.address}:{PORT} for queue "
                               "0x52510001 PROD_THE_SCHED_COMMON, taken "), text
        # the frozen receiver cannot be asked: not "nobody knows it" (1), but 3 (a trial)
        out = rqpctl(b, "trace", hex(base + 3), "--agent", "receiver", "--receiver-config",
                     receiver_config)
        assert out.returncode == 3 and "not answering" in out.stdout, out.stdout
    finally:
        receiver.send_signal(signal.SIGCONT)
    assert receive(b, Q1, 1) == ["journey"]
    wait_for(lambda: trace(a, base + 3, "--agent", "sender", "--rqprc",
                           str(rqprc))[1]["state"] == "confirmed", timeout=20,
             message="the SURE message was not confirmed after SIGCONT")
    code, t = trace(b, base + 3, "--agent", "receiver", "--receiver-config", receiver_config)
    assert code == 0 and t["state"].startswith("put"), t
    out = rqpctl(a, "trace", hex(base + 99), "--agent", "sender", "--rqprc", str(rqprc))
    assert out.returncode == 1 and "knows nothing of key" in out.stdout
    # a restart keeps the window, and the peers whose keys are in it (a trial: "knows
    # nothing" of a key the window had, until its peer came again)
    assert b.stop(receiver, timeout=30) == 0
    start_receiver(b, config=Path(receiver_config).read_text())
    code, t = trace(b, base + 1, "--agent", "receiver", "--receiver-config", receiver_config)
    assert code == 0 and {t["peer"], *(u["peer"] for u in t["also"])} == \
        {a.address, c.address}, t
    code, t = trace(b, base + 3, "--agent", "receiver", "--receiver-config", receiver_config)
    assert code == 0 and t["peer"] == a.address, t


def test_route_retry_ends_the_back_off_and_ping_times_a_receiver(testbed):
    """Issue 15, acting on routes: with a 30 s back-off a SURE message waits for its receiver
    long after it is back; rqpctl route retry sends it now. rqpctl ping connects as the
    sending MCA does, asks, and times it (or says why it cannot)."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b], queues={"PROD_THE_SCHED_COMMON": Q1},
                        retry_backoff_initial="30s", retry_backoff_max="60s")
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["waited"])  # no receiver yet: connection refused, 30 s back-off

    def route():
        out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json")
        routes = next(iter(json.loads(out.stdout).values()))["routes"]
        return routes[0] if routes else {"state": "none", "last_error": ""}

    wait_for(lambda: "Connection refused" in route()["last_error"], timeout=20,
             message="the refused connection did not show")
    out = rqpctl(a, "ping", f"{b.address}:{PORT}", "--rqprc", str(rqprc))
    assert out.returncode == 1 and "connection refused (no receiving MCA listens there)" in \
        out.stdout, out.stdout
    start_receiver(b, config=receiver_config(b))
    out = rqpctl(a, "ping", f"{b.address}:{PORT}", "--rqprc", str(rqprc))
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.fullmatch(rf"{re.escape(b.address)}:{PORT} \(plaintext\): connected in [0-9.]+ ms; "
                        r"QUEUE_ASK 0x52510001 answered QUEUE_YES in [0-9.]+ ms\n", out.stdout), \
        out.stdout
    assert route()["state"] == "retrying"  # (it would wait out its back-off: about 30 s)
    out = rqpctl(a, "route", "retry", "PROD_THE_SCHED_COMMON", "--rqprc", str(rqprc))
    assert out.returncode == 0 and "retrying now, 1 message(s) waiting" in out.stdout, out.stdout
    assert receive(b, Q1, 1, timeout=10) == ["waited"]
    out = rqpctl(a, "route", "stop", "PROD_THE_SCHED_COMMON", "--rqprc", str(rqprc))
    assert out.returncode == 0 and "stopped: nothing more is sent" in out.stdout, out.stdout
    out = rqpctl(a, "route", "stop", "PROD_THE_SCHED_COMMON", "--rqprc", str(rqprc))
    assert out.returncode == 2 and "is already stopped" in out.stdout, out.stdout  # (as start)
    send(a, rqprc, Q1, ["held back"])
    wait_for(lambda: route()["waiting"] == 1, timeout=20, message="the message did not wait")
    assert route()["state"] == "stopped"
    assert rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc)).returncode == 4
    assert receive(b, Q1, 1, timeout=1) == []  # (nothing comes while stopped)
    out = rqpctl(a, "route", "start", "PROD_THE_SCHED_COMMON", "--rqprc", str(rqprc))
    assert out.returncode == 0 and "started again, 1 message(s) waiting" in out.stdout, out.stdout
    assert receive(b, Q1, 1, timeout=10) == ["held back"]
    out = rqpctl(a, "route", "start", "PROD_THE_SCHED_COMMON", "--rqprc", str(rqprc))
    assert out.returncode == 2 and "is not stopped: nothing to start" in out.stdout, out.stdout
    # by its control socket, as status --socket (a trial: route had no --socket)
    sock = str(a.workdir / "sender-state" / "sender-52510000.sock")
    out = a.run([*RQPCTL, "route", "stop", hex(Q1), "--socket", sock], check=False,
                env={**os.environ, "HOME": str(a.workdir / "nowhere")}, cwd=a.workdir)
    assert out.returncode == 0 and "stopped: nothing more is sent" in out.stdout, out.stdout
    out = rqpctl(a, "route", "start", "PROD_THE_SCHED_COMMON", "--socket", sock, "--rqprc",
                 str(rqprc))  # (a name: looked up in .rqprc)
    assert out.returncode == 0 and "started again" in out.stdout, out.stdout
    out = a.run([*RQPCTL, "ping", f"{b.address}:{PORT}", "--socket", sock], check=False,
                env={**os.environ, "HOME": str(a.workdir / "nowhere")}, cwd=a.workdir)
    assert out.returncode == 0 and "QUEUE_ASK 0x52510001 answered QUEUE_YES" in out.stdout, \
        out.stdout + out.stderr
    for key, why in ((0x52519999, "has sent nothing for it lately"),
                     (0x52510000, "own transmission queue or DEAD.LETTER.Q, not a route")):
        out = rqpctl(a, "route", "stop", hex(key), "--rqprc", str(rqprc))  # (a mistyped key)
        assert out.returncode == 2 and why in out.stdout, out.stdout
    wrong = rqpctl(a, "route", "retry", "NO_SUCH_NAME", "--rqprc", str(rqprc))
    assert wrong.returncode != 0 and "NO_SUCH_NAME" in wrong.stdout + wrong.stderr
    # a re-check: a label IDNA cannot take was 'bad request' (exit 2, a traceback in the log)
    out = rqpctl(a, "ping", "a" * 64, "--rqprc", str(rqprc))
    assert out.returncode == 1 and "cannot resolve the host name" in out.stdout, out.stdout
    # ...and a peer answering QUEUE_ASK with DELIVERED_YES was said to answer QUEUE_NO
    odd = a.popen([sys.executable, "-c", ANSWERS_DELIVERED_YES, a.address, "18001"])
    wait_for(lambda: "listening" in a.output(odd, "stdout"), timeout=20, message="no server")
    out = rqpctl(a, "ping", f"{a.address}:18001", "--rqprc", str(rqprc))
    assert out.returncode == 1 and "answered QUEUE_ASK with DeliveredYes" in out.stdout, \
        out.stdout


ANSWERS_DELIVERED_YES = r"""
import socket, sys
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as server:
    print("listening", flush=True)
    conn, _ = server.accept()
    conn.recv(1)
    conn.sendall(b"\x02\x00")  # DELIVERED_YES, to a QUEUE_ASK
    conn.recv(1)
"""


def test_json_logs_carry_the_events_fields(testbed):
    """Issue 15: --log-format json: one JSON object a line (time, level, logger, message),
    with the event's fields for machines (event, queue_key, peer, message_key, reason)."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    receiver = start_receiver(b, config=receiver_config(b), log_level="INFO",
                              extra=("--log-format", "json"))
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    sender = start_sender(a, rqprc, log_level="INFO", extra=("--log-format", "json"))
    send(a, rqprc, Q1, ["one"])
    assert receive(b, Q1, 1) == ["one"]
    send(a, rqprc, Q2, ["nowhere"], mtype=1)  # UNSURE, no host offers Q2: a dead letter
    wait_for(lambda: '"event": "dead_letter"' in a.output(sender, "stderr"), timeout=20,
             message="no dead letter logged")
    lines = [json.loads(line) for line in a.output(sender, "stderr").splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    found = next(line for line in lines if line.get("event") == "route_found")
    assert (found["queue_key"], found["peer"]) == ("0x52510001", f"{b.address}:{PORT}")
    dead = next(line for line in lines if line.get("event") == "dead_letter")
    assert (dead["reason"], dead["queue_key"], dead["level"]) == ("NO_ROUTE", "0x52510002",
                                                                  "WARNING")
    assert re.fullmatch(r"0x[0-9a-f]{16}", dead["message_key"])
    assert rqpctl(a, "route", "stop", hex(Q1), "--rqprc", str(rqprc)).returncode == 0
    wait_for(lambda: '"event": "route_stop"' in a.output(sender, "stderr"), timeout=20,
             message="no route_stop event logged")  # (a trial: its line had no fields)
    lines = [json.loads(line) for line in a.output(sender, "stderr").splitlines()]
    stop = next(line for line in lines if line.get("event") == "route_stop")
    assert stop["queue_key"] == "0x52510001"
    received = [json.loads(line) for line in b.output(receiver, "stderr").splitlines()]
    opened = next(line for line in received if line.get("event") == "connection_opened")
    assert (opened["peer"], opened["level"]) == (a.address, "INFO")  # (as on dead letters)
    assert opened["address"].startswith(f"{a.address}:")
    bad = a.run([sys.executable, "-m", "rqp_agents.sender", "--rqprc", str(rqprc)],
                env={**os.environ, "RQP_LOG_FORMAT": "xml"}, check=False)
    assert bad.returncode == 2 and "unknown log format 'xml' (from $RQP_LOG_FORMAT)" in bad.stderr


def test_the_receivers_figures_keep_the_most_recently_busy_queues():
    """QueueFigures: at most ``memory`` queues, the least recently busy let go first, their
    figures added up, so that sums stay whole."""
    figures = QueueFigures(memory=2)
    figures.count(1, 0, 10)
    figures.count(2, 1)
    figures.count(1, 0, 5)  # 1 is the most recent now
    figures.count(3, 2)  # 2 goes
    assert list(figures.by_queue) == [1, 3] and figures.by_queue[1] == [2, 0, 0, 15]
    assert (figures.forgotten, figures.forgotten_queues) == ([0, 1, 0, 0], 1)
    figures.count(2, 0, 7)  # back, from zero; 1 goes
    assert list(figures.by_queue) == [3, 2] and figures.by_queue[2] == [1, 0, 0, 7]
    assert (figures.forgotten, figures.forgotten_queues) == ([2, 1, 0, 15], 2)


def test_receiver_metrics_over_http_and_rqpctl(site):
    a, b, rqprc, sender, receiver = site
    send(a, rqprc, Q1, ["m"])
    receive(b, Q1, 1)
    http = b.python("import urllib.request; print(urllib.request.urlopen("
                    "'http://127.0.0.1:9747/metrics', timeout=5).read().decode())")
    assert 'rqp_receiver_messages_total{outcome="put",queue="0x52510001"} 1.0\n' in http
    assert "rqp_receiver_connections 1" in http
    via_socket = rqpctl(b, "metrics", "--agent", "receiver", "--receiver-config",
                        str(b.workdir / "receiver.yaml")).stdout
    assert "rqp_receiver_connections 1" in via_socket
    missing = b.python("import urllib.request, urllib.error\ntry:\n    urllib.request."
                       "urlopen('http://127.0.0.1:9747/nothing', timeout=5)\nexcept urllib."
                       "error.HTTPError as e:\n    print(e.code)")
    assert missing.strip() == "404"


def test_queues_send_and_receive(site):
    a, b, rqprc, sender, receiver = site
    out = rqpctl(b, "queues", "--receiver-config", str(b.workdir / "receiver.yaml"))
    assert out.returncode == 0
    row = [l for l in out.stdout.splitlines() if l.startswith("0x52510001")]
    assert row and row[0].split()[-1] == "yes"
    out = rqpctl(a, "send", "PROD_THE_SCHED_COMMON", "hello operator", "--sync", "--rqprc",
                 str(rqprc))
    assert out.returncode == 0 and "journaled" in out.stdout
    out = b.run([*RQPCTL, "receive", "0x52510001", "--timeout", "20"], check=False)
    assert out.returncode == 0 and out.stdout.strip() == "hello operator"
    for text, mtype in (("typed seven", 7), ("typed two", 2)):
        out = rqpctl(a, "send", "PROD_THE_SCHED_COMMON", text, "--mtype", str(mtype),
                     "--priority", "9", "--ttl", "600", "--sync", "--rqprc", str(rqprc))
        assert out.returncode == 0, out.stderr
    out = b.run([*RQPCTL, "receive", "0x52510001", "--mtype", "-5", "--with-type",
                 "--timeout", "20"], check=False)  # the lowest type up to 5 first
    assert out.returncode == 0 and out.stdout == "2\ttyped two\n"
    out = b.run([*RQPCTL, "receive", "0x52510001", "--with-type", "--timeout", "2",
                 "--count", "2"], check=False)  # (one of two: a failure, and it says so)
    assert out.returncode == 1 and out.stdout == "7\ttyped seven\nno message within 2s (1 " \
        "of 2 taken)\n", out.stdout
    # System V's mtype is a long: one beyond a C int (a trial's stopped the receiving MCA,
    # and again at each start, as its sender sent it again)
    big = 2**31 + 5
    out = rqpctl(a, "send", "PROD_THE_SCHED_COMMON", "typed big", "--mtype", str(big),
                 "--sync", "--rqprc", str(rqprc))
    assert out.returncode == 0, out.stderr
    out = b.run([*RQPCTL, "receive", "0x52510001", "--mtype", str(big), "--with-type",
                 "--timeout", "20"], check=False)
    assert out.returncode == 0 and out.stdout == f"{big}\ttyped big\n", out.stdout + out.stderr
    assert receiver.poll() is None
    out = rqpctl(a, "send", "PROD_THE_SCHED_COMMON", "x", "--priority", "10", "--rqprc",
                 str(rqprc))
    assert out.returncode == 2 and "--priority" in out.stderr
    # a trial: --ttl 0 put nothing and exited 1, as a failure, where -1 was a usage error
    for ttl, why in (("0", "ttl must be at least 0.001 seconds"),
                     ("0.0001", "ttl must be at least 0.001 seconds"),
                     ("-1", "ttl must be at least 0.001 seconds"),
                     ("1e300", "ttl 1e+300 is past the year")):
        out = rqpctl(a, "send", "PROD_THE_SCHED_COMMON", "x", "--ttl", ttl, "--rqprc",
                     str(rqprc))
        assert out.returncode == 2 and f"argument --ttl: {why}" in out.stderr, out.stderr


def test_status_does_not_take_its_own_runtime_directory_for_the_agents(site, tmp_path):
    """A trial ran rqpctl status with RUNTIME_DIRECTORY set (as in a unit): both agents' socket
    was taken to be $RUNTIME_DIRECTORY/control.sock, so the sending MCA was shown twice, once
    as the receiver. That variable is for an agent's own socket, not for finding others."""
    a, b, rqprc, sender, receiver = site
    st = _sender_status(a, rqprc)  # (found in its state_dir)
    (tmp_path / "control.sock").symlink_to(
        a.workdir / "sender-state" / f"sender-{st['transmission_queue'][2:]}.sock")
    out = a.run([*RQPCTL, "status", "--rqprc", str(rqprc), "--json"], check=False, timeout=60,
                env={**os.environ, "RUNTIME_DIRECTORY": str(tmp_path)})
    answers = json.loads(out.stdout)
    assert answers["receiver"]["agent"] == "receiver" and "pid" not in answers["receiver"], \
        answers["receiver"]  # (none runs on a)
    assert [st["agent"] for st in answers.values() if "pid" in st] == ["sender"]


def test_an_agents_own_state_dir_socket_is_asked_before_the_services(tmp_path):
    """A trial ran a second receiver beside the service's: rqpctl queues --receiver-config of
    the second asked /run/rqp/receiver/control.sock first, and showed the service's answer."""
    from rqp.tools.ctl_agents import receiver_socket

    config = tmp_path / "second.yaml"
    config.write_text(f"state_dir: {tmp_path / 'second'}\n")
    assert receiver_socket(str(config)) == ("receiver", [
        tmp_path / "second" / "receiver.sock", Path("/run/rqp/receiver/control.sock")])


def test_status_of_a_config_is_not_answered_by_another_agent():
    """Trial 8: the config's own receiver was not running, and the service's answered on the
    unit's socket: its status, exit 0, for a dead receiver. An answer from an agent that is
    not the config's (listening elsewhere; serving another transmission queue) is no answer;
    a copy of the config (an application's) is the same agent's."""
    from rqp.config import ReceiverConfig, SenderConfig, parse_host
    from rqp.system.control import ControlError
    from rqp.tools.ctl_agents import _serving

    recv3 = ReceiverConfig(state_dir="/x/rs3", source="/x/recv3.yaml")
    assert _serving({"agent": "receiver", "state_dir": "/x/rs3"}, recv3)  # (a copy: the same)
    with pytest.raises(ControlError, match="no agent of /x/recv3.yaml answers .the one that "
                       "does keeps its state in /var/lib/rqp, not /x/rs3."):
        _serving({"agent": "receiver", "state_dir": "/var/lib/rqp"}, recv3)
    sender = SenderConfig(hosts=(parse_host("b:7460"),), transmission_queue=0x52510300)
    assert _serving({"agent": "sender", "transmission_queue": "0x52510300"}, sender)
    with pytest.raises(ControlError, match="serves transmission queue 0x52510000, not "
                       "0x52510300"):
        _serving({"agent": "sender", "transmission_queue": "0x52510000"}, sender)
    assert _serving({"agent": "receiver", "listen": "elsewhere"}, None)  # (none named)


def test_status_says_a_full_journal_is_no_unreadable_queue():
    from rqp.tools.ctl_agents import _trouble

    assert _trouble({"transmission_queue_trouble": "the journal cannot take SURE records: No "
                     "space left on device (/s/sender.journal); the records wait here"}) == \
        "; THE JOURNAL CANNOT TAKE SURE RECORDS: No space left on device " \
        "(/s/sender.journal); the records wait here"
    assert _trouble({"transmission_queue_trouble": "queue 0x52510000 was removed"}) == \
        "; CANNOT READ IT: queue 0x52510000 was removed"


def test_status_of_a_dead_letter_queue_removed_and_made_again(site):
    # A trial: after ipcrm of DEAD.LETTER.Q the status line said "DEAD.LETTER.Q 0x5251dead
    # (None)", and went on saying it after the queue was made again, until a dead letter.
    a, b, rqprc, sender, receiver = site
    send(a, rqprc, Q1, ["x"])
    assert receive(b, Q1, 1) == ["x"]
    a.python("import sysv_ipc; sysv_ipc.MessageQueue(0x5251DEAD).remove()")
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc))
    assert "DEAD.LETTER.Q 0x5251dead (unknown: not there, or not readable by this agent)" \
        in out.stdout, out.stdout
    make_queue(a, 0x5251DEAD, 0o660)
    a.python("import sysv_ipc; sysv_ipc.MessageQueue(0x5251DEAD).send(b'a record')")
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc))
    assert "DEAD.LETTER.Q 0x5251dead (1)" in out.stdout, out.stdout


def test_rqpctl_queues_lists_the_queues_and_what_the_receiver_offers(site):
    a, b, rqprc, sender, receiver = site
    send(a, rqprc, Q1, ["x"])
    assert receive(b, Q1, 1) == ["x"]
    out = rqpctl(b, "queues", "--receiver-config", str(b.workdir / "receiver.yaml"))
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert out.returncode == 0 and rows["0x52510001"].endswith(" yes"), out.stdout
    # A host that only receives has no .rqprc: a name is looked up in the receiver's config.
    send(a, rqprc, Q1, ["by name"])
    env = {k: v for k, v in os.environ.items() if k != "RQPRC"} | {"HOME": str(b.workdir)}
    out = b.run([*RQPCTL, "receive", "PROD_THE_SCHED_COMMON", "--timeout", "20",
                 "--receiver-config", str(b.workdir / "receiver.yaml")], check=False,
                env=env, cwd=b.workdir)
    assert out.returncode == 0 and out.stdout == "by name\n", out.stdout + out.stderr
    out = b.run([*RQPCTL, "receive", "PROD_THE_SCHED_COMON", "--receiver-config",
                 str(b.workdir / "receiver.yaml")], check=False, env=env, cwd=b.workdir)
    assert out.returncode == 2 and "PROD_THE_SCHED_COMMON" in out.stderr, out.stderr
    out = b.run([*RQPCTL, "receive", "PROD_THE_SCHED_COMMON"], check=False, env=env,
                cwd=b.workdir)
    assert out.returncode == 2 and "--receiver-config" in out.stderr, out.stderr
    out = rqpctl(a, "queues")  # (no receiver on a: 'offered' unknown, but never its own)
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert "no receiving MCA answers at its control socket" in out.stdout.splitlines()[0]
    assert rows["0x52510000"].endswith(" no (an agent's own)"), out.stdout  # the agents' own
    assert rows["0x5251dead"].endswith(" no (an agent's own)"), out.stdout


def test_sighup_reload_keeps_connections_and_refuses_a_bad_file(site, testbed):
    a, b, rqprc, sender, receiver = site
    c = testbed.add_host("c")
    start_receiver(c)
    make_queue(c, Q2)
    send(a, rqprc, Q1, ["x"])
    assert receive(b, Q1, 1) == ["x"]
    connected = len(log_lines(a, sender, "connected peer="))
    good = rqprc.read_text()
    rqprc.write_text(good.replace("hosts:", f"hosts:\n  - {c.address}:{PORT}"))
    sender.send_signal(signal.SIGHUP)
    [reloaded] = wait_for(lambda: log_lines(a, sender, "reloaded"), timeout=20,
                          message="no reload")
    assert ": hosts; hosts " in reloaded, reloaded  # what changed, by name
    # as at a start, the log names a new host RQP goes to in plaintext (b was named at start)
    assert [l.split("plaintext RQP/1 to ")[1] for l in
            log_lines(a, sender, "plaintext RQP/1 to")] == [
        f"{h.address}:{PORT}, as {rqprc} says ('plaintext: true')" for h in (b, c)]
    send(a, rqprc, Q2, ["only on c"])
    assert receive(c, Q2, 1) == ["only on c"]
    send(a, rqprc, Q1, ["still b"])
    assert receive(b, Q1, 1) == ["still b"]
    # the connection to b survived the reload: one new connection only, to c
    assert len(log_lines(a, sender, "connected peer=")) == connected + 1
    with_c = rqprc.read_text()
    api_rqprc = rqprc.with_name("api.yaml")  # the applications keep a good copy
    api_rqprc.write_text(with_c)
    rqprc.write_text(with_c + "ask_timout: 1s\n")
    sender.send_signal(signal.SIGHUP)
    refused = wait_for(lambda: log_lines(a, sender, "reload refused"), timeout=20,
                       message="a bad file was not refused")
    assert "ask_timout" in refused[0] and "did you mean 'ask_timeout'" in refused[0]
    send(a, api_rqprc, Q2, ["after a refused reload"])
    assert receive(c, Q2, 1) == ["after a refused reload"]
    # ...and it is seen where an operator looks, not only in the log: the agent now runs a
    # config that is not its file's (status exit 4, the metric the alert reads)
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(api_rqprc))
    assert out.returncode == 4, out.stdout + out.stderr
    assert re.search(r"\n  RELOAD REFUSED \d+s ago, still running the config it had: "
                     rf"{re.escape(str(rqprc))}: .*ask_timout", out.stdout), out.stdout
    metrics = rqpctl(a, "metrics", "--agent", "sender", "--rqprc", str(api_rqprc)).stdout
    assert "\nrqp_config_last_reload_successful 0.0\n" in metrics, metrics
    # and with the file itself, the mistake and all (a trial: exit 2 at the file's mistake,
    # nothing of the running agent shown)
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc))
    assert out.returncode == 4, out.stdout + out.stderr
    assert out.stdout.startswith(f"sender: CONFIG HAS A MISTAKE: {rqprc}: ") and \
        "ask_timout" in out.stdout.splitlines()[0], out.stdout
    assert "RELOAD REFUSED" in out.stdout, out.stdout
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc), "--json")
    st = next(iter(json.loads(out.stdout).values()))
    assert out.returncode == 4 and "ask_timout" in st["config_mistake"], out.stdout
    # a file with a mistake whose agent does not run: the mistake, exit 2, as ever
    stray = rqprc.with_name("stray.yaml")
    stray.write_text(with_c + "ask_timout: 1s\n")
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(stray))
    assert out.returncode == 2 and f"{stray}: " in out.stderr, out.stdout + out.stderr
    rqprc.write_text(with_c)  # put right: the next reload is taken, and the status healthy
    sender.send_signal(signal.SIGHUP)
    wait_for(lambda: len(log_lines(a, sender, "reloaded")) == 2, timeout=20, message="no reload")
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(api_rqprc), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    st = next(iter(json.loads(out.stdout).values()))
    assert st["last_reload"]["ok"] is True and st["version"] == rqp.__version__
    metrics = rqpctl(a, "metrics", "--agent", "sender", "--rqprc", str(api_rqprc)).stdout
    assert "\nrqp_config_last_reload_successful 1.0\n" in metrics, metrics

    # the receiver: stop offering Q1, connections stay
    (b.workdir / "receiver.yaml").write_text(receiver_config(b, "offer:\n  deny: [0x52510001]\n"))
    receiver.send_signal(signal.SIGHUP)
    wait_for(lambda: log_lines(b, receiver, "reloaded"), timeout=20, message="no reload")
    out = rqpctl(b, "status", "--agent", "receiver", "--receiver-config",
                 str(b.workdir / "receiver.yaml"), "--json")
    st = next(iter(json.loads(out.stdout).values()))
    assert {q["queue"]: q["offered"] for q in st["queues"]}["0x52510001"] is False
    assert len(st["connections"]) == 1

    # Settings only a start applies: the reload is refused, and says so. (A trial: "reloaded:
    # control_socket None -> ..., metrics_listen" while neither moved, and rqpctl status with
    # the new file then said the running agents were not running.)
    moved = receiver_config(b, f"control_socket: {b.workdir}/other.sock\n").replace(
        "':9747'", "':9757'").replace(f"control_socket: {b.workdir}/receiver.sock\n", "")
    (b.workdir / "receiver.yaml").write_text(moved)
    receiver.send_signal(signal.SIGHUP)
    [refused] = wait_for(lambda: log_lines(b, receiver, "reload refused"), timeout=20,
                         message="a reload moving the sockets was not refused")
    assert re.search(r"control_socket \S+/receiver.sock -> \S+/other.sock; metrics_listen "
                     r"\S*:9747 -> \S*:9757: cannot change while running, restart the "
                     "receiving MCA for that", refused), refused
    before = len(log_lines(a, sender, "reload refused"))
    rqprc.write_text(with_c.replace(":9746", ":9756"))
    sender.send_signal(signal.SIGHUP)
    refused = wait_for(lambda: log_lines(a, sender, "reload refused")[before:], timeout=20,
                       message="a reload moving the metrics was not refused")
    assert re.search(r"metrics_listen \S*:9746 -> \S*:9756: cannot change while running, "
                     "restart the sending MCA for that", refused[-1]), refused
    before += 1
    rqprc.write_text(with_c + "transmission_queue: 0x52510100\n")
    sender.send_signal(signal.SIGHUP)
    refused = wait_for(lambda: log_lines(a, sender, "reload refused")[before:], timeout=20,
                       message="a reload moving the transmission queue was not refused")
    assert "transmission_queue 0x52510000 -> 0x52510100: cannot change" in refused[-1], refused
    running = b.workdir / "running.yaml"  # what the receiver still runs with
    running.write_text(receiver_config(b))
    for host, agent, config in ((a, "sender", ["--rqprc", str(api_rqprc)]),
                                (b, "receiver", ["--receiver-config", str(running)])):
        out = rqpctl(host, "status", "--agent", agent, *config)  # (found, and running...)
        assert out.returncode == 4, out.stdout + out.stderr  # (...what its file no longer says)
        assert "RELOAD REFUSED" in out.stdout and "cannot change while running" in out.stdout
    # ...and with the moved files themselves, which say to look where nothing listens (a
    # trial: "not running", exit 3): the agent that runs that file is found where it listens
    for host, agent, config in ((a, "sender", ["--rqprc", str(rqprc)]),
                                (b, "receiver", ["--receiver-config",
                                                 str(b.workdir / "receiver.yaml")])):
        out = rqpctl(host, "status", "--agent", agent, *config)
        assert out.returncode == 4, out.stdout + out.stderr
        assert out.stdout.startswith(f"{agent}: RUNS AN EARLIER ") and "RELOAD REFUSED" in \
            out.stdout and "a restart takes it" in out.stdout.splitlines()[0], out.stdout
    # a file that is no YAML at all, whose agent keeps its state_dir out of the defaults (a
    # trial: exit 2 and the YAML mistake alone)
    rqprc.write_text("hosts: [b, \n")
    out = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc))
    assert out.returncode == 4, out.stdout + out.stderr
    assert out.stdout.startswith(f"sender: CONFIG HAS A MISTAKE: {rqprc}: line 2, column 1: "
                                 "invalid YAML") and "\nsender   pid " in out.stdout, out.stdout


def test_rqpctl_send_starts_a_sending_mca_as_the_api_does(testbed):
    """Issue 10: rqpctl send only warned that nothing served the transmission queue, while
    openConnection starts a sending MCA. Now both start one; --no-start only puts."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b, config=receiver_config(b))
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b], queues={"PROD_THE_SCHED_COMMON": Q1})
    out = rqpctl(a, "send", "PROD_THE_SCHED_COMMON", "waited", "--no-start", "--rqprc",
                 str(rqprc))
    assert out.returncode == 3 and "it waits there" in out.stdout, out.stdout + out.stderr
    out = rqpctl(a, "send", "PROD_THE_SCHED_COMMON", "started", "--sync", "--rqprc", str(rqprc))
    assert out.returncode == 0 and "warning" not in out.stdout, out.stdout + out.stderr
    assert receive(b, Q1, 2) == ["waited", "started"]


FILL_DLQ = r"""
import sysv_ipc
q = sysv_ipc.MessageQueue(0x5251DEAD, sysv_ipc.IPC_CREAT, mode=0o660, max_message_size=8192)
n = 0
while True:
    try:
        q.send(b"f" * 1024, block=False, type=1)
    except sysv_ipc.BusyError:
        break
    n += 1
print(n)
"""

GARBAGE = r"""
import sys, sysv_ipc
q = sysv_ipc.MessageQueue(0x52510000, max_message_size=8192)
for i in range(int(sys.argv[1])):
    q.send(b"garbage %d" % i, type=1)
"""


def test_a_full_dead_letter_queue_holds_dead_letters_with_one_retry_and_two_lines(site):
    """A trial's flood of bad records with DEAD.LETTER.Q full made one retry timer and one
    ERROR line per dead letter held (25,000 lines a second). Now: one line when it fills, the
    number held in rqpctl status and the metrics, one line when it takes them again, every
    dead letter written, in order."""
    a, b, rqprc, sender, receiver = site
    filled = int(a.python(FILL_DLQ))
    a.python(GARBAGE, "300")

    def status():
        return next(iter(json.loads(rqpctl(a, "status", "--agent", "sender", "--rqprc",
                                           str(rqprc), "--json").stdout).values()))
    wait_for(lambda: status()["dead_letters_held"] == 300, timeout=60,
             message="the dead letters were not held")
    shown = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc))
    assert f"({filled}; 300 more held in memory: it was full)" in shown.stdout
    assert shown.returncode == 4  # (a monitoring check on the exit status sees it)
    assert "rqp_sender_dead_letters_held 300" in rqpctl(
        a, "metrics", "--agent", "sender", "--rqprc", str(rqprc)).stdout
    assert len(log_lines(a, sender, "is full: dead letters are held in memory")) == 1
    got = []
    while len(got) < filled + 300:  # take them off as they come: the held ones follow
        n = len(got)
        got += json.loads(a.python(TAKE_DLQ))
        if len(got) == n:
            wait_for(lambda: a.python(DLQ_DEPTH).strip() != "0", timeout=30,
                     message=f"DEAD.LETTER.Q stays empty after {len(got)} records")
    assert got[:filled] == ["f" * 1024] * filled
    assert got[filled:] == [f"garbage {i}" for i in range(300)]
    wait_for(lambda: log_lines(a, sender, "takes dead letters again"), timeout=30,
             message="no line when DEAD.LETTER.Q took them")
    assert len(log_lines(a, sender, "is full: dead letters are held in memory")) == 1
    assert status()["dead_letters_held"] == 0 and sender.poll() is None
    assert rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc)).returncode == 0


BIG_GARBAGE = r"""
import sys, sysv_ipc
q = sysv_ipc.MessageQueue(0x52510000, max_message_size=8192)
for i in range(int(sys.argv[1])):  # (as dead letters, larger than one message: spilled)
    q.send(b"%d" % i + b"G" * 8180, type=1)
"""

def _sender_status(a, rqprc) -> dict:
    return next(iter(json.loads(rqpctl(a, "status", "--agent", "sender", "--rqprc",
                                       str(rqprc), "--json").stdout).values()))


def test_trace_says_a_dead_letter_held_in_memory_is_not_on_the_queue_yet(site):
    """A trial: while DEAD.LETTER.Q was full, trace said "dead-lettered" of a dead letter the
    sending MCA held in memory (lost if it stopped). It says so now, until it is written."""
    a, b, rqprc, sender, receiver = site
    filled = int(a.python(FILL_DLQ))
    send(a, rqprc, Q2, ["nowhere"], mtype=1)  # UNSURE, no host offers Q2: NO_ROUTE
    st = wait_for(lambda: (st := _sender_status(a, rqprc))["dead_letters_held"] == 1 and st,
                  timeout=60, message="the dead letter was not held")
    key = (int(st["incarnation"], 16) << 32) + 1

    def trace():
        out = rqpctl(a, "trace", hex(key), "--agent", "sender", "--rqprc", str(rqprc),
                     "--json")
        return next(iter(json.loads(out.stdout).values()))
    t = trace()
    assert t["state"] == "dead-lettered NO_ROUTE" and t["held_in_memory"] == "it was full", t
    text = rqpctl(a, "trace", hex(key), "--agent", "sender", "--rqprc", str(rqprc)).stdout
    assert "; held in memory, not yet on DEAD.LETTER.Q (it was full): lost if the sending " \
        "MCA stops, unless SURE" in text, text
    got = []
    wait_for(lambda: got.extend(json.loads(a.python(TAKE_DLQ))) or len(got) == filled + 1,
             timeout=60, message=f"the dead letter was not written: {len(got)}")
    wait_for(lambda: _sender_status(a, rqprc)["dead_letters_held"] == 0, timeout=30,
             message="still held")
    assert "held_in_memory" not in trace()


def test_dead_letters_held_have_one_spill_file_at_most(site):
    """Held while DEAD.LETTER.Q is full, dead letters too large for one message used to be
    spilled when held: a kill -9 then left a spill file per record held, never removed, and
    counted against spill_limit. Now only the next one to be written has its file."""
    a, b, rqprc, sender, receiver = site
    spill = a.workdir / "sender-state" / "spill"
    filled = int(a.python(FILL_DLQ))
    a.python(BIG_GARBAGE, "5")
    wait_for(lambda: _sender_status(a, rqprc)["dead_letters_held"] == 5, timeout=60,
             message="the dead letters were not held")
    assert len(list(spill.iterdir())) == 1
    got = []
    wait_for(lambda: got.extend(json.loads(a.python(TAKE_DLQ, "spilled")))
             or len(got) == filled + 5, timeout=60, message=f"not every one was written: {got}")
    assert got[filled:] == [[8181, f"{i}GGG"] for i in range(5)]  # (each file: the whole)
    assert _sender_status(a, rqprc)["dead_letters_held"] == 0 and sender.poll() is None


def test_a_spill_file_that_cannot_be_written_holds_the_dead_letters(site):
    """A dead letter's spill file that could not be written (the state directory full or
    broken) stopped the sending MCA (exit 70) and lost the record. Now it is held, with
    those behind it, in order, and status says why, until the file can be written."""
    a, b, rqprc, sender, receiver = site
    spill = a.workdir / "sender-state" / "spill"
    spill.write_text("not a directory\n")  # (ENOTDIR: as ENOSPC would, for root too)
    a.python(BIG_GARBAGE, "2")
    a.python(GARBAGE, "1")  # (small, behind them: waits its turn)
    st = wait_for(lambda: (st := _sender_status(a, rqprc))["dead_letters_held"] == 3 and st,
                  timeout=60, message="the dead letters were not held")
    why = f"cannot write a spill file in {spill}: Not a directory"
    assert st["dead_letters_held_why"] == why
    shown = rqpctl(a, "status", "--agent", "sender", "--rqprc", str(rqprc))
    assert f"3 more held in memory: {why})" in shown.stdout and shown.returncode == 4
    assert len(log_lines(a, sender, why)) == 1 and sender.poll() is None
    spill.unlink()
    got = []  # (two spilled records fill it: taken off as they come)
    wait_for(lambda: got.extend(json.loads(a.python(TAKE_DLQ))) or len(got) == 3,
             timeout=60, message=f"not every dead letter was written: {got}")
    assert [text[:2] for text in got] == ["0G", "1G", "ga"] and got[2] == "garbage 0"
    assert len(list(spill.iterdir())) == 2
    assert log_lines(a, sender, "spill files of dead letters can be written again")
    assert _sender_status(a, rqprc)["dead_letters_held_why"] is None


TAKE_DLQ = r"""
import json, sys, sysv_ipc
from rqp.protocol.records import DeadLetterRecord
q = sysv_ipc.MessageQueue(0x5251DEAD, max_message_size=1 << 16)
out = []
while True:
    try:
        data, _ = q.receive(block=False)
    except sysv_ipc.BusyError:
        break
    if data.startswith(b"f"):
        out.append(data.decode())
    elif sys.argv[1:] == ["spilled"]:  # its full length, and its spill file's first bytes
        record = DeadLetterRecord.from_bytes(data)
        with open(record.spill_path, "rb") as f:
            out.append([record.original_length, f.read(4).decode()])
    else:
        out.append(DeadLetterRecord.from_bytes(data).payload.decode())
print(json.dumps(out))
"""

DLQ_DEPTH = "import sysv_ipc; print(sysv_ipc.MessageQueue(0x5251DEAD).current_messages)"


TAKE_N = r"""
import json, signal, sys, sysv_ipc
from rqp.protocol.records import DeadLetterRecord
signal.alarm(120)  # (a blocking receive that never ends fails the test, not the suite)
q = sysv_ipc.MessageQueue(0x5251DEAD, max_message_size=1 << 16)
out = []
for _ in range(int(sys.argv[1])):
    data, _ = q.receive()
    out.append(data.decode() if data.startswith(b"f") else
               DeadLetterRecord.from_bytes(data).payload.decode())
print(json.dumps(out))
"""


def test_dead_letters_held_are_bounded_and_the_transmission_queue_waits(site):
    """A flood of bad records while DEAD.LETTER.Q is full: beyond DEAD_LETTERS_HELD_MAX held,
    each one keeps its place in the reader's budget, so the sending MCA stops taking records
    (they wait in the kernel queue) instead of growing; all are written, in order, after."""
    from rqp_agents.sender import DEAD_LETTERS_HELD_MAX

    a, b, rqprc, sender, receiver = site
    filled = int(a.python(FILL_DLQ))
    most = DEAD_LETTERS_HELD_MAX + budget_size(256, 1)  # (the default window, one host)
    total = most + 300
    producer = a.popen([sys.executable, "-c", GARBAGE, str(total)])

    def status():
        return next(iter(json.loads(rqpctl(a, "status", "--agent", "sender", "--rqprc",
                                           str(rqprc), "--json").stdout).values()))
    st = wait_for(lambda: (st := status())["dead_letters_held"] >= most
                  and st["transmission_queue_depth"] > 0 and st, timeout=120,
                  message="the sending MCA did not hold its most")
    assert st["dead_letters_held"] == most
    assert len(log_lines(a, sender, "dead letters held in memory: the sending MCA takes at "
                                    f"most {budget_size(256, 1)} more records")) == 1
    got = json.loads(a.python(TAKE_N, str(filled + total), timeout=150))
    assert got[:filled] == ["f" * 1024] * filled
    assert got[filled:] == [f"garbage {i}" for i in range(total)]
    assert producer.wait(30) == 0
    wait_for(lambda: status()["dead_letters_held"] == 0, timeout=30, message="still held")
    assert sender.poll() is None


def test_agents_started_by_a_process_that_holds_signals_still_stop_and_reload(testbed):
    """A signal mask survives exec: a sending MCA started by an application that held SIGTERM
    (a signal thread of its own, through openConnection) ran on after SIGTERM. Each agent now
    starts with no signal held: it reloads on SIGHUP, stops on SIGTERM, and the sending MCA's
    reader thread (woken by SIGUSR1) lets it stop."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    receiver = start_receiver(b, prefix=HOLDING_SIGNALS)
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    sender = start_sender(a, rqprc, prefix=HOLDING_SIGNALS)
    for agent in (receiver, sender):
        assert held_signals(Path(f"/proc/{agent.pid}/status").read_text()) == set()
    send(a, rqprc, Q1, ["through"], SURE_MSG)
    assert receive(b, Q1, 1) == ["through"]
    for host, agent in ((a, sender), (b, receiver)):
        agent.send_signal(signal.SIGHUP)
        wait_for(lambda: log_lines(host, agent, "reloaded "), timeout=20, message="no reload")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0, host.output(agent, "stderr")[-2000:]


def test_a_sighup_while_an_agent_starts_is_a_reload_once_it_runs(testbed):
    """A fresh machine's suite: a SIGHUP sent once the receiver said "listening", before it
    had its handlers, ended it (Python's default). One that comes while an agent starts is
    kept, and taken as a reload once it runs. Sent while the process still holds SIGHUP (as a
    starter that holds it: pending until the agent lets go of it), for each agent."""
    a = testbed.add_host("a")
    rqprc = write_rqprc(a, [a])
    for argv in ([sys.executable, "-m", "rqp_agents.receiver", "--listen", f"{a.address}:{PORT}",
                  "--plaintext", "--state-dir", str(a.workdir / "receiver-state"),
                  "--config", str(a.workdir / "receiver.yaml")],
                 [sys.executable, "-m", "rqp_agents.sender", "--rqprc", str(rqprc)]):
        (a.workdir / "receiver.yaml").write_text("offer:\n  allow: ['*']\n")
        agent = a.popen([*HOLDING_SIGNALS, *argv])
        wait_for(lambda: signal.SIGHUP in held_signals(
            Path(f"/proc/{agent.pid}/status").read_text()), timeout=20, interval=0.001,
            message="not started holding SIGHUP")
        agent.send_signal(signal.SIGHUP)  # (pending until the agent lets go of it)
        wait_for(lambda: log_lines(a, agent, "reloaded "), timeout=30,
                 message="the SIGHUP was not taken as a reload")
        assert agent.poll() is None
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0, a.output(agent, "stderr")[-2000:]


def test_only_root_or_the_agents_user_may_act_on_routes(testbed):
    """Trial C: an application user in the agents' group (as the README asks, for the queues)
    could stop a route over the control socket (mode 0660). Status, metrics and trace stay
    open to the group; route and ping (it connects with the agent's TLS identity) are taken
    from root or the agent's own user only."""
    import shutil
    import tempfile

    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b)
    make_queue(b, Q1)
    shared = Path(tempfile.mkdtemp(prefix="rqp-ctl-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        sock = shared / "sender.sock"
        rqprc = write_rqprc(a, [b], control_socket=str(sock),
                            queues={"PROD_THE_SCHED_COMMON": Q1})
        start_sender(a, rqprc)
        sock.chmod(0o666)  # (uid 65534 stands for a member of the socket's group)
        as_app = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *RQPCTL]
        status = a.run([*as_app, "status", "--socket", str(sock)], check=False, timeout=60)
        assert status.returncode == 0 and "sender" in status.stdout, status.stdout + \
            status.stderr
        for args in (["route", "stop", hex(Q1)], ["ping", f"{b.address}:{PORT}"]):
            out = a.run([*as_app, *args, "--socket", str(sock)], check=False, timeout=60)
            assert out.returncode == 2 and "not allowed for uid 65534: only root or the " \
                "agent's own user may (route, ping)" in out.stdout + out.stderr, \
                out.stdout + out.stderr
        out = a.run([*RQPCTL, "route", "stop", hex(Q1), "--socket", str(sock)], check=False,
                    timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_metrics_comments_stay_one_line_and_trace_names_a_few_peers():
    """Re-check: a path with a newline split a '# ... none answers here' comment of rqpctl
    metrics in two (promtool failed on the second half); trace's line of a key 1,024 peers
    used was 86 KB long."""
    from rqp.tools.ctl_agents import TRACE_ALSO_SHOWN, _comment, _trace_line

    assert _comment("no .rqprc in /tmp/a\nb\\c\r") == "# no .rqprc in /tmp/a\\nb\\\\c\\r"
    put = "put (SURE; its key is in the de-duplication window)"
    also = [{"state": put, "peer": f"10.0.0.{i}", "at": 90.0} for i in range(7)]
    line = _trace_line({"state": put, "peer": "10.0.0.99", "at": 95.0, "also": also}, 100.0)
    assert line.count("; also ") == TRACE_ALSO_SHOWN and \
        line.endswith("; and 2 more peer(s) (--json lists them)"), line


def test_a_config_with_a_mistake_is_asked_where_its_tilde_paths_lead(tmp_path, monkeypatch):
    """Re-check: a config with a mistake and state_dir "~/sc" (which the agents expand) was
    looked for in ./~/sc: its running agent was not found, exit 2."""
    from rqp.tools.ctl_agents import _despite

    home = tmp_path / "home"
    (home / "sc").mkdir(parents=True)
    (home / "sc" / "receiver.sock").touch()
    monkeypatch.setenv("HOME", str(home))
    config = tmp_path / "r.yaml"
    config.write_text('state_dir: "~/sc"\ncontrol_socket: "~/ctl.sock"\ntypo: 1\n')
    got = _despite(str(config), "/run/rqp/receiver/control.sock", "receiver")
    assert got[:2] == [home / "ctl.sock", home / "sc" / "receiver.sock"], got


def test_status_looks_for_an_agent_only_among_sockets_of_root_this_user_or_rqp(tmp_path):
    """A re-check: a socket named receiver.sock that user nobody made answered for the
    running agent (its pid and host forged), when status looked beyond where the config
    says. Only sockets made by root, the user running rqpctl, or the agents' user count."""
    import socket as _socket
    from rqp.tools.ctl_agents import listening_agents
    path = tmp_path / "receiver.sock"
    with _socket.socket(_socket.AF_UNIX) as sock:
        sock.bind(str(path))
        sock.listen()
        assert path in listening_agents("receiver")
        os.chown(path, 65534, 65534)  # as if user nobody had made it
        assert path not in listening_agents("receiver")


def _forge(path: Path, source: Path, ready: int) -> None:
    """In a forked child, as user nobody: listen on ``path`` and answer as the agent of
    ``source`` (say so on the pipe ``ready``), until killed."""
    import socket as _socket
    os.setgid(65534)
    os.setuid(65534)
    srv = _socket.socket(_socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen()
    os.write(ready, b"!")
    while True:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(json.dumps({"agent": "receiver", "pid": os.getpid(),
                                 "source": str(source)}).encode())
        conn.close()


def test_status_does_not_take_the_answer_of_a_process_of_another_user(tmp_path):
    """A re-check: the owner of a socket's path was checked, then the path swapped (a link in
    a world-writable directory) to one bound by user nobody, which answered as the agent.
    The process that answers must run as root, this user or rqp (SO_PEERCRED)."""
    import shutil
    import tempfile
    from rqp.system.control import ControlError
    from rqp.tools.ctl_agents import _ask_of_file
    shared = Path(tempfile.mkdtemp(prefix="rqp-forge-", dir="/tmp"))  # (nobody may reach it)
    shared.chmod(0o777)
    path, source = shared / "receiver.sock", tmp_path / "receiver.yaml"
    source.write_text("listen: [not yaml\n")
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            _forge(path, source, ready_w)
        finally:
            os._exit(1)
    try:
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"!"
        os.chown(path, 0, 0)  # (as if the path now led to root's socket: the swap)
        with pytest.raises(ControlError, match=r"runs as uid 65534, not as an agent's user"):
            _ask_of_file([], str(source), "receiver")
    finally:
        os.close(ready_r)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        shutil.rmtree(shared)
