"""The order of a SURE message's system calls in the real sending MCA, watched with strace
(issue 14: batching must not trade SURE's promise): its journal APPEND is fsynced before the
record is taken off the transmission queue (what sendMessage(sync=True) waits for) and before
its MESSAGE frame is written to the receiving MCA."""

from __future__ import annotations

import re
import shutil
import sys

import pytest

from tests.agents import make_queue, receive, start_receiver, start_sender, write_rqprc
from tests.testbed import wait_for

Q1 = 0x52510001
CALLS = "openat,pwrite64,fsync,fdatasync,msgrcv,sendto,sendmsg,write,writev"
SEND_SYNC = r"""
import sys, rqp
h = rqp.openConnection(int(sys.argv[2]), rqprc=sys.argv[1], start_sender=False)
for text in sys.argv[3:]:
    rqp.sendMessage(h, text.encode(), rqp.SURE_MSG, sync=True)
rqp.closeConnection(h)
"""
LINE = re.compile(r"^(\d+)\s+\S+\s+(.*)$")


def _events(trace: str) -> list[tuple[int, str]]:
    """(pid, call text) per line, in the order strace wrote them."""
    return [(int(m[1]), m[2]) for m in map(LINE.match, trace.splitlines()) if m]


def test_the_journal_is_fsynced_before_the_take_and_before_the_frame(testbed):
    strace = shutil.which("strace")
    if strace is None:  # scripts/test installs it; a bare pytest run must say so, not skip
        pytest.fail("strace is missing: run scripts/test (it installs it) or apt-get install "
                    "strace")
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b)
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    trace_path = a.workdir / "sender.strace"
    sender = a.popen([strace, "-f", "-tt", "-s", "4096", "-e", f"trace={CALLS}", "-o",
                      str(trace_path), sys.executable, "-m", "rqp_agents.sender", "--rqprc",
                      str(rqprc), "--log-level", "INFO"])
    wait_for(lambda: "serving transmission queue" in a.output(sender, "stderr"), timeout=30,
             message="the sending MCA did not start under strace")
    markers = [f"sync-order-{i}" for i in range(3)]
    a.python(SEND_SYNC, str(rqprc), str(Q1), *markers, timeout=60)
    assert receive(b, Q1, 3) == markers
    a.stop(sender)  # strace writes its last lines as the traced process ends
    events = _events(trace_path.read_text(errors="replace"))
    # The APPEND of the first message names the journal's descriptor (a new journal is made
    # as sender-....journal.tmp, fsynced and renamed: the descriptor stays)
    journal_fd = next(re.match(r"pwrite64\((\d+),", t)[1] for _, t in events
                      if t.startswith("pwrite64(") and markers[0] in t)
    assert any(re.match(rf'openat\(.*/sender-[0-9a-f]+\.journal(\.tmp)?", .*\) = {journal_fd}$',
                        t) for _, t in events), f"fd {journal_fd} is not the journal"
    for marker in markers:
        append = next(i for i, (_, t) in enumerate(events)
                      if t.startswith(f"pwrite64({journal_fd},") and marker in t)
        pid = events[append][0]
        start = next((i for i in range(append + 1, len(events))
                      if events[i][0] == pid and events[i][1].startswith(f"fsync({journal_fd}")),
                     None)
        assert start is not None, f"no fsync of the journal after the APPEND of {marker}"
        synced = start if events[start][1].endswith("= 0") else next(
            i for i in range(start + 1, len(events))
            if events[i][0] == pid and "fsync resumed" in events[i][1])
        assert events[synced][1].endswith("= 0"), events[synced]
        taken = next(i for i, (_, t) in enumerate(events)
                     if "msgrcv" in t and marker in t and "MSG_COPY" not in t)
        sent = next(i for i, (_, t) in enumerate(events)
                    if re.match(r"(<\.\.\. )?(sendto|sendmsg|write|writev)", t) and marker in t)
        assert append < synced < taken, (marker, events[append], events[synced], events[taken])
        assert synced < sent, (marker, events[synced], events[sent])


def _answer_writes(events: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(index, how many DELIVERED_YES frames) of each socket write made only of them."""
    out = []
    for i, (_, text) in enumerate(events):
        m = re.match(r'(?:sendto|sendmsg|write|writev)\([0-9]+, "((?:\\2\\0)+)"', text)
        if m:
            out.append((i, m[1].count("\\2\\0")))
    return out


def _completed(events: list[tuple[int, str]], start: int) -> int:
    """The index where the call begun at ``start`` returned (its own line, or its
    "resumed" line in the same thread)."""
    pid, text = events[start]
    if "<unfinished ...>" not in text:
        return start
    return next(i for i in range(start + 1, len(events))
                if events[i][0] == pid and "resumed>" in events[i][1])


def test_the_receiver_answers_only_after_the_dedup_window_is_fsynced(testbed):
    """The receiving MCA commits the de-duplication window in a writer thread (issue 14) and
    writes DELIVERED_YES for a SURE message only after the fsync that makes its key durable
    returned: strace of the real receiver shows, for each message, put -> write of the
    window -> fsync done -> the answer on the socket."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("strace is missing: run scripts/test (it installs it) or apt-get install "
                    "strace")
    a, b = testbed.add_host("a"), testbed.add_host("b")
    trace_path = b.workdir / "receiver.strace"
    rx = start_receiver(b, prefix=[strace, "-f", "-tt", "-s", "256", "-e",
                                        f"trace={CALLS},msgsnd", "-o", str(trace_path)])
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    sender = start_sender(a, rqprc)
    markers = [f"answer-order-{i}" for i in range(3)]
    a.python(SEND_SYNC, str(rqprc), str(Q1), *markers, timeout=60)
    assert receive(b, Q1, 3) == markers
    a.stop(sender)
    b.stop(rx)  # strace writes its last lines as the traced process ends
    events = _events(trace_path.read_text(errors="replace"))
    dedup_fd = next(re.search(r"= (\d+)$", t)[1] for _, t in events
                    if t.startswith("openat(") and "receiver.dedup" in t and "= -1" not in t)
    assert sum(n for _, n in _answer_writes(events)) == len(markers)  # one answer each
    for marker in markers:
        put = next(i for i, (_, t) in enumerate(events) if "msgsnd(" in t and marker in t)
        write = next(i for i in range(put + 1, len(events))
                     if events[i][1].startswith(f"pwrite64({dedup_fd},"))
        synced = _completed(events, next(i for i in range(write + 1, len(events))
                                         if events[i][1].startswith(f"fsync({dedup_fd}")))
        assert events[synced][1].endswith("= 0"), events[synced]
        # The answer: the write on the socket that carries this message's DELIVERED_YES
        # (frame "\2\0"). Answers go in order, several to a write when messages share a
        # commit, so the k-th answer written is the k-th message's. (Not "the first write
        # after the put": with the messages in flight together, that was the previous
        # message's answer, and last CI also took the writer thread's one-byte wake-up of the
        # event loop for one.)
        k = markers.index(marker)
        answer = next(i for i, n in _answer_writes(events) if (k := k - n) < 0)
        assert synced < answer, (marker, events[synced], events[answer])
