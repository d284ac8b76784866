"""Helpers for tests that run the real agents on simulated hosts (see tests/testbed.py)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from tests.testbed import wait_for

PORT = 7460
DLQ = 0x5251DEAD


def descendants(pid: int) -> list[int]:
    """The processes started, directly or not, by ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # (gone meanwhile)
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Is ``pid`` a process that runs (not gone, not a zombie)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


#: A command prefix: runs the command holding the signals a program stops or reloads on, as a
#: process with a signal-waiting thread would start it (a signal mask survives exec).
HOLDING_SIGNALS = [sys.executable, "-c", r"""
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                          signal.SIGUSR1})
os.execv(sys.argv[1], sys.argv[1:])
"""]


def held_signals(status: str) -> set[signal.Signals]:
    """The signals a process (or thread) holds, from the text of its /proc status file."""
    mask = int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("SigBlk:")), 16)
    return {s for s in signal.Signals if mask & (1 << (s - 1))}


#: What the tests' receivers (root on their own namespaced hosts) offer unless a test's config
#: says otherwise: as root, a receiver offers only what offer.allow lists.
OFFER_ALL = "offer:\n  allow: ['*']\n"


def start_receiver(host, *, config: str | None = None, log_level: str = "DEBUG", extra=(),
                   prefix=()):
    """A receiving MCA on ``host``'s address; plaintext (``--plaintext``) unless ``config``
    has a ``tls:`` block, offering every queue unless it has an ``offer:``. ``prefix``: a
    command that runs it (strace)."""
    argv = [sys.executable, "-m", "rqp_agents.receiver", "--listen", f"{host.address}:{PORT}",
            "--state-dir", str(host.workdir / "receiver-state"), "--log-level", log_level]
    config = config or ""
    if "offer:" not in config:
        config += "\n" + OFFER_ALL
    if "tls:" not in config:
        argv.append("--plaintext")
    path = host.workdir / "receiver.yaml"
    path.write_text(config)
    argv += ["--config", str(path)]
    proc = host.popen([*prefix, *argv, *extra])
    wait_for(lambda: "listening on" in host.output(proc, "stderr") or proc.poll() is not None,
             timeout=20, message=f"receiver on {host.name} did not start")
    assert proc.poll() is None, host.output(proc, "stderr")
    return proc


def write_rqprc(host, receivers, **settings) -> Path:
    values = {"ask_timeout": "1s", "confirm_timeout": "3s", "retry_backoff_initial": "0.1s",
              "retry_backoff_max": "1s", "state_dir": str(host.workdir / "sender-state"),
              # (to another host without TLS: plaintext on purpose, as .rqprc must say)
              **({} if "tls" in settings else {"plaintext": True}), **settings}
    lines = ["hosts:"] + [f"  - {r.address}:{PORT}" for r in receivers]
    lines += [f"{k}: {json.dumps(v) if isinstance(v, (str, dict)) else v}"
              for k, v in values.items()]
    path = host.workdir / f"rqprc-{len(list(host.workdir.glob('rqprc-*')))}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_sender(host, rqprc: Path, log_level: str = "DEBUG", extra=(), prefix=()):
    """A sending MCA on ``host``; ``prefix``: a command that runs it."""
    proc = host.popen([*prefix, sys.executable, "-m", "rqp_agents.sender", "--rqprc", str(rqprc),
                       "--log-level", log_level, *extra])
    wait_for(lambda: "serving transmission queue" in host.output(proc, "stderr")
             or proc.poll() is not None, timeout=20, message=f"sender on {host.name} did not start")
    assert proc.poll() is None, host.output(proc, "stderr")
    return proc


