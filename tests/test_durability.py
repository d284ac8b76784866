"""SURE durability at the edges: sendMessage(sync=True), a lost kernel queue (what a reboot
does), the retry budget, unique keys across restarts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rqp import SURE_MSG, UNSURE_MSG
from tests.agents import (
    dead_letters, log_lines, make_queue, receive, send, start_receiver, start_sender,
    write_rqprc,
)
from tests.testbed import wait_for

Q1 = 0x52510001

SYNC_SEND = r"""
import json, sys, time, rqp, sysv_ipc
rqprc, count = sys.argv[1], int(sys.argv[2])
h = rqp.openConnection(0x52510001, rqprc=rqprc, start_sender=False)
for i in range(count):
    rqp.sendMessage(h, f"s{i}".encode(), rqp.SURE_MSG, sync=True, timeout=20)
depth = sysv_ipc.MessageQueue(0x52510000).current_messages
try:
    rqp.sendMessage(h, b"x", rqp.UNSURE_MSG, sync=True)
    refused = None
except rqp.RQPError as e:
    refused = str(e)
print(json.dumps([depth, refused]))
"""

SYNC_ONE = r"""
import sys, rqp
h = rqp.openConnection(0x52510001, rqprc=sys.argv[1], start_sender=False)
try:
    rqp.sendMessage(h, sys.argv[2].encode(), rqp.SURE_MSG, sync=True, timeout=float(sys.argv[3]))
    print("journaled")
except rqp.RQPError as e:
    print(e)
"""


def test_sync_send_returns_once_journaled_and_survives_losing_the_kernel_queues(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    receiver = start_receiver(b)  # b has no Q1 yet: the messages wait in a's sending MCA
    rqprc = write_rqprc(a, [b])
    sender = start_sender(a, rqprc)
    depth, refused = json.loads(a.python(SYNC_SEND, str(rqprc), "20", timeout=120))
    assert depth == 0  # every record left the kernel queue before sendMessage returned
    assert "sync=True is for SURE messages" in refused
    # what a reboot does: the process dies and the kernel's queues are gone
    a.kill(sender)
    a.python("import sysv_ipc\nfor k in (0x52510000, 0x5251DEAD):\n"
             "    sysv_ipc.MessageQueue(k).remove()")
    make_queue(b, Q1)
    again = start_sender(a, rqprc)
    assert receive(b, Q1, 20) == [f"s{i}" for i in range(20)]
    assert "20 SURE message(s) to send again first" in log_lines(a, again, "journal:")[0]
    assert receiver.poll() is None


def test_sync_send_times_out_when_no_sending_mca_takes_it(testbed):
    a = testbed.add_host("a")
    rqprc = write_rqprc(a, [a])
    out = a.python(r"""
import sys, rqp
h = rqp.openConnection(0x52510001, rqprc=sys.argv[1], start_sender=False)
try:
    rqp.sendMessage(h, b"x", rqp.SURE_MSG, sync=True, timeout=0.3)
except rqp.RQPError as e:
    print(e)
""", str(rqprc))
    assert "has not journaled the message within 0.3s" in out and "position 1" in out


def test_retry_budget_turns_a_sure_message_into_a_dead_letter(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b)  # never has the queue
    rqprc = write_rqprc(a, [b], retry_max_attempts=3)
    sender = start_sender(a, rqprc)
    a.python(r"""
