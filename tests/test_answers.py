"""The receiving MCA's answers to one connection (rqp_agents.receiver._Answers): in the order
of the frames they answer, each SURE batch only after the commit that makes its keys durable,
and nothing at all written once a commit failed (the connection closes with the rest
unanswered, the sender keeps those messages).

The first tests drive ``_Answers`` with commits whose outcome the test decides (hand-made
futures) and a writer that records what it is asked to do; the last drives the real receiver's
connection loop over real TCP in a testbed host, with the de-duplication window's first write
failing as on a full disk."""

from __future__ import annotations

import asyncio
import json

import pytest

from rqp.storage.dedup import DedupError
from rqp_agents.receiver import ANSWER_BATCH, UNCOMMITTED_MAX, PeerNotReading, _Answers
from tests.rqp_peer import DELIVERED_YES, QUEUE_YES, SURE, pack_ask, pack_message

YES = DELIVERED_YES


class Writer:
    """What a StreamWriter was asked: ("write", bytes) and ("close",), in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def close(self) -> None:
        self.closed = True
        self.calls.append(("close",))

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("closed")

    def written(self) -> bytes:
        return b"".join(call[1] for call in self.calls if call[0] == "write")


class Commits:
    """GroupCommit's ``durable()``, answered from a script: each call takes the next entry
    (a future the test settles, or None: everything is durable already)."""

    def __init__(self, *script) -> None:
        self.script = list(script)

    def durable(self):
        return self.script.pop(0)


async def _turn() -> None:
    """Let the done-callbacks of settled futures run."""
    for _ in range(3):
        await asyncio.sleep(0)


def _run(body) -> None:
    asyncio.run(body())


def test_unsure_answers_with_nothing_waiting_are_written_at_once() -> None:
    async def body() -> None:
        writer = Writer()
        answers = _Answers(writer, Commits())
        answers.send([YES, YES], sure=False)
        assert writer.written() == YES * 2
        await answers.flush()

    _run(body)


def test_a_sure_batch_waits_for_its_commit_and_an_unsure_one_does_not_jump_ahead() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        commit = loop.create_future()
        writer = Writer()
        answers = _Answers(writer, Commits(commit))
        answers.send([b"S1", b"S2"], sure=True)
        answers.send([b"U1"], sure=False)  # (needs no commit, but comes after the SURE ones)
        await _turn()
        assert writer.calls == []
        commit.set_result(None)
        await answers.flush()
        assert writer.written() == b"S1S2U1"

    _run(body)


def test_sure_batches_are_written_in_order_whatever_order_their_commits_end_in() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        writer = Writer()
        answers = _Answers(writer, Commits(first, second, None))
        answers.send([b"A"], sure=True)
        answers.send([b"B"], sure=True)
        answers.send([b"C"], sure=True)  # (durable already, but after A and B)
        second.set_result(None)
        await _turn()
        assert writer.calls == []  # B's commit is done, A's is not: nothing yet
        first.set_result(None)
        await answers.flush()
        assert writer.written() == b"ABC"

    _run(body)


@pytest.mark.parametrize("size", [ANSWER_BATCH, 16, 1])
def test_reading_stops_at_uncommitted_max_answers_however_the_batches_are_cut(size) -> None:
    """What a receiving MCA killed before its commit puts twice is bounded in frames, however
    the reads cut the batches (a read of 64 KiB holds 16 frames of 4 KiB)."""
    async def body() -> None:
        loop = asyncio.get_running_loop()
        commits = [loop.create_future() for _ in range(UNCOMMITTED_MAX // size + 1)]
        writer = Writer()
        answers = _Answers(writer, Commits(*commits))
        sent = 0
        while True:  # the connection loop: room for a full batch, then a batch
            room = asyncio.ensure_future(answers.room())
            await _turn()
            if not room.done():
                break
            answers.send([YES] * size, sure=True)
            sent += size
        # it stops once another full batch might not fit: never beyond the bound
        assert UNCOMMITTED_MAX - ANSWER_BATCH < sent <= UNCOMMITTED_MAX
        commits[0].set_result(None)  # the oldest batch's commit ends: it is written ...
        await _turn()
        assert room.done()  # ... and a full batch fits again
        for commit in commits:
            if not commit.done():
                commit.set_result(None)
        await room
        await answers.flush()
        assert writer.written() == YES * sent

    _run(body)


def test_an_atomic_batchs_answers_count_one_per_message() -> None:
    """A batch of 256 messages is one request with 256 answers: they all count against
    UNCOMMITTED_MAX (it may go beyond it, being put whole), and reading waits for its commit."""
    async def body() -> None:
        commit = asyncio.get_running_loop().create_future()
        writer = Writer()
        answers = _Answers(writer, Commits(commit))
        answers.send([YES * 256], sure=True)
        room = asyncio.ensure_future(answers.room())
        await _turn()
        assert not room.done()
        commit.set_result(None)
        await room
        await answers.flush()
        assert writer.written() == YES * 256

    _run(body)


class FullWriter(Writer):
    """A peer that reads nothing: the socket's buffer never drains."""

    async def drain(self) -> None:
        await asyncio.get_running_loop().create_future()


