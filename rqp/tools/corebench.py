"""rqp-corebench: CPU per message of the two protocol cores alone, as the queue keys spread.

The sending MCA's decisions (``rqp.protocol.sender.SenderCore``) and a receiving MCA's
connection (``rqp.protocol.receiver.ReceiverConnection``) run against each other in this one
process, without queues, sockets, threads or disk: records are submitted as the sending MCA
takes them (round-robin over the queue keys, at most READ_BATCH at a time and no more held than
its memory budget), the frames go to the receiving side as bytes, every QUEUE_ASK is offered,
every MESSAGE delivered, and the answers come back ANSWER_READ at a time, as the agents read
them under load. Every message must end confirmed.

What the agents cost besides (System V, the journal's and the window's fsync, the event loop)
is not here, so the figures are steadier than the agents' (``scripts/bench --scale``) and show
what the protocol logic itself costs a message: with 1 and with 1,000 queue keys, the key
counts interleaved over ``--repeat`` runs; median (min-max) of the runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from rqp import cli
from rqp.protocol.constants import DEFAULT_WINDOW, KNOWN_EXTENSIONS, SURE_MSG, UNSURE_MSG
from rqp.protocol.frames import NEED_DATA
from rqp.protocol.receiver import Ask, Put, ReceiverConnection
from rqp.protocol.records import TRANSMISSION_HEADER_SIZE
from rqp.protocol.sender import (
    Connect, Delivered, Note, Send, SenderCore, Settings, budget_size,
)
from rqp.system.queues import kernel_limits

#: The receiving MCA (any name: nothing is connected).
PEER = "receiver"
#: The first queue key; the others follow it.
FIRST_KEY = 0x52510000
#: Records the sending MCA's reader takes in one go (rqp_agents.intake.READ_BATCH).
READ_BATCH = 256
#: Answers per read of the sending MCA (under load the agents read about 70 a time).
ANSWER_READ = 64


class CoreBenchError(Exception):
    pass


class _Pair:
    """A sending core and the receiving core it talks to, and what is on the wire."""

    def __init__(self, keys: int, window: int, message_type: int, size: int) -> None:
        new_keys = itertools.count(1)
        self.sender = SenderCore(Settings(hosts=(PEER,), window=window), lambda: next(new_keys))
        self.receiver = ReceiverConnection(max_message_size=max(size, 1),
                                           extensions=KNOWN_EXTENSIONS)
        self.queue_keys = [FIRST_KEY + i for i in range(keys)]
        self.message_type, self.payload = message_type, bytes(size)
        self.held = budget_size(window, 1)
        self.answers: list[bytes] = []  # answered, not yet read by the sending side
        self.now = 0.0
        self.spent = {"sending": 0, "receiving": 0}

    def carry(self, messages: int) -> None:
        """Submit ``messages`` (round-robin over the keys, from the first) and carry them until
        every one is confirmed, adding up each core's CPU time. After each batch of actions
        the sending side asks the core when to call it next, as the agent does."""
        sender, receiver, keys = self.sender, self.receiver, self.queue_keys
        clock, spent = time.thread_time_ns, self.spent
        submitted = confirmed = 0
        while confirmed < messages:
            self.now += 0.001
            t0 = clock()
            take = min(READ_BATCH, self.held - (submitted - confirmed), messages - submitted)
            for seq in range(submitted, submitted + take):
                sender.submit(self.message_type, keys[seq % len(keys)], self.payload, self.now)
            submitted += take
            if self.answers:
                read, self.answers[:ANSWER_READ] = self.answers[:ANSWER_READ], []
                sender.data_received(PEER, b"".join(read), self.now)
            frames = []
            for action in sender.take_actions():
                kind = type(action)
                if kind is Send:
                    frames.append(action.data)
                elif kind is Delivered:
                    confirmed += 1
                elif kind is Connect:
                    sender.connected(PEER, self.now)
                    frames += [a.data for a in sender.take_actions() if type(a) is Send]
                elif kind is not Note:
                    raise CoreBenchError(f"the sending core did {action!r}: every message "
                                         "must be confirmed")
            sender.next_deadline()
            t1 = clock()
            if frames:
                receiver.receive_data(b"".join(frames))
                while (request := receiver.next_request()) is not NEED_DATA:
                    if type(request) is Put:
                        self.answers.append(receiver.answer_put(request, True))
                    elif type(request) is Ask:
                        self.answers.append(receiver.answer_ask(request, True))
                    else:
                        raise CoreBenchError(f"the receiving core made {request!r}")
            spent["sending"] += t1 - t0
            spent["receiving"] += clock() - t1
            if not frames and not self.answers and not take and confirmed < messages:
                raise CoreBenchError(f"stuck: {confirmed} of {messages} messages confirmed")


def run(keys: int, messages: int, window: int, message_type: int, size: int) -> dict:
    """One run: CPU µs a message of each core (thread CPU time, so the other's is not in it),
    after a warm-up that finds the route of every key (as the agents' first round does)."""
    pair = _Pair(keys, window, message_type, size)
    pair.carry(keys)
    pair.spent = {"sending": 0, "receiving": 0}
    pair.carry(messages)
    return {side: ns / 1000 / messages for side, ns in pair.spent.items()}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rqp.tools.corebench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=cli.key_counts,
                        help="queue key counts, comma-separated (default 1,1000)")
    parser.add_argument("--messages", type=int, default=60_000,
                        help="messages a run (default 60000)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs of each key count, interleaved (default 5)")
    parser.add_argument("--type", choices=("SURE", "UNSURE"), type=str.upper, default="SURE")
    parser.add_argument("--size", type=int, default=100,
                        help="payload bytes, at most what a transmission record carries "
                        "(default 100)")
    parser.add_argument("--window", type=cli.window, default=DEFAULT_WINDOW,
                        help=f"the sending core's window (default {DEFAULT_WINDOW})")
    parser.add_argument("--json", metavar="FILE", type=cli.output_file,
                        help="also write the figures to FILE")
    args = parser.parse_args(argv)
    for name, value, least in (("--messages", args.messages, 1), ("--repeat", args.repeat, 1),
                               ("--size", args.size, 0)):
        if value < least:
            parser.error(f"{name} {value}: at least {least}")
    if args.keys is None:  # (the default counts run with any --messages)
        args.keys = [1, 1000]
    elif max(args.keys) > args.messages:
        parser.error(f"--keys {max(args.keys)}: more keys than --messages {args.messages} (a "
                     "run sends each key at least one)")
    largest = kernel_limits().msgmax - TRANSMISSION_HEADER_SIZE
    if args.size > largest:
        parser.error(f"--size {args.size}: at most {largest} (msgmax {kernel_limits().msgmax} "
                     f"less the {TRANSMISSION_HEADER_SIZE}-byte record header: no sending MCA "
                     "carries more)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    message_type = SURE_MSG if args.type == "SURE" else UNSURE_MSG
    runs: dict[int, list[dict]] = {k: [] for k in args.keys}
    try:
        for _ in range(args.repeat):
            for keys in args.keys:
                runs[keys].append(run(keys, args.messages, args.window, message_type,
                                      args.size))
    except CoreBenchError as exc:
        print(f"rqp-corebench: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"{args.type} {args.size} B, window {args.window}, {args.messages} messages a run, "
          f"{args.repeat} run(s) of each: CPU us a message, median (min-max)")
    print(f"{'queue keys':>10} {'sending core':>20} {'receiving core':>20} {'both':>20}  "
          f"both against {args.keys[0]} key(s)")
    base = None
    for keys, results in runs.items():
        cells = []
        for side in ("sending", "receiving", "both"):
            values = [r["sending"] + r["receiving"] if side == "both" else r[side]
                      for r in results]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        both = statistics.median(r["sending"] + r["receiving"] for r in results)
        base = both if base is None else base
        print(f"{keys:>10} " + " ".join(f"{c:>20}" for c in cells)
              + (f"  {both / base - 1:+.0%}" if keys != args.keys[0] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"type": args.type, "size": args.size, "window": args.window,
             "messages": args.messages, "runs": {str(k): v for k, v in runs.items()}},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