import sys, rqp
h = rqp.openConnection(0x52510001, rqprc=sys.argv[1], start_sender=False)
rqp.sendMessage(h, b"give up on me", rqp.SURE_MSG)
""", str(rqprc))
    [dl] = wait_for(lambda: dead_letters(a), timeout=30, message="no dead letter")
    assert dl["reason"] == "RETRY_BUDGET_EXHAUSTED" and dl["payload"] == "give up on me"
    assert dl["type"] == SURE_MSG and dl["key"] and "no host offers queue" in dl["detail"]
    sender.send_signal(15)
    assert sender.wait(30) == 0
    # released from the journal once dead-lettered: a restart sends nothing again
    again = start_sender(a, rqprc)
    assert not log_lines(a, again, "journal:")


def test_retry_age_running_out_while_the_receiver_is_down_dead_letters_and_runs_on(testbed):
    """A review found the sending MCA stopped (exit 70, "cannot go from 'Ask for queue' on
    'SURE retry budget spent'") when retry_max_age ran out while its only receiver could not be
    reached: the message waited to ask again with the host in its connection's back-off."""
    a, b = testbed.add_host("a"), testbed.add_host("b")  # nothing listens on b
    # Tries at 0, 0.5, 1.5 s; from 2.5 s it waits to ask again until b's connection may be
    # made (3.5 s): the 3 s budget runs out in that wait.
    rqprc = write_rqprc(a, [b], retry_backoff_initial="0.5s", retry_backoff_max="5s",
                        retry_max_age="3s")
    sender = start_sender(a, rqprc)
    a.python(r"""
import sys, rqp
h = rqp.openConnection(0x52510001, rqprc=sys.argv[1], start_sender=False)
rqp.sendMessage(h, b"nobody home", rqp.SURE_MSG)
""", str(rqprc))
    [dl] = wait_for(lambda: dead_letters(a), timeout=30, message="no dead letter")
    assert (dl["reason"], dl["payload"]) == ("RETRY_BUDGET_EXHAUSTED", "nobody home")
    assert sender.poll() is None, a.output(sender, "stderr")[-3000:]
    sender.send_signal(15)
    assert sender.wait(30) == 0


def test_retry_max_age_goes_on_counting_across_a_restart(testbed):
    """A trial: retry_max_age 20s, a SIGTERM and a start of the sending MCA 12 s after the
    message was taken: it was dead-lettered 46 s after, its age counted again from the start.
    A journaled message's age now counts from when it was put (the record's enqueued_ns):
    here a record put 100 s ago, taken, journaled, then the MCA restarted, with a budget of
    60 s, is dead-lettered at its first failed try after the start, not 60 s later."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b)  # never has the queue: QUEUE_NO, tried again with back-off
    rqprc = write_rqprc(a, [b], retry_max_age="60s")
    sender = start_sender(a, rqprc)
    a.python(r"""
import sys, time, sysv_ipc
from rqp.protocol.records import TransmissionRecord
record = TransmissionRecord(message_type=0, queue_key=0x52510001, payload=b"put long ago",
                            enqueued_ns=time.time_ns() - 100 * 10**9)
sysv_ipc.MessageQueue(0x52510000).send(record.to_bytes(), type=1)
""")
    wait_for(lambda: log_lines(a, sender, "no host offers queue 0x52510001"), timeout=20,
             message="the message was not tried")
    assert dead_letters(a) == []  # (taken now: 60 s of budget from the take)
    sender.send_signal(15)
    assert sender.wait(30) == 0
    again = start_sender(a, rqprc)
    assert log_lines(a, again, "journal: 1 SURE message(s) to send again first")
    [dl] = wait_for(lambda: dead_letters(a), timeout=20,
                    message="not dead-lettered: its age counted again from the start")
    assert (dl["reason"], dl["payload"]) == ("RETRY_BUDGET_EXHAUSTED", "put long ago")


def test_keys_stay_unique_across_restarts(testbed):
    a, b = testbed.add_host("a"), testbed.add_host("b")
    fake = b.popen([sys.executable, str(Path(__file__).with_name("fake_receiver.py")),
                    f"{b.address}:7460",
                    str(b.workdir / "mode")])
    wait_for(lambda: "listening" in b.output(fake), timeout=20, message="fake receiver")
    rqprc = write_rqprc(a, [b])
    send = r"""
import sys, rqp
h = rqp.openConnection(0x52510001, rqprc=sys.argv[1], start_sender=False)
for i in range(5):
    rqp.sendMessage(h, b"k", rqp.UNSURE_MSG)
"""
    for _ in range(3):
        sender = start_sender(a, rqprc)
        before = b.output(fake).count("MESSAGE")
        a.python(send, str(rqprc))
        wait_for(lambda: b.output(fake).count("MESSAGE") == before + 5, timeout=20,
                 message="not sent")
        a.kill(sender)
    keys = [json.loads(line)["key"] for line in b.output(fake).splitlines()
            if '"MESSAGE"' in line]
    assert len(keys) == 15 and len(set(keys)) == 15
    assert len({k >> 32 for k in keys}) == 3  # one incarnation per start


def test_a_record_longer_than_a_lowered_msgmax_is_sent_and_the_queue_moves_on(testbed):
    # A record put while msgmax was 8192, then msgmax lowered to 2048 on the sending host: the
    # kernel copies at most msgmax bytes, so the sending MCA's copy (peek) of it failed, once
    # a second, for ever, and every record behind it waited. It is taken, journaled and sent
    # (the receiving host, msgmax 8192, takes it), and the records behind it follow, in order.
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b)
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    big, bigger = "L" * 6000, "M" * 7000  # (the second fits the buffer the first one grew:
    send(a, rqprc, Q1, ["before", big, bigger], SURE_MSG)  # the kernel says EINVAL, not E2BIG)
    send(a, rqprc, Q1, ["after1"], UNSURE_MSG)
    a.sysctl("kernel.msgmax", 2048)
    # sendMessage(sync=True) looks for its record behind the long one, which it cannot copy
    # either: it waits for it all the same (before, the long one raised MessageTooBig).
    assert "it is still in transmission queue 0x52510000 at position 5" in a.python(
        SYNC_ONE, str(rqprc), "after2", "0.3")
    sender = start_sender(a, rqprc)
    assert receive(b, Q1, 5) == ["before", big, bigger, "after1", "after2"]  # (sync: sent)
    assert a.python(SYNC_ONE, str(rqprc), "after3", "20") == "journaled\n"
    assert receive(b, Q1, 1) == ["after3"]
    warned = log_lines(a, sender, "longer than kernel.msgmax")
    assert len(warned) == 2 and "0x52510000" in warned[0] and "(2048 bytes" in warned[0]
    assert "taken off before it is journaled" in warned[0]
    assert not log_lines(a, sender, "cannot read the transmission queue")
    assert sender.poll() is None and dead_letters(a) == []


def test_a_restart_with_journaled_records_keeps_a_long_record_found_at_the_head(testbed):
    # At start the sending MCA copies the head of the queue to find records both journaled
    # and still there (a kill between the two): a record too long to copy (msgmax lowered)
    # ends that look -- it was never journaled -- and is sent after the journaled ones.
    a, b = testbed.add_host("a"), testbed.add_host("b")  # nothing listens on b yet
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    sender = start_sender(a, rqprc)
    assert a.python(SYNC_ONE, str(rqprc), "journaled first", "20") == "journaled\n"
    sender.send_signal(15)
    assert sender.wait(30) == 0
    big = "L" * 6000
    send(a, rqprc, Q1, [big, "after"], SURE_MSG)
    a.sysctl("kernel.msgmax", 2048)
    start_receiver(b)
    again = start_sender(a, rqprc)
    assert receive(b, Q1, 3) == ["journaled first", big, "after"]
    assert "1 SURE message(s) to send again first" in log_lines(a, again, "journal:")[0]


KILLED_BEFORE_THE_TAKE = r"""
import os, sys
from rqp_agents import intake, sender
intake.Intake._take_off = lambda self, batch: os._exit(9)  # journaled, not taken: a kill -9
sys.exit(sender.main(sys.argv[1:]))
"""


def test_a_kill_before_the_take_then_msgmax_lowered_sends_each_record_once(testbed):
    # A trial's reading: killed between journaling a batch and taking it off the queue, then
    # started again with msgmax lowered, the start-up look copied the head only up to a record
    # now too long to copy: the rest of the batch stayed on the queue, was sent from the
    # journal and then again, as new records, with new keys.
    a, b = testbed.add_host("a"), testbed.add_host("b")
    start_receiver(b)
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    big = "L" * 6000
    send(a, rqprc, Q1, ["a", big], SURE_MSG)
    send(a, rqprc, Q1, ["u"], UNSURE_MSG)
    send(a, rqprc, Q1, ["b"], SURE_MSG)
    killed = a.popen([sys.executable, "-c", KILLED_BEFORE_THE_TAKE, "--rqprc", str(rqprc)])
    assert killed.wait(30) == 9, a.output(killed, "stderr")
    a.sysctl("kernel.msgmax", 2048)
    again = start_sender(a, rqprc)
    send(a, rqprc, Q1, ["end"], UNSURE_MSG)  # behind everything: nothing comes after it
    assert receive(b, Q1, 5) == ["a", big, "b", "u", "end"]
    assert "3 SURE message(s) to send again first (1 of them also still on the transmission " \
        "queue, taken off)" in log_lines(a, again, "journal:")[0]
    assert len(log_lines(a, again, "past one too long to copy: taken off, sent from the "
                                   "journal")) == 2


KILLED_AT_THE_FIRST_JOURNAL_WRITE = r"""
import os, sys
from rqp_agents import intake, sender
intake.Intake._journal = lambda self, batch: os._exit(9)  # before any record is journaled
sys.exit(sender.main(sys.argv[1:]))
"""


def test_a_kill_right_after_a_start_with_msgmax_lowered_loses_nothing(testbed):
    # A third trial: a first version of the change above made the start-up look take up to
    # 256 records off the queue before it journaled them, whenever the journal held SURE
    # messages already taken (waiting for a route) and a record too long to copy was at the
    # head: a kill then lost them (131 of 362). Here the kill comes at the first journal
    # write after the start: whatever was taken off before it is lost. That is the long
    # record alone, the one the README says a kill at that moment loses (it cannot be copied,
    # so it is taken first); the others wait on the queue, journaled before they are taken.
    a, b = testbed.add_host("a"), testbed.add_host("b")  # nothing listens on b yet
    make_queue(b, Q1)
    rqprc = write_rqprc(a, [b])
    first = start_sender(a, rqprc)
    for n in range(3):
        assert a.python(SYNC_ONE, str(rqprc), f"waiting {n}", "20") == "journaled\n"
    a.kill(first)
    big = "L" * 6000
    send(a, rqprc, Q1, [big] + [f"short {n}" for n in range(5)], SURE_MSG)
    a.sysctl("kernel.msgmax", 2048)
    killed = a.popen([sys.executable, "-c", KILLED_AT_THE_FIRST_JOURNAL_WRITE, "--rqprc",
                      str(rqprc)])
    assert killed.wait(30) == 9, a.output(killed, "stderr")
    assert "taken off before it is journaled (a crash now would lose it)" in \
        a.output(killed, "stderr")
    start_receiver(b)
    start_sender(a, rqprc)
    send(a, rqprc, Q1, ["end"], UNSURE_MSG)
    assert receive(b, Q1, 9) == [f"waiting {n}" for n in range(3)] + [
        f"short {n}" for n in range(5)] + ["end"]


BIG_SEQUENCE = r"""
import sys, rqp
h = rqp.openConnection(0x52510001, rqprc=sys.argv[1], start_sender=False)
for i in range(int(sys.argv[2])):
    rqp.sendMessage(h, b"%05d" % i + bytes(8095), rqp.SURE_MSG, timeout=60)
"""

TAKE_BIG = r"""
import json, signal, sys, sysv_ipc
signal.alarm(150)  # (a receive that never ends fails the test, not the suite)
q = sysv_ipc.MessageQueue(0x52510001, max_message_size=1 << 16)
print(json.dumps([q.receive()[0][:5].decode() for _ in range(int(sys.argv[1]))]))
"""


def test_a_sending_mca_on_a_small_disk_waits_for_room_and_goes_on(testbed):
    """Trial 9: a sending MCA on a 2 MiB state_dir stopped after 253 SURE messages of 8 KB,
    at every start: its journal filled the disk with messages in flight and delivered ones
    (compaction starts at 32 MiB). Now the reader leaves the records on the transmission
    queue while the journal has no room and tries again every second; the journal, emptied as
    the messages in flight are confirmed, is cut back. A real 2 MiB tmpfs, mounted in the
    sending MCA's own mount namespace."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    for host in (a, b):
        host.sysctl("kernel.msgmnb", 4 << 20)
    start_receiver(b)
    make_queue(b, Q1)
    state = a.workdir / "small-state"
    state.mkdir()
    rqprc = write_rqprc(a, [b], state_dir=str(state),
                        control_socket=str(a.workdir / "sender.sock"))
    producer = a.popen([sys.executable, "-c", BIG_SEQUENCE, str(rqprc), "600"])
    # (first a backlog: trial 10's batch of 256 records of 8 KB, 2 MB, never fit 2 MiB)
    wait_for(lambda: int(a.python("import sysv_ipc; print(sysv_ipc.MessageQueue(0x52510000)"
                                  ".current_messages)")) >= 300, timeout=60,
             message="no backlog on the transmission queue")
    sender = a.popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                      'mount -t tmpfs -o size=2m rqp-test "$1" && exec "$2" -m '
                      'rqp_agents.sender --rqprc "$3" --log-level DEBUG', "sh", str(state),
                      sys.executable, str(rqprc)])
    got = json.loads(b.python(TAKE_BIG, "600", timeout=160))
    assert got == [f"{i:05d}" for i in range(600)]  # every one, once, in order
    assert producer.wait(30) == 0 and sender.poll() is None, a.output(sender, "stderr")[-3000:]
    # (the journal was compacted or cut back, before the disk was full or when a write found
    # it so; the reader took fewer records at a time, and, when even one did not fit,
    # waited, and said so)
    assert log_lines(a, sender, "compact")
    assert bool(log_lines(a, sender, "the journal cannot take SURE records")) == \
        bool(log_lines(a, sender, "the journal takes SURE records again"))