def test_a_peer_that_leaves_its_answers_unread_is_given_up_after_its_patience() -> None:
    async def body() -> None:
        writer = FullWriter()
        answers = _Answers(writer, Commits(None), patience=0.05)
        answers.send([YES], sure=True)
        with pytest.raises(PeerNotReading, match=r"left its answers unread for 0.05s"):
            await answers.room()
        await asyncio.wait_for(answers.flush(), 1)  # (at once: nothing more is waited for)

    _run(body)


def test_a_failed_commit_closes_the_connection_and_nothing_is_written_after_it() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        done, failing, later = (loop.create_future() for _ in range(3))
        writer = Writer()
        answers = _Answers(writer, Commits(done, failing, later, later))
        answers.send([b"A"], sure=True)
        answers.send([b"B"], sure=True)
        answers.send([b"U"], sure=False)
        answers.send([b"C"], sure=True)
        done.set_result(None)
        failing.set_exception(DedupError("receiver.dedup: cannot write 40 bytes: no space"))
        await _turn()
        assert writer.calls == [("write", b"A"), ("close",)]  # B, U and C: never
        with pytest.raises(DedupError, match="no space"):
            await answers.room()  # the failure is raised once ...
        # ... and what comes after is dropped, even with a commit that succeeds: written to
        # the closed connection, it would still reach the peer, as answers to other frames
        answers.send([b"D"], sure=True)
        answers.send([b"E"], sure=False)
        later.set_result(None)
        await _turn()
        assert writer.calls == [("write", b"A"), ("close",)]

    _run(body)


def test_a_send_that_raises_the_failure_is_not_sent_again() -> None:
    """The receiver's loop sends a full batch, and the rest at the end of a read: a send that
    raised the failure must not leave its batch to be sent by the second."""
    async def body() -> None:
        loop = asyncio.get_running_loop()
        failing, retry = loop.create_future(), loop.create_future()
        writer = Writer()
        answers = _Answers(writer, Commits(failing, retry))
        answers.send([b"A"], sure=True)
        failing.set_exception(DedupError("no space"))
        await _turn()
        with pytest.raises(DedupError):
            answers.send([b"B"], sure=True)
        answers.send([b"B"], sure=True)  # (what the old loop did: the same batch again)
        retry.set_result(None)  # (the next commit, which writes the keys the first did not)
        await _turn()
        assert writer.written() == b"" and writer.closed

    _run(body)


