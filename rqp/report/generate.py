"""Synthetic dead-letter archives (schema version 2) for tests and benchmarks.

``python -m rqp.report.generate --records N --output DIR --seed S`` writes N archive lines as
``dlq-S-00000.jsonl.gz``, ``dlq-S-00001.jsonl.gz``, ... (``--per-file`` lines each, 200,000 by
default), one file per task across ``--processes`` processes (2 by default). The same seed
gives the same bytes whatever the number of processes: every file has its own random stream
(seeded with the seed and the file's number) and a gzip header without a time or a name.

What the data looks like:

* ~200 destination queues and ~100 hosts, Zipf-like (a few queues and hosts get most of the
  dead letters); each queue lives on one host, most have a name;
* reasons weighted as in :data:`REASON_WEIGHTS` (QUEUE_FULL 35 %, UNKNOWN_QUEUE 25 %,
  NO_ROUTE 15 %, NOT_AUTHORIZED 8 %, MESSAGE_TOO_BIG 5 %, the rest small), each made by the
  agent that makes it (the receiving agent on the destination host, the sending agent or the
  API on the source host), UNKNOWN_QUEUE partly for keys no host has;
* times over one week from ``--start`` (a Monday), diurnal: busy working hours, quiet nights,
  quieter weekends;
* ``original_length`` log-normal (median ~600 bytes; MESSAGE_TOO_BIG ones ~100 KiB and header
  only). The archived payload is cut to :data:`PAYLOAD_CAP` bytes (``truncated``, with a
  ``spill_path``) to keep the files small; previews include XML with ``<``, ``&`` and quotes;
* about :data:`DUPLICATE_RATE` of the lines repeat an earlier id (the drain archiving a record
  twice), with a later ``archived_at``: the report must count them once.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import gzip
import itertools
import json
import math
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass

from rqp.protocol import reasons as _reasons
from rqp.system import signals

__all__ = [
    "REASON_WEIGHTS",
    "REASON_CODES",
    "PAYLOAD_CAP",
    "DUPLICATE_RATE",
    "DEFAULT_PER_FILE",
    "DEFAULT_START",
    "World",
    "make_world",
    "generate_lines",
    "generate",
    "main",
]

#: Share of each reason, in per cent.
REASON_WEIGHTS: dict[str, float] = {
    "QUEUE_FULL": 35.0,
    "UNKNOWN_QUEUE": 25.0,
    "NO_ROUTE": 15.0,
    "NOT_AUTHORIZED": 8.0,
    "MESSAGE_TOO_BIG": 5.0,
    "RETRY_BUDGET_EXHAUSTED": 4.0,
    "QUEUE_NOT_OFFERED": 3.0,
    "PUT_FAILED": 2.0,
    "INVALID_QUEUE_KEY": 1.0,
    "MALFORMED_RECORD": 0.8,
    "BAD_MESSAGE_TYPE": 0.6,
    "NO_QUEUE_KEY": 0.4,
    "MALFORMED": 0.2,
}

#: ``reason_code`` of each reason, and who writes it: from the one table.
REASON_CODES: dict[str, int] = {r.name: r.code for r in _reasons.REASONS}
_AGENT = {r.name: "receiver" if r.by == "both" else r.by for r in _reasons.REASONS}

_DETAIL = {
    "QUEUE_FULL": "msgsnd: errno 11: Resource temporarily unavailable (still full after 5 tries)",
    "UNKNOWN_QUEUE": "msgget: errno 2: No such file or directory",
    "NO_ROUTE": "no host in .rqprc answered QUEUE_YES",
    "NOT_AUTHORIZED": "msgsnd: errno 13: Permission denied",
    "MESSAGE_TOO_BIG": "message of {n} bytes is over max_message_size 65536",
    "RETRY_BUDGET_EXHAUSTED": "no confirmation after {a} attempts",
    "QUEUE_NOT_OFFERED": "queue not in the receiver's offered list",
    "PUT_FAILED": "msgsnd: errno 22: Invalid argument",
    "INVALID_QUEUE_KEY": "queue key out of range",
    "MALFORMED_RECORD": "bad magic b'RQPY' in transmission record",
    "BAD_MESSAGE_TYPE": "message type 7 is neither SURE nor UNSURE",
    "NO_QUEUE_KEY": "queue key 0 (IPC_PRIVATE)",
    "MALFORMED": "dead-letter record unreadable: truncated after 31 bytes",
}

#: The archived payload is at most this many bytes (the rest is "spilled").
PAYLOAD_CAP = 256
#: Share of lines that repeat an earlier id.
DUPLICATE_RATE = 0.005
DEFAULT_PER_FILE = 200_000
DEFAULT_START = "2025-03-03T00:00:00Z"  # a Monday
_PREVIEW_CHARS = 64
_WEEK_HOURS = 7 * 24
_INVALID_KEYS = (0, 1 << 32, (1 << 32) + 0x5251, 0xFFFFFFFFFF)

_QUEUE_WORDS = ("ORDERS", "BILLING", "AUDIT", "EVENTS", "PRICES", "STOCK", "SHIPPING", "USERS",
                "METRICS", "ALERTS", "INVOICES", "PAYMENTS", "REPORTS", "SESSIONS", "TRADES")
_SITES = ("par1", "fra2", "ams1", "lon3", "nyc1")
_FILLER = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
           "incididunt ut labore et dolore magna aliqua ") * 8


@dataclass(frozen=True)
class World:
    """The fixed part of a data set: queues, hosts and their popularity."""

    hosts: tuple[str, ...]
    host_cum: tuple[float, ...]          # cumulative Zipf weights over hosts (sources)
    queue_keys: tuple[int, ...]
    queue_names: tuple[str | None, ...]
    queue_homes: tuple[str, ...]         # the host each queue lives on
    queue_cum: tuple[float, ...]         # cumulative Zipf weights over queues
    ghost_keys: tuple[int, ...]          # keys no host has (UNKNOWN_QUEUE)
    hour_cum: tuple[float, ...]          # cumulative diurnal weights over the hours of a week
    start_s: int                         # unix seconds of the first hour


def _zipf_cum(n: int, s: float, rng: random.Random) -> tuple[float, ...]:
    weights = [1.0 / (rank ** s) for rank in range(1, n + 1)]
    rng.shuffle(weights)  # popularity is not in key order
    return tuple(itertools.accumulate(weights))


def _diurnal(hour_of_week: int) -> float:
    day, hour = divmod(hour_of_week, 24)
    working = 0.15 + math.exp(-((hour - 14.0) / 4.0) ** 2)  # peak mid-afternoon UTC
    return working * (0.35 if day >= 5 else 1.0)


def make_world(seed: int, start: str = DEFAULT_START, queues: int = 200,
               hosts: int = 100) -> World:
    rng = random.Random(f"rqp-report-world:{seed}")
    host_names = tuple(f"{rng.choice(('app', 'mq', 'batch', 'edge'))}{i:03d}."
                       f"{rng.choice(_SITES)}.example.net" for i in range(hosts))
    host_cum = _zipf_cum(hosts, 1.0, rng)
    keys: list[int] = []
    seen: set[int] = set()
    while len(keys) < queues + 20:
        k = rng.randrange(0x10000000, 0x7FFFFFFF)
        if k not in seen:
            seen.add(k)
            keys.append(k)
    names = tuple(
        (f"{rng.choice(_QUEUE_WORDS)}.{rng.choice(_QUEUE_WORDS)}.Q{i}" if rng.random() < 0.75
         else None)
        for i in range(queues))
    homes = tuple(rng.choices(host_names, cum_weights=host_cum, k=queues))
    start_s = int(_dt.datetime.fromisoformat(start.replace("Z", "+00:00")).timestamp())
    return World(
        hosts=host_names, host_cum=host_cum, queue_keys=tuple(keys[:queues]),
        queue_names=names, queue_homes=homes, queue_cum=_zipf_cum(queues, 1.1, rng),
        ghost_keys=tuple(keys[queues:]),
        hour_cum=tuple(itertools.accumulate(_diurnal(h) for h in range(_WEEK_HOURS))),
        start_s=start_s)


class _Clock:
    """ISO-8601 strings of unix nanoseconds, fast: one strftime per hour."""

    def __init__(self) -> None:
        self._prefix: dict[int, str] = {}

    def iso(self, ns: int) -> str:
        hour, rest = divmod(ns, 3_600_000_000_000)
        prefix = self._prefix.get(hour)
        if prefix is None:
            prefix = _dt.datetime.fromtimestamp(hour * 3600, _dt.timezone.utc).strftime(
                "%Y-%m-%dT%H:")
            self._prefix[hour] = prefix
        minute, rest = divmod(rest, 60_000_000_000)
        second, rest = divmod(rest, 1_000_000_000)
        return "%s%02d:%02d.%06dZ" % (prefix, minute, second, rest // 1000)


_LINE = (
    '{"schema":2,"id":"%s","archived_by":"%s","archived_at":"%s","host":"%s","agent":"%s",'
    '"reason":"%s","reason_code":%d,"queue_key":%d,"queue_key_hex":"%s","queue_name":%s,'
    '"message_key":"0x%016x","message_type":"%s","timestamp":"%s","timestamp_ns":%d,'
    '"attempts":%d,"original_length":%d,"payload_length":%d,"truncated":%s,"header_only":%s,'
    '"source_host":"%s","destination_host":"%s","detail":%s,"spill_path":"%s",'
    '"payload_b64":"%s","payload_preview":%s,"record_version":2,"mtype":1,"priority":4,'
    '"expires_at_ms":0}\n'
)


def _payload(rng: random.Random, seq: int, queue: str, size: int) -> bytes:
    kind = rng.random()
    if kind < 0.03:
        return rng.randbytes(min(size, PAYLOAD_CAP))  # binary
    if kind < 0.4:
        head = '<order id="%d" queue="%s"><qty>%d</qty><note>A&amp;B &lt;ok&gt;</note>' % (
            seq, queue, 1 + int(rng.random() * 99))
    else:
        head = '{"seq":%d,"queue":"%s","amount":%d.%02d,"text":"' % (
            seq, queue, 1 + int(rng.random() * 9999), int(rng.random() * 100))
    n = min(size, PAYLOAD_CAP)
    text = head + _FILLER[int(rng.random() * 64):]
    return text[:n].encode("ascii")


_PRINTABLE = bytes(b if 32 <= b < 127 else 0x2E for b in range(256))


def _preview(payload: bytes) -> str:
    """What a drain shows of a payload: printable ASCII kept, anything else as '.'."""
    return payload[:_PREVIEW_CHARS].translate(_PRINTABLE).decode("ascii")


def generate_lines(world: World, seed: int, index: int, count: int) -> list[str]:
    """The ``count`` lines of file number ``index`` (deterministic in seed and index)."""
    rng = random.Random(f"rqp-report-file:{seed}:{index}")
    clock = _Clock()
    reasons = list(REASON_WEIGHTS)
    reason_cum = list(itertools.accumulate(REASON_WEIGHTS.values()))
    n_queues = len(world.queue_keys)
    queue_idx = rng.choices(range(n_queues), cum_weights=world.queue_cum, k=count)
    sources = rng.choices(world.hosts, cum_weights=world.host_cum, k=count)
    hours = rng.choices(range(_WEEK_HOURS), cum_weights=world.hour_cum, k=count)
    picked = rng.choices(reasons, cum_weights=reason_cum, k=count)
    detail_json = {r: json.dumps(d) for r, d in _DETAIL.items()}
    start_ns = world.start_s * 1_000_000_000
    names_json = [json.dumps(n) for n in world.queue_names]
    rnd = rng.random  # int(rnd() * n) is a uniform integer below n, faster than randrange
    hour_ns = 3_600_000_000_000
    lines: list[str] = []
    previous: list[tuple] = []
    for i in range(count):
        if previous and rnd() < DUPLICATE_RATE:
            # the drain archived an earlier record again, later and maybe from elsewhere
            fields = list(rng.choice(previous))
            fields[2] = clock.iso(fields[13] + (1 + int(rnd() * 47)) * hour_ns)
            lines.append(_LINE % tuple(fields))
            continue
        reason = picked[i]
        agent = _AGENT[reason]
        q = queue_idx[i]
        source = sources[i]
        queue_key = world.queue_keys[q]
        queue_name = names_json[q]
        home = world.queue_homes[q]
        if reason == "UNKNOWN_QUEUE" and rnd() < 0.3:
            queue_key = rng.choice(world.ghost_keys)
            queue_name = "null"
        elif reason == "NO_QUEUE_KEY":
            queue_key, queue_name = 0, "null"
        elif reason == "INVALID_QUEUE_KEY":
            queue_key, queue_name = rng.choice(_INVALID_KEYS), "null"
        if agent == "receiver":
            host, source_host, destination_host = home, source, ""
            if source == home:
                source_host = ""
        else:
            host, source_host = source, ""
            destination_host = home if reason == "RETRY_BUDGET_EXHAUSTED" else ""
        if reason in ("BAD_MESSAGE_TYPE", "MALFORMED_RECORD", "MALFORMED"):
            message_type = "UNKNOWN"
        else:
            message_type = "SURE" if rnd() < 0.6 else "UNSURE"
        attempts = 20 if reason == "RETRY_BUDGET_EXHAUSTED" else (
            1 + int(rnd() * 3) if message_type == "SURE" else 1)
        if reason == "MESSAGE_TOO_BIG":
            original = int(rng.lognormvariate(math.log(100_000), 0.5)) + 65_537
        else:
            original = max(1, int(rng.lognormvariate(math.log(600), 1.1)))
        ident = "%032x" % rng.getrandbits(128)
        if reason == "MESSAGE_TOO_BIG":
            payload, header_only = b"", True
        else:
            payload, header_only = _payload(rng, i, "%08x" % queue_key, original), False
        truncated = len(payload) < original and not header_only
        ts_ns = start_ns + hours[i] * hour_ns + int(rnd() * hour_ns)
        archived_ns = ts_ns + 60_000_000_000 + int(rnd() * 7_140_000_000_000)
        detail = detail_json[reason]
        if "{" in detail:
            detail = json.dumps(_DETAIL[reason].format(n=original, a=attempts))
        fields = (
            ident, "rqp-dlq-drain@" + host, clock.iso(archived_ns), host, agent, reason,
            REASON_CODES[reason], queue_key, "0x%08x" % queue_key,
            queue_name, rng.getrandbits(64), message_type, clock.iso(ts_ns), ts_ns,
            attempts, original, len(payload), "true" if truncated else "false",
            "true" if header_only else "false", source_host, destination_host, detail,
            "/var/spool/rqp/spill/%s.bin" % ident if truncated else "",
            base64.b64encode(payload).decode("ascii"), json.dumps(_preview(payload)),
        )
        lines.append(_LINE % fields)
        if len(previous) < 1000:
            previous.append(fields)
        elif rnd() < 0.01:
            previous[int(rnd() * 1000)] = fields
    return lines


def _write_file(task: tuple) -> tuple[str, int]:
    world, seed, index, count, path, compress = task
    lines = generate_lines(world, seed, index, count)
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as raw:
        if compress:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=1,
                               mtime=0) as out:
                for k in range(0, len(lines), 10_000):
                    out.write("".join(lines[k:k + 10_000]).encode("utf-8"))
        else:
            raw.write("".join(lines).encode("utf-8"))
    os.replace(tmp, path)
    return path, count


def generate(records: int, output: str, seed: int = 1, per_file: int = DEFAULT_PER_FILE,
             processes: int = 2, start: str = DEFAULT_START, compress: bool = True,
             reuse: bool = False) -> list[str]:
    """Write ``records`` archive lines under ``output``; return the file paths, in order.
    ``reuse``: a file already there is kept (each file is a function of the seed, its number
    and its line count, and is written under a temporary name then renamed, so one that exists
    is whole) — only while ``per_file`` divides ``records`` (then every file has that count)."""
    if records < 0 or per_file < 1:
        raise ValueError("records must be >= 0 and per_file >= 1")
    os.makedirs(output, exist_ok=True)
    world = make_world(seed, start)
    suffix = ".jsonl.gz" if compress else ".jsonl"
    tasks = []
    for index, first in enumerate(range(0, records, per_file)):
        path = os.path.join(output, f"dlq-{seed}-{index:05d}{suffix}")
        tasks.append((world, seed, index, min(per_file, records - first), path, compress))
    kept = []
    if reuse and records % per_file == 0:
        kept = [(t[4], t[3]) for t in tasks if os.path.exists(t[4])]
        tasks = [t for t in tasks if not os.path.exists(t[4])]
    if not tasks:
        done = []
    elif processes <= 1 or len(tasks) <= 1:
        done = [_write_file(t) for t in tasks]
    else:
        with multiprocessing.get_context("fork").Pool(
                min(processes, len(tasks)), initializer=signals.end_on_sigterm) as pool:
            done = pool.map(_write_file, tasks, chunksize=1)
    return sorted(path for path, _ in kept + done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rqp.report.generate",
        description="Write synthetic dead-letter archives (schema 2) with realistic skew.")
    parser.add_argument("--records", type=int, required=True, help="number of archive lines")
    parser.add_argument("--output", required=True, help="directory to write the files in")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--per-file", type=int, default=DEFAULT_PER_FILE,
                        help="lines per file (default %(default)s)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--start", default=DEFAULT_START,
                        help="first hour of the week, ISO-8601 UTC (default %(default)s)")
    parser.add_argument("--plain", action="store_true", help="write .jsonl, not .jsonl.gz")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    files = generate(args.records, args.output, args.seed, args.per_file, args.processes,
                     args.start, compress=not args.plain)
    elapsed = time.monotonic() - t0
    print(f"wrote {args.records} dead letters in {len(files)} files under {args.output} "
          f"in {elapsed:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