class Pair:
    """Host a with a sending MCA, host b with a receiving MCA (or none yet) and a queue."""

    def __init__(self, bed, queue: int, *, receiver: bool = True,
                 receiver_config: str | None = None) -> None:
        self.a, self.b = bed.add_host("a"), bed.add_host("b")
        self.receiver = start_receiver(self.b, config=receiver_config) if receiver else None
        make_queue(self.b, queue)
        self.rqprc = write_rqprc(self.a, [self.b])
        self.sender = start_sender(self.a, self.rqprc)


def make_queue(host, key: int, mode: int = 0o600) -> None:
    host.python("import sys, sysv_ipc; sysv_ipc.MessageQueue(int(sys.argv[1]), "
                "sysv_ipc.IPC_CREAT, mode=int(sys.argv[2]))", str(key), str(mode))


def remove_queue(host, key: int) -> None:
    host.python("import sys, sysv_ipc; sysv_ipc.MessageQueue(int(sys.argv[1])).remove()",
                str(key))


SEND = r"""
import json, sys, rqp
rqprc, key, mtype, payloads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
h = rqp.openConnection(key, rqprc=rqprc, start_sender=False)
for p in payloads:
    rqp.sendMessage(h, p.encode(), mtype)
rqp.closeConnection(h)
"""

SEND_SEQUENCE = r"""
import sys, rqp
rqprc, key, mtype, prefix, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
h = rqp.openConnection(key, rqprc=rqprc, start_sender=False)
for i in range(count):
    rqp.sendMessage(h, f"{prefix}{i}".encode(), mtype)
rqp.closeConnection(h)
"""


def send(host, rqprc: Path, key: int, payloads, mtype: int = 0) -> None:
    host.python(SEND, str(rqprc), str(key), str(mtype), json.dumps(list(payloads)))


def send_sequence(host, rqprc: Path, key: int, prefix: str, count: int, mtype: int = 0) -> None:
    host.python(SEND_SEQUENCE, str(rqprc), str(key), str(mtype), prefix, str(count), timeout=120)


RECEIVE = r"""
import json, sys, time, sysv_ipc
key, count, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
got = []
try:
    q = sysv_ipc.MessageQueue(key, max_message_size=1 << 16)
    while len(got) < count and time.monotonic() < deadline:
        try:
            data, mtype = q.receive(block=False)
            got.append([data.decode(errors="replace"), mtype])
        except sysv_ipc.BusyError:
            time.sleep(0.005)
except sysv_ipc.ExistentialError:
    pass
print(json.dumps(got))
"""


def receive(host, key: int, count: int, timeout: float = 30.0) -> list[str]:
    """Up to ``count`` messages from queue ``key`` on ``host`` (fewer if ``timeout`` passes)."""
    got = json.loads(host.python(RECEIVE, str(key), str(count), str(timeout),
                                 timeout=timeout + 30))
    assert all(mtype == 1 for _, mtype in got), got
    return [data for data, _ in got]


DEAD_LETTERS = r"""
import json, sys, sysv_ipc
from rqp.protocol.records import DeadLetterRecord
out = []
try:
    q = sysv_ipc.MessageQueue(int(sys.argv[1]), max_message_size=1 << 16)
    while True:
        try:
            data, _ = q.receive(block=False)
        except sysv_ipc.BusyError:
            break
        r = DeadLetterRecord.from_bytes(data)
        out.append({"reason": r.reason.name, "queue_key": r.queue_key, "key": r.message_key,
                    "type": r.message_type, "payload": r.payload.decode(errors="replace"),
                    "detail": r.detail, "host": r.host, "source": r.source_host,
                    "destination": r.destination_host, "attempts": r.attempts,
                    "mtype": r.mtype, "priority": r.priority})
except sysv_ipc.ExistentialError:
    pass
print(json.dumps(out))
"""


def dead_letters(host, dlq: int = DLQ) -> list[dict]:
    return json.loads(host.python(DEAD_LETTERS, str(dlq)))


def log_lines(host, proc, needle: str) -> list[str]:
    return [line for line in host.output(proc, "stderr").splitlines() if needle in line]