#: Runs in a testbed host: a real Receiver, a real System V queue, real TCP on loopback with
#: small socket buffers; the window's first append fails with ENOSPC. The peer sends FILLER
#: asks and reads none of their answers (its transport paused: they back up in the receiver's
#: transport once the two small socket buffers are full), so that the receiver still has some
#: of them to write when it closes the connection (as when a peer is slow to read); once they
#: are handled, ANSWER_BATCH SURE messages, an ask of MARKER whose handling waits until their
#: commit has failed and 2 * ANSWER_BATCH asks more, in one write. Once the receiver is done with the
#: connection, it reads everything there is.
CONVERSE = r"""
import asyncio, errno, json, socket, sys, sysv_ipc
from pathlib import Path
from rqp.config import load_receiver_config
from rqp.protocol.access import Peer
from rqp.protocol.receiver import Ask
from rqp_agents.receiver import Receiver

workdir, queue_key, marker, filler = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4])
head, tail = Path(sys.argv[5]).read_bytes(), Path(sys.argv[6]).read_bytes()
(workdir / "receiver.yaml").write_text(
    f"state_dir: {json.dumps(str(workdir / 'state'))}\noffer:\n  allow: ['*']\n")
receiver = Receiver(load_receiver_config(workdir / "receiver.yaml"))
queue = sysv_ipc.MessageQueue(queue_key, sysv_ipc.IPC_CREX, mode=0o600)
log_file = receiver.dedup._file
real_append, appends = log_file.append, []

def append(data):
    appends.append(len(data))
    if len(appends) == 1:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_append(data)

log_file.append = append
real_start, started = receiver.commits._start, []

def start(entries):
    started.append(real_start(entries))
    return started[-1]

receiver.commits._start = start
real_handle, asked, seen = receiver._handle, [0], {}

async def main():
    filled, done = asyncio.Event(), asyncio.Event()

    async def handle(conn, request, who, info):
        if isinstance(request, Ask) and request.queue_key == queue_key:
            asked[0] += 1
            if asked[0] == filler:
                filled.set()
        elif isinstance(request, Ask) and request.queue_key == marker:
            await asyncio.wait([started[0]])  # (its done-callbacks, _Answers', ran before)
            seen["unwritten"] = transport.get_write_buffer_size()
        return await real_handle(conn, request, who, info)

    receiver._handle = handle

    async def serve(reader, writer):
        global transport
        transport = writer.transport
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        try:
            await receiver._converse(reader, writer, Peer("127.0.0.1"), "127.0.0.1")
        finally:
            done.set()
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(server.sockets[0].getsockname())
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.transport.pause_reading()  # (reads nothing: the receiver's answers back up)
    writer.write(head)
    await asyncio.wait_for(filled.wait(), 30)
    writer.write(tail)
    await asyncio.wait_for(done.wait(), 30)
    writer.transport.resume_reading()
    got = await asyncio.wait_for(reader.read(), 30)  # until the receiver closes
    writer.close()
    server.close()
    await server.wait_closed()
    await receiver.commits.drain()
    return got

try:
    got = asyncio.run(main())
    print(json.dumps({"answers": got.hex(), "put": queue.current_messages, "appends": appends,
                      "failed_first": started[0].exception() is not None, **seen}))
finally:
    queue.remove()
    receiver.dedup.close(commit=False)
"""


def test_the_receiver_writes_no_answer_after_a_failed_commit(testbed):
    """A regression: a full batch whose send raised the failure was sent again at the end of
    the read, after a commit that then succeeded, to the connection being closed: while the
    answers before it were still going out, the peer got QUEUE_NO and 63 QUEUE_YES more, as
    answers to its SURE messages, whose keys the receiver never recorded."""
    host = testbed.add_host("a")
    # 19,200 asks: 38,400 octets of answers, more than the two small socket buffers hold and
    # less than the transport's 64 KiB high-water mark, over which the receiver would wait
    # for the peer to read (it reads none) instead of reading on
    queue_key, marker, filler = 0x52510A01, 0x52510A02, 19_200
    head = pack_ask(queue_key) * filler
    tail = b"".join(pack_message(SURE, key, queue_key, b"m%d" % key)
                    for key in range(1, ANSWER_BATCH + 1))
    tail += pack_ask(marker) + pack_ask(queue_key) * (2 * ANSWER_BATCH)
    (host.workdir / "head").write_bytes(head)
    (host.workdir / "tail").write_bytes(tail)
    out = json.loads(host.python(CONVERSE, str(host.workdir), str(queue_key), str(marker),
                                 str(filler), str(host.workdir / "head"),
                                 str(host.workdir / "tail"), timeout=120))
    assert out["failed_first"]  # (the injected ENOSPC happened where meant)
    assert out["unwritten"] > 0  # (answers were still to be written when it failed)
    assert out["put"] == ANSWER_BATCH  # every message was put: the sender sends them again
    answers = bytes.fromhex(out["answers"])
    assert len(answers) == 2 * filler, (
        f"{len(answers) / 2 - filler:g} answers more than the {filler} asks': written after "
        "the failed commit")
    assert answers == QUEUE_YES * filler