FREE_BYTES = "import os, sys; st = os.statvfs(sys.argv[1]); print(st.f_bavail * st.f_frsize)"


def test_a_sending_mca_killed_on_a_full_disk_starts_again(testbed):
    """Trial 10: a sending MCA killed while its state_dir was full (its journal, with
    messages waiting for a route, took the disk) could not start again until room was made:
    'cannot start: [Errno 28] No space left on device: .../sender-*.incarnation'. It keeps a
    reserve file for its start now, freed by the start; while it cannot be made again, its
    journal takes no SURE record. A real 2 MiB tmpfs in a mount namespace of its own, held by
    a process of the test, so that each start finds the same full disk."""
    a, b = testbed.add_host("a"), testbed.add_host("b")
    for host in (a, b):
        host.sysctl("kernel.msgmnb", 4 << 20)
    state = a.workdir / "small-state"
    state.mkdir()
    control = a.workdir / "sender.sock"
    rqprc = write_rqprc(a, [b], state_dir=str(state), control_socket=str(control))
    disk = a.popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                    'mount -t tmpfs -o size=2m rqp-test "$1" && echo mounted && exec cat',
                    "sh", str(state)], stdin=subprocess.PIPE)
    wait_for(lambda: a.output(disk) == "mounted\n", timeout=20, message="no tmpfs")
    # (its root and working directory too: entering a mount namespace alone starts at the
    # namespace's root, not at a chroot's, and a fresh machine's checkout is in one)
    on_disk = ["nsenter", "--target", str(disk.pid), "--mount", "--root", "--wd", "--"]
    sender_argv = [*on_disk, sys.executable, "-m", "rqp_agents.sender", "--rqprc", str(rqprc),
                   "--log-level", "DEBUG"]

    def fill(name: str, leave: int = 0) -> None:  # another file takes the disk's last pages
        free = int(a.run([*on_disk, sys.executable, "-c", FREE_BYTES, str(state)]).stdout)
        a.run([*on_disk, "dd", "if=/dev/zero", f"of={state / name}", "bs=4k",
               f"count={(free - leave) // 4096}"], check=False)

    def start_on_full_disk():
        sender = a.popen(sender_argv)
        wait_for(lambda: log_lines(a, sender, "serving transmission queue") or
                 sender.poll() is not None, timeout=30, message="the start said nothing")
        assert sender.poll() is None, a.output(sender, "stderr")[-3000:]
        return sender

    producer = a.popen([sys.executable, "-c", BIG_SEQUENCE, str(rqprc), "400"])
    first = a.popen(sender_argv)  # b has no receiver yet: every message waits, journaled
    wait_for(lambda: log_lines(a, first, "the journal cannot take SURE records"), timeout=60,
             message="the journal never filled the disk")
    # (trial 11: it stopped with half the disk free, the next 192 records not fitting in one
    # go beside those in the journal; now it takes fewer at a time, to the last records' room)
    assert int(a.run([*on_disk, sys.executable, "-c", FREE_BYTES, str(state)]).stdout) < 40960
    fill("other")
    assert a.kill(first) == -9
    second = start_on_full_disk()  # the reserve's room was enough for the start: made again
    assert not log_lines(a, second, "cannot be made")
    # Removed by hand while the journal waits for room: the reserve gets the room back, not
    # the journal (trial 13: the journal took it within 2 ms, and the next start failed).
    wait_for(lambda: log_lines(a, second, "the journal cannot take SURE records"), timeout=30,
             message="the second start's journal did not find the disk full")
    a.run([*on_disk, "rm", str(state / "sender-52510000.reserve")])
    wait_for(lambda: log_lines(a, second, "was gone (removed by hand?): made again"),
             timeout=30, message="the reserve removed by hand was not made again")
    assert not log_lines(a, second, "cannot be made")
    # Killed again; the reserve gone meanwhile and its room half taken: the start fits
    # (nothing else does), the reserve cannot be made, no SURE record is taken ...
    assert a.kill(second) == -9
    a.run([*on_disk, "rm", str(state / "sender-52510000.reserve")])
    fill("more", leave=32 << 10)
    third = start_on_full_disk()
    assert log_lines(a, third, "KiB) cannot be made: No space left on device")
    ctl = [sys.executable, "-m", "rqp.tools.ctl", "status", "--socket", str(control)]
    said = "THE JOURNAL CANNOT TAKE SURE RECORDS: No space left on device (the start reserve"
    wait_for(lambda: said in a.run(ctl, check=False, timeout=60).stdout, timeout=30,
             message="rqpctl status did not say that the journal takes no records")
    status = a.run(ctl, check=False, timeout=60)
    assert status.returncode == 4 and "START RESERVE MISSING: " in status.stdout, status.stdout
    metrics = a.run([*ctl[:-3], "metrics", "--socket", str(control)], timeout=60).stdout
    assert "rqp_sender_start_reserve_missing 1" in metrics
    assert "rqp_sender_journal_full 1" in metrics
    # ... until the journal, its messages delivered, is cut back: then all go, once, in order
    start_receiver(b)
    make_queue(b, Q1)
    got = json.loads(b.python(TAKE_BIG, "400", timeout=160))
    assert got == [f"{i:05d}" for i in range(400)]
    assert producer.wait(30) == 0 and third.poll() is None, a.output(third, "stderr")[-3000:]
    assert log_lines(a, third, "is made again: SURE records are journaled again")
    # one removed by hand is noticed and made again (trial 11: the status said it was there)
    a.run([*on_disk, "rm", str(state / "sender-52510000.reserve")])
    wait_for(lambda: log_lines(a, third, "was gone (removed by hand?): made again"),
             timeout=30, message="a reserve removed by hand was not made again")
    disk.stdin.close()
