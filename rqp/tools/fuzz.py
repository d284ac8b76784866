"""Fuzz RQP's decoders with generated and mutated streams (``scripts/fuzz``).

Each case builds a stream of 1 to 8 frames (valid ``MESSAGE``, ``QUEUE_ASK`` and answer frames
with edge values: empty and oversized bodies, keys 0 and 2**64-1, bad message types), mutates it
(flipped bits, a new message code, a length field set to a huge or a near value, bytes cut,
inserted, repeated, or a second stream spliced in) and feeds it, in chunks of random size down to
one byte, to both sides:

* a receiving MCA's :class:`~rqp.protocol.receiver.ReceiverConnection` (small
  ``max_message_size``, so oversized bodies are streamed past; section 6's extension offered,
  so an ask with its bit turns ``MESSAGE_EX`` and batches on), every request answered;
* a sending MCA's :class:`~rqp.protocol.frames.FrameDecoder` for answers;
* a request decoder that accepts section 6's ``MESSAGE_EX`` (streams carry such frames too,
  with edge values of ``mtype``, ``priority``, ``flags`` and ``expires_at_ms``).

The only exception either may raise is :class:`~rqp.protocol.errors.RemoteProtocolError`
(the documented end of a connection). Anything else fails the run with the seed and the case
number, which reproduce it (``--seed S --start N --count 1``). Memory must stay flat: the
resident set size is measured after a warm-up and at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Iterator

from rqp.protocol.errors import RemoteProtocolError
from rqp.protocol.events import (
    ANSWERS, REQUESTS_EX, DeliveredError, DeliveredYes, Message, MessageEx, QueueAsk, QueueNo,
    QueueYes,
)
from rqp.protocol.frames import (
    CLOSED, MESSAGE_EX, NEED_DATA, FrameDecoder, encode, encode_message,
)
from rqp.protocol.constants import EXT_MESSAGE
from rqp.protocol.receiver import Ask, Batch, ReceiverConnection, Refuse

__all__ = ["case_stream", "run_case", "fuzz", "main"]

MAX_MESSAGE_SIZE = 256  # the receiving side's limit in the fuzz: bigger bodies are skipped
EDGE_U64 = (0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1)
#: The resident set may grow this much after the warm-up before the run fails.
RSS_SLACK = 16 << 20


def _u64(rng: random.Random) -> int:
    return rng.choice(EDGE_U64) if rng.random() < 0.3 else rng.getrandbits(64)


def _queue_key(rng: random.Random, known: tuple[int, ...]) -> int:
    """A queue key: one of ``known`` (a queue the receiver offers, so that the put path is
    fed too: a trial's mtype 2^31 stopped a receiving MCA there, which random keys never
    reached) a third of the time, else any. The same draws as without ``known``."""
    key = _u64(rng)
    return known[key % len(known)] if known and key % 3 == 0 else key


def _extended(rng: random.Random, known: tuple[int, ...] = ()) -> bytes:
    """A MESSAGE_EX, its extra fields at or past their edges now and then."""
    size = rng.choice((0, 1, MAX_MESSAGE_SIZE, MAX_MESSAGE_SIZE + 1, rng.randrange(600)))
    fields = {"message_type": rng.choice((0, 1)), "key": _u64(rng),
              "queue_key": _queue_key(rng, known),
              "mtype": rng.choice((1, 2, 2**63 - 1, rng.randrange(1, 1 << 20), 2**31)),
              "priority": rng.randrange(10), "flags": rng.choice((0, 1)),
              "expires_at_ms": _u64(rng), "message": rng.randbytes(size)}
    if rng.random() < 0.2:  # out of range: a protocol error
        field = rng.choice(("mtype", "priority", "flags"))
        fields[field] = {"mtype": rng.choice((0, -1, -(2**63))), "priority": rng.randrange(10, 256),
                         "flags": rng.randrange(2, 256)}[field]
        return MESSAGE_EX.build(fields)
    return encode(MessageEx(**fields))


def _frame(rng: random.Random, known: tuple[int, ...] = ()) -> bytes:
    kind = rng.randrange(10)
    if kind >= 8:
        return _extended(rng, known)
    if kind < 4:
        size = rng.choice((0, 1, MAX_MESSAGE_SIZE, MAX_MESSAGE_SIZE + 1, rng.randrange(600)))
        mtype = rng.choice((0, 1, 0, 1, 2, 255))
        body = rng.randbytes(size)
        if mtype in (0, 1):
            return encode(Message(message_type=mtype, key=_u64(rng),
                                  queue_key=_queue_key(rng, known), message=body))
        raw = bytearray(encode_message(0, _u64(rng), _u64(rng), body))
        raw[1] = mtype  # a message type the protocol does not have
        return bytes(raw)
    if kind < 6:
        return encode(QueueAsk(queue_key=_queue_key(rng, known),
                               data=rng.choice((0, 0, 1, 255))))
    return encode(rng.choice((DeliveredYes(), DeliveredError(), QueueYes(), QueueNo())))


def _mutate(rng: random.Random, data: bytearray, other: bytes) -> bytearray:
    for _ in range(rng.randrange(1, 4)):
        if not data:
            data.extend(other)
            continue
        at = rng.randrange(len(data))
        op = rng.randrange(8)
        if op == 0:  # flip bits
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1:  # another message code
            data[at] = rng.randrange(256)
        elif op == 2:  # a length (or key) field set to a huge or near value
            value = rng.choice((2**64 - 1, 2**63, 2**31, 2**31 - 1, MAX_MESSAGE_SIZE + 1,
                                rng.getrandbits(64)))
            data[at:at + 8] = value.to_bytes(8, "big")
        elif op == 3:  # cut
            del data[at:at + rng.randrange(1, 16)]
        elif op == 4:  # insert
            data[at:at] = rng.randbytes(rng.randrange(1, 16))
        elif op == 5:  # repeat a piece
            data[at:at] = data[at:at + rng.randrange(1, 32)]
        elif op == 6:  # splice another stream in
            data[at:] = other[rng.randrange(len(other) + 1):]
        else:  # end it early
            del data[at:]
    return data


def case_stream(seed: int, case: int,
                queue_keys: tuple[int, ...] = ()) -> tuple[bytes, list[int]]:
    """The stream of case ``case`` and the chunk sizes it is fed in; ``queue_keys``: queues
    the receiver offers, which a third of its frames name (see _queue_key)."""
    rng = random.Random(f"{seed}/{case}")
    frames = b"".join(_frame(rng, queue_keys) for _ in range(rng.randrange(1, 9)))
    if queue_keys:  # (first, the ask an honest sender begins with: MESSAGE_EX is agreed)
        frames = encode(QueueAsk(queue_key=queue_keys[0], data=EXT_MESSAGE)) + frames
    other = b"".join(_frame(rng, queue_keys) for _ in range(rng.randrange(1, 4)))
    data = bytes(_mutate(rng, bytearray(frames), other)) if rng.random() < 0.9 else frames
    chunks, left = [], len(data)
    while left > 0:
        n = 1 if rng.random() < 0.2 else rng.randrange(1, 65)
        chunks.append(min(n, left))
        left -= n
    return data, chunks


def _pieces(data: bytes, chunks: list[int]) -> Iterator[bytes]:
    at = 0
    for n in chunks:
        yield data[at:at + n]
        at += n
    yield b""  # the end of the stream


def _count_events(decoder: FrameDecoder, data: bytes, chunks: list[int]) -> int:
    events = 0
    try:
        for piece in _pieces(data, chunks):
            decoder.receive_data(piece)
            while (event := decoder.next_event()) not in (NEED_DATA, CLOSED):
                events += 1
            if event is CLOSED:
                break
    except RemoteProtocolError:
        pass
    return events


def run_case(data: bytes, chunks: list[int]) -> tuple[int, int, int]:
    """Feed one stream to every side: (requests answered, answers decoded, requests decoded
    with MESSAGE_EX accepted). Raises anything but a RemoteProtocolError."""
    requests = 0
    conn = ReceiverConnection(max_message_size=MAX_MESSAGE_SIZE, extensions=EXT_MESSAGE)
    try:
        for piece in _pieces(data, chunks):
            conn.receive_data(piece)
            while (request := conn.next_request()) not in (NEED_DATA, CLOSED):
                requests += 1
                if isinstance(request, Ask):
                    conn.answer_ask(request, requests % 2 == 0)
                elif isinstance(request, Batch):
                    conn.answer_batch(request, request.refused is None and requests % 3 != 0)
                else:  # a refused message is never delivered; a put one may fail
                    conn.answer_put(request, not isinstance(request, Refuse)
                                    and requests % 3 != 0)
            if request is CLOSED:
                break
    except RemoteProtocolError:
        pass
    answers = _count_events(FrameDecoder(accept=ANSWERS), data, chunks)
    extended = _count_events(FrameDecoder(accept=REQUESTS_EX, max_message_size=MAX_MESSAGE_SIZE),
                             data, chunks)
    return requests, answers, extended


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fuzz(seed: int, count: int, start: int = 0, *, out=sys.stdout) -> dict:
    """Run cases ``start .. start+count-1``; a dict of figures. Raises AssertionError naming
    the case on any exception but RemoteProtocolError, or if memory grew."""
    warm = min(count, 2000)
    t0 = time.monotonic()
    rss_before = None
    requests = answers = extended = octets = 0
    for case in range(start, start + count):
        if case - start == warm:
            rss_before = _rss()
        data, chunks = case_stream(seed, case)
        octets += len(data)
        try:
            r, a, e = run_case(data, chunks)
        except Exception as exc:
            raise AssertionError(
                f"case {case} of seed {seed} raised {type(exc).__name__}: {exc} (stream "
                f"{data[:200].hex()}{'...' if len(data) > 200 else ''}; reproduce with "
                f"--seed {seed} --start {case} --count 1)") from exc
        requests += r
        answers += a
        extended += e
        if out is not None and (case - start + 1) % 100_000 == 0:
            print(f"  {case - start + 1:,} cases, {time.monotonic() - t0:.0f} s", file=out,
                  flush=True)
    rss_after = _rss()
    figures = {"seed": seed, "cases": count, "octets": octets, "requests": requests,
               "answers": answers, "extended": extended, "seconds": round(time.monotonic() - t0, 1),
               "rss_before": rss_before or rss_after, "rss_after": rss_after}
    growth = rss_after - figures["rss_before"]
    if growth > RSS_SLACK:
        raise AssertionError(f"resident memory grew by {growth} bytes over {count} cases")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/fuzz", description="Feed RQP's decoders generated and mutated frame "
        "streams; only the documented protocol error may come out, and memory stays flat.")
    parser.add_argument("--seed", type=int, default=None,
                        help="the run's seed (default: a random one, printed)")
    parser.add_argument("--count", type=int, default=1_000_000, help="cases (default 1000000)")
    parser.add_argument("--start", type=int, default=0, help="first case number (to reproduce)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    print(f"fuzzing {args.count:,} cases from case {args.start}, seed {seed}", flush=True)
    try:
        f = fuzz(seed, args.count, args.start)
    except AssertionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {f['cases']:,} cases ({f['octets']:,} octets; {f['requests']:,} requests, "
          f"{f['answers']:,} answers and {f['extended']:,} requests with MESSAGE_EX accepted "
          f"decoded) in {f['seconds']} s; resident memory "
          f"{f['rss_before'] / 2**20:.1f} MiB after the warm-up, {f['rss_after'] / 2**20:.1f} "
          f"MiB at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
