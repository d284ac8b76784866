"""Replaying archived dead letters with a rules table (``rqpctl dlq replay``).

In the spirit of IBM MQ's ``runmqdlq``: a YAML file holds a list of rules under ``rules:``;
each archived dead letter (:mod:`rqp.storage.archive`) is given the action of the FIRST rule whose
patterns all match it; no matching rule means ``keep``::

    rules:
      - reason: [NO_ROUTE, QUEUE_FULL]      # a ReasonCode name or a list; fnmatch wildcards
        queue: PROD_THE_SCHED_COMMON        # key (0x52510001, 1381040129) or .rqprc name, or a list
        message_type: SURE                  # SURE / UNSURE / UNKNOWN, or a list
        host: "web-*"                       # fnmatch on host / source_host / destination_host
        older_than: 10m                     # dead-lettered at least this long ago
        newer_than: 1d                      # ... and less than this long ago
        action: retry                       # retry | forward | discard | keep
      - reason: UNKNOWN_QUEUE
        queue: 0x52510009
        action: forward
        to: PROD_THE_SCHED_SPARE            # forward's destination: key or .rqprc name
      - reason: "MALFORMED*"
        action: discard

Every pattern is optional (a rule with only ``action`` matches everything). Patterns:

``reason``      the row's ``reason`` (``NO_ROUTE``, ``UNKNOWN_7``, ``MALFORMED``), case-insensitive,
                ``*``/``?``/``[...]`` wildcards allowed; a name without wildcards must exist.
``queue``       the row's original ``queue_key``.
``message_type`` the row's ``message_type``.
``host``        case-insensitive fnmatch against the record's ``host`` (where it was
                dead-lettered), ``source_host`` and ``destination_host`` (also without its
                ``:port``): the rule matches if ANY of them matches.
``older_than`` / ``newer_than``  durations (``30s``, ``10m``, ``2h``, ``1d``, ``1w``, or
                seconds) compared with the record's ``timestamp`` at the start of the replay.

Actions:

``retry``     put it back on its ORIGINAL queue through the normal RQP path: a transmission
              record on the local transmission queue, SURE, waited for like
              ``sendMessage(sync=True)`` (so it is in the sending MCA's journal on disk), with
              flag ``REPLAY_KEY`` and the original message key in ``sequence``: the sending MCA
              sends it with its original key, so a receiving MCA that had in fact put it
              (within its de-duplication window) recognises the repeat.
``forward``   the same to the queue ``to:``, with a new key.
``discard``   remove it from the archive.
``keep``      leave it.

A row leaves the archive only once its replay is confirmed (the sending MCA has journaled it)
or it is discarded: the affected archive files are rewritten atomically (new file, fsync,
rename over the old one). A replay stopped between a confirmation and the rewrite leaves rows
that a later replay sends again: with their original key for ``retry`` (recognised by the
receiver), with a new one for ``forward`` (a duplicate is possible). A record that cannot be
put back (``MALFORMED``, ``header_only``, truncated without its spill file, too big for
``msgmax``) is refused with the reason and kept; it counts as failed.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from rqp import api
from rqp.config import (
    QUEUE_NAME_RE, SenderConfig, did_you_mean, parse_queue_key, read_yaml, show_value,
)
from rqp.protocol import reasons
from rqp.protocol.constants import DEFAULT_PRIORITY, SURE_MSG, UINT64_MAX
from rqp.protocol.errors import ConfigError, MessageTooBig, QueueFull, RQPError
from rqp.protocol.records import TransmissionFlags, TransmissionRecord
from rqp.storage.archive import (
    MALFORMED, ArchiveError, all_drain_states, archive_files, archived_spill, lock_file,
    read_archive_file, rewrite_archive_file, row_extras, row_payload,
)
from rqp.system.queues import format_key

__all__ = [
    "ACTIONS", "RULE_KEYS", "Decision", "ReplayRefused", "Replayer", "Rule", "TokenBucket",
    "TransmissionPutter", "decide", "load_rules", "parse_age", "replay_payload",
    "rules_from_data",
]

ACTIONS = ("retry", "forward", "discard", "keep")
RULE_KEYS = ("reason", "queue", "message_type", "host", "older_than", "newer_than", "action",
             "to")
TOP_KEYS = ("rules",)
REASON_NAMES = tuple(r.name for r in reasons.REASONS)
MESSAGE_TYPES = ("SURE", "UNSURE", "UNKNOWN")
#: A rewrite of the file in hand at least every this many removed rows / seconds, so that a
#: replay stopped abruptly repeats little.
FLUSH_ROWS = 500
FLUSH_SECONDS = 5.0
DEFAULT_RATE = 100.0
DEFAULT_CONFIRM_TIMEOUT = 30.0


# --------------------------------------------------------------------------------------------
# Rules


_AGE_RE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>ms|s|m|h|d|w)?")
_AGE_UNITS = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0,
              "w": 7 * 86400.0}
_AGE_EXPECTED = "expected a duration: seconds, or a number with ms, s, m, h, d or w (e.g. 30s, " \
                "10m, 2h, 1d)"


def parse_age(value: object) -> float:
    """Seconds from a number or ``'500ms'``, ``'30s'``, ``'10m'``, ``'2h'``, ``'1d'``, ``'1w'``."""
    seconds = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _AGE_RE.fullmatch(value.strip())):
        seconds = float(m["num"]) * _AGE_UNITS[m["unit"]]
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"bad value {show_value(value)}: {_AGE_EXPECTED}")
    return seconds


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule of the table: patterns (None = any) and an action."""

    index: int
    action: str
    reasons: tuple[str, ...] | None = None
    queues: frozenset[int] | None = None
    message_types: frozenset[str] | None = None
    hosts: tuple[str, ...] | None = None
    older_than: float | None = None
    newer_than: float | None = None
    to: int | None = None

    @property
    def name(self) -> str:
        return f"rules[{self.index}]"

    def matches(self, row: Mapping, now_ns: int) -> bool:
        if self.reasons is not None and not any(
                fnmatch.fnmatchcase(str(row.get("reason", "")).upper(), p) for p in self.reasons):
            return False
        if self.queues is not None and row.get("queue_key") not in self.queues:
            return False
        if self.message_types is not None and row.get("message_type") not in self.message_types:
            return False
        if self.hosts is not None:
            names = [str(row.get(k) or "").lower()
                     for k in ("host", "source_host", "destination_host")]
            destination = names[2]
            if destination.rpartition(":")[2].isdigit():  # 'host:port' or '[v6]:port'
                names.append(destination.rpartition(":")[0].strip("[]"))
            if not any(fnmatch.fnmatchcase(n, p) for p in self.hosts for n in names if n):
                return False
        age = (now_ns - int(row.get("timestamp_ns", 0))) / 1e9
        if self.older_than is not None and not age >= self.older_than:
            return False
        if self.newer_than is not None and not age < self.newer_than:
            return False
        return True


class _Checker:
    """Turns problems in one rules file into ConfigErrors naming the file, rule and key."""

    def __init__(self, file: str, lines: Mapping[str, int]) -> None:
        self.file = file
        self.lines = lines

    def fail(self, path: str | None, message: str):
        line = self.lines.get(path or "")
        where = f" (line {line})" if line else ""
        head = f"{self.file}: {path}: " if path else f"{self.file}: "
        raise ConfigError(head + message + where, path=self.file, key=path)

    def unknown_keys(self, path: str | None, mapping: Mapping, known: Iterable[str]) -> None:
        known = tuple(known)
        for key in mapping:
            if key not in known:
                hint = did_you_mean(key, known)
                line_path = f"{path}.{key}" if path else str(key)
                line = self.lines.get(line_path)
                where = f" (line {line})" if line else ""
                head = f"{self.file}: {path}: " if path else f"{self.file}: "
                raise ConfigError(f"{head}unknown key {str(key)!r}{hint}; known keys: "
                                  f"{', '.join(known)}{where}", path=self.file, key=line_path)


def _listed(value: object) -> list:
    return list(value) if isinstance(value, list) else [value]


def rules_from_data(data: object, *, source: str = "<rules>", config: SenderConfig | None = None,
                    lines: Mapping[str, int] | None = None) -> list[Rule]:
    """Validate a parsed rules file. ``config`` (a ``.rqprc``) gives queue names."""
    check = _Checker(source, lines or {})
    if not isinstance(data, Mapping):
        check.fail(None, "expected a mapping with the key 'rules' (a list of rules) at the top "
                   "level")
    check.unknown_keys(None, data, TOP_KEYS)
    if "rules" not in data:
        check.fail(None, "key 'rules' is required: a list of rules, each with an 'action'")
    raw_rules = data["rules"]
    if raw_rules is None:
        raw_rules = []
    if not isinstance(raw_rules, list):
        check.fail("rules", f"bad value {show_value(raw_rules)}: expected a list of rules")
    names = {**config.queues, **config.builtin_queues} if config is not None else None
    rules = []
    for index, raw in enumerate(raw_rules):
        rules.append(_rule(check, index, raw, names))
    return rules


def _rule(check: _Checker, index: int, raw: object, names: Mapping[str, int] | None) -> Rule:
    path = f"rules[{index}]"
    if not isinstance(raw, Mapping):
        check.fail(path, f"bad value {show_value(raw)}: expected a mapping with an 'action' and "
                   "optional patterns (" + ", ".join(k for k in RULE_KEYS if k != "action") + ")")
    check.unknown_keys(path, raw, RULE_KEYS)

    def bad(key: str, value: object, expected: str):
        line = check.lines.get(f"{path}.{key}")
        where = f" (line {line})" if line else ""
        raise ConfigError(f"{check.file}: {path}: key {key!r}: bad value {show_value(value)}: "
                          f"{expected}{where}", path=check.file, key=f"{path}.{key}")

    action = raw.get("action")
    if action is None:
        check.fail(path, "key 'action' is required: one of " + ", ".join(ACTIONS))
    if not isinstance(action, str) or action.strip().lower() not in ACTIONS:
        bad("action", action, "expected one of " + ", ".join(ACTIONS)
            + did_you_mean(action, ACTIONS))
    action = action.strip().lower()

    def queue_key(key: str, value: object) -> int:
        if names is None and isinstance(value, str) and QUEUE_NAME_RE.fullmatch(value.strip()):
            bad(key, value, "a queue name needs a .rqprc whose 'queues' defines it (give "
                "--rqprc), or give the key (e.g. 0x52510001)")
        try:
            return parse_queue_key(value, names)
        except ConfigError as exc:
            line = check.lines.get(f"{path}.{key}")
            where = f" (line {line})" if line else ""
            raise ConfigError(f"{check.file}: {path}: key {key!r}: {exc}{where}",
                              path=check.file, key=f"{path}.{key}") from None

    fields: dict = {}
    if raw.get("reason") is not None:
        patterns = []
        for value in _listed(raw["reason"]):
            if not isinstance(value, str) or not value.strip():
                bad("reason", value, "expected a reason name (e.g. NO_ROUTE), a pattern "
                    "(e.g. 'QUEUE_*') or a list of them")
            pattern = value.strip().upper()
            if not any(c in pattern for c in "*?[") and pattern not in REASON_NAMES \
                    and not re.fullmatch(r"UNKNOWN_[0-9]+", pattern):
                bad("reason", value, "expected a reason name: " + ", ".join(REASON_NAMES)
                    + did_you_mean(pattern, REASON_NAMES))
            patterns.append(pattern)
        fields["reasons"] = tuple(patterns)
    if raw.get("queue") is not None:
        fields["queues"] = frozenset(queue_key("queue", v) for v in _listed(raw["queue"]))
    if raw.get("message_type") is not None:
        types = set()
        for value in _listed(raw["message_type"]):
            text = value.strip().upper() if isinstance(value, str) else value
            if text not in MESSAGE_TYPES:
                bad("message_type", value, "expected SURE, UNSURE or UNKNOWN"
                    + did_you_mean(text, MESSAGE_TYPES))
            types.add(text)
        fields["message_types"] = frozenset(types)
    if raw.get("host") is not None:
        hosts = []
        for value in _listed(raw["host"]):
            if not isinstance(value, str) or not value.strip():
                bad("host", value, "expected a host name or fnmatch pattern (e.g. 'web-*')")
            hosts.append(value.strip().lower())
        fields["hosts"] = tuple(hosts)
    for key in ("older_than", "newer_than"):
        if raw.get(key) is not None:
            try:
                fields[key] = parse_age(raw[key])
            except ValueError:
                bad(key, raw[key], _AGE_EXPECTED)
    if "older_than" in fields and "newer_than" in fields \
            and fields["older_than"] >= fields["newer_than"]:
        bad("newer_than", raw["newer_than"], f"expected more than older_than "
            f"({show_value(raw['older_than'])}): no record is both older than {raw['older_than']} "
            f"and newer than {raw['newer_than']}")
    if action == "forward":
        if raw.get("to") is None:
            check.fail(path, "action 'forward' needs key 'to': the queue (key or .rqprc name) "
                       "to forward to")
        fields["to"] = queue_key("to", raw["to"])
    elif raw.get("to") is not None:
        bad("to", raw["to"], f"'to' is only for action 'forward' (this rule's action is "
            f"{action!r})")
    return Rule(index=index, action=action, **fields)


def load_rules(path: str | os.PathLike, *, config: SenderConfig | None = None) -> list[Rule]:
    """Read and validate a rules file (YAML); :class:`ConfigError` names file, rule and key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: {'is not a file' if path.exists() else 'no such file'}",
                          path=str(path))
    data, lines = read_yaml(path)
    return rules_from_data(data, source=str(path), config=config, lines=lines)


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str
    rule: Rule | None

    @property
    def to(self) -> int | None:
        return self.rule.to if self.rule else None


def decide(rules: Iterable[Rule], row: Mapping, now_ns: int) -> Decision:
    """The first matching rule's action; ``keep`` when none matches."""
    for rule in rules:
        if rule.matches(row, now_ns):
            return Decision(rule.action, rule)
    return Decision("keep", None)


# --------------------------------------------------------------------------------------------
# Putting messages back


class ReplayRefused(RQPError):
    """This record cannot be put back (the message says why); it is kept in the archive."""


class NotConfirmed(RQPError):
    """The sending MCA did not take the record within the timeout (it may still send it)."""


def replay_payload(row: Mapping, archive: Path | None = None) -> bytes:
    """The full payload to put back, or :class:`ReplayRefused` saying why there is none. A
    truncated record's spill file is read where the record names it, else from the copy the
    drain kept in ``archive`` (:func:`rqp.storage.archive.archived_spill`)."""
    if row.get("reason") == MALFORMED:
        raise ReplayRefused("a MALFORMED record holds no message, only unreadable bytes: "
                            "discard or keep it")
    if row.get("header_only"):
        raise ReplayRefused("header only: the payload was never read (the message was skipped "
                            "on the wire), so there is nothing to put back")
    payload = row_payload(row)
    if not row.get("truncated"):
        return payload
    spill = row.get("spill_path") or ""
    if not spill:
        raise ReplayRefused(f"truncated to {len(payload)} of {row.get('original_length')} "
                            "bytes and no spill file was written: the full payload is lost")
    places = [spill] + ([str(archived_spill(archive, spill))] if archive is not None else [])
    full = exc = None
    for place in places:
        try:
            with open(place, "rb") as f:
                full = f.read()
            break
        except OSError as error:
            exc = exc or error
    if full is None:
        raise ReplayRefused(f"truncated to {len(payload)} of {row.get('original_length')} bytes "
                            f"and its spill file {spill} cannot be read here "
                            f"({exc.strerror or exc}): copy it from host "
                            f"{row.get('host')!r} to that path, then replay again") from None
    if len(full) != row.get("original_length") or not full.startswith(payload):
        raise ReplayRefused(f"spill file {spill} holds {len(full)} bytes that are not this "
                            f"record's payload ({row.get('original_length')} bytes)")
    return full


class TransmissionPutter:
    """Puts SURE transmission records on the local transmission queue and waits until the
    sending MCA has journaled them, as ``sendMessage(sync=True)`` does; with a replay key, sets
    flag ``REPLAY_KEY`` and the key in ``sequence``."""

    def __init__(self, config: SenderConfig, rqprc: str | os.PathLike | None = None, *,
                 start_sender: bool = True, timeout: float = DEFAULT_CONFIRM_TIMEOUT) -> None:
        if start_sender:
            api.ensure_sender(config, Path(rqprc).resolve() if rqprc else None)
        self.timeout = timeout
        self.producer = api.Producer(config)
        self.limit = self.producer.limit

    def __call__(self, queue_key: int, payload: bytes, replay_key: int = 0, *, mtype: int = 1,
                 priority: int = DEFAULT_PRIORITY) -> None:
        if len(payload) > self.limit:
            raise MessageTooBig(
                f"payload of {len(payload)} bytes is too big to put back: a transmission "
                f"record holds at most {self.limit} (kernel msgmax minus 36); raise "
                "kernel.msgmax (see the README)", size=len(payload), limit=self.limit)
        if not 0 <= replay_key <= UINT64_MAX:
            raise ValueError(f"replay key {replay_key} is not a uint64")
        record = TransmissionRecord(
            message_type=SURE_MSG, queue_key=queue_key, payload=payload,
            flags=TransmissionFlags.REPLAY_KEY if replay_key else 0, producer_pid=os.getpid(),
            sequence=replay_key, enqueued_ns=time.time_ns(), mtype=mtype, priority=priority)
        try:
            self.producer.put(record, timeout=self.timeout, sync=True,
                              sync_timeout=self.timeout)
        except QueueFull as exc:
            raise NotConfirmed(f"{exc}: is a sending MCA taking records?") from None
        except RQPError as exc:
            raise NotConfirmed(str(exc)) from None


class TokenBucket:
    """At most ``rate`` takes per second on average, bursts of at most ``burst``. With
    ``burst`` 1, N takes last at least (N-1)/rate seconds."""

    def __init__(self, rate: float, burst: float = 1.0, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.clock = clock
        self.sleep = sleep
        self.last = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now

    def take(self) -> None:
        self._refill()
        while self.tokens < 1.0:
            self.sleep((1.0 - self.tokens) / self.rate)
            self._refill()
        self.tokens -= 1.0


# --------------------------------------------------------------------------------------------
# The replay


_VERBS = {"retry": ("replayed", "would retry"), "forward": ("forwarded", "would forward"),
          "discard": ("discarded", "would discard"), "keep": ("kept", "would keep")}
SUMMARY_KEYS = ("replayed", "forwarded", "discarded", "kept", "failed")


class _File:
    """One archive file being worked on: its rows and the ones to drop."""

    def __init__(self, path: Path, rows: list[dict]) -> None:
        self.path = path
        self.rows = rows
        self.removed: set[int] = set()
        self.written = 0  # len(removed) at the last rewrite
        self.last_flush = time.monotonic()

    def flush(self) -> None:
        if len(self.removed) != self.written:
            rewrite_archive_file(self.path, (r for i, r in enumerate(self.rows)
                                             if i not in self.removed))
            self.written = len(self.removed)
        self.last_flush = time.monotonic()


class Replayer:
    """Applies rules to every row of an archive directory (see the module doc).

    ``send(queue_key, payload, replay_key)`` puts one message back and returns once it is
    confirmed (a :class:`TransmissionPutter`); it is needed unless ``dry_run``. ``out`` gets
    one line per record acted on (every record in a dry run) and the summary.
    """

    def __init__(self, archive: str | os.PathLike, rules: list[Rule], *,
                 send: Callable[..., None] | None = None, dry_run: bool = False,
                 rate: float = DEFAULT_RATE, limit: int | None = None,
                 config: SenderConfig | None = None, out: Callable[[str], None] = print,
                 now_ns: int | None = None, stop: threading.Event | None = None,
                 bucket: TokenBucket | None = None) -> None:
        self.archive = Path(archive)
        self.rules = rules
        self.send = send
        self.dry_run = dry_run
        self.limit = limit
        self.config = config
        self.out = out
        self.now_ns = time.time_ns() if now_ns is None else now_ns
        self.stop = stop or threading.Event()
        self.bucket = bucket or TokenBucket(rate)
        self.counts: collections.Counter = collections.Counter()
        self.acted = 0
        self.stopped_by: str | None = None
        self._seen: dict[str, bool] = {}  # id -> removed from the archive
        if not dry_run and send is None and any(r.action in ("retry", "forward") for r in rules):
            raise ValueError("a Replayer that retries or forwards needs send=")

    # -- output --------------------------------------------------------------------------

    def _queue(self, key: int) -> str:
        name = self.config.queue_name(key) if self.config is not None and key <= 0xFFFFFFFF \
            else None
        return format_key(key) + (f" ({name})" if name else "")

    def _say(self, verb: str, row: Mapping, decision: Decision, note: str = "") -> None:
        rule = decision.rule.name if decision.rule else "no rule matched"
        to = f" -> {self._queue(decision.to)}" if decision.to is not None else ""
        self.out(f"{verb:<14} {row.get('id')} {row.get('reason', '?'):<22} queue "
                 f"{self._queue(int(row.get('queue_key', 0)))}{to} key {row.get('message_key')} "
                 f"{row.get('message_type')} [{rule}]" + (f": {note}" if note else ""))

    def summary(self) -> str:
        parts = ", ".join(f"{key} {self.counts[key]}" for key in SUMMARY_KEYS)
        if self.dry_run:
            parts = "dry run, nothing changed: would have " + parts
        if self.stopped_by:
            parts += f" ({self.stopped_by})"
        return parts

    # -- the run -------------------------------------------------------------------------

    def run(self) -> collections.Counter:
        if self.dry_run:
            self._run()
        else:
            with lock_file(self.archive / ".state" / "rqpctl-replay.lock",
                           f"an rqpctl dlq replay of {self.archive}"):
                self._run()
        return self.counts

    def _run(self) -> None:
        held = set()  # files of a drain batch not finished: their records may still be queued
        for state in all_drain_states(self.archive).values():
            if state is not None and not state.done:
                held.update(state.files)
        for path in archive_files(self.archive):
            if self._stopping():
                break
            try:
                rows = list(read_archive_file(path))
            except ArchiveError as exc:
                self.out(f"failed         {exc}")
                self.counts["failed"] += 1
                continue
            current = _File(path, rows)
            try:
                for index, row in enumerate(rows):
                    if self._stopping():
                        break
                    self._one(current, index, row, path.name in held)
                    if len(current.removed) - current.written >= FLUSH_ROWS or (
                            len(current.removed) != current.written and
                            time.monotonic() - current.last_flush > FLUSH_SECONDS):
                        current.flush()
            finally:
                if not self.dry_run:
                    current.flush()

    def _stopping(self) -> bool:
        if self.stop.is_set():
            self.stopped_by = self.stopped_by or "stopped by a signal"
            return True
        if self.limit is not None and self.acted >= self.limit:
            self.stopped_by = f"stopped at --limit {self.limit}"
            return True
        return False

    def _one(self, current: _File, index: int, row: dict, held: bool) -> None:
        decision = decide(self.rules, row, self.now_ns)
        action = decision.action
        done, would = _VERBS[action]
        row_id = row.get("id")
        if row_id in self._seen:  # the same dead letter archived twice: one outcome for both
            if self._seen[row_id] and not held:
                self._remove(current, index)
                self.counts["discarded"] += 1
                self._say("discarded" if not self.dry_run else "would discard", row, decision,
                          "a duplicate of a row already handled")
            else:
                self.counts["kept"] += 1
            return
        if action == "keep":
            self._seen[row_id] = False
            self.counts["kept"] += 1
            if self.dry_run:
                self._say(would, row, decision)
            return
        self.acted += 1
        if held:
            self._seen[row_id] = False
            self.counts["kept"] += 1
            self._say("kept", row, decision, "its drain batch is not finished (the record may "
                      "still be on DEAD.LETTER.Q): run rqp-dlq-drain first")
            return
        if action == "discard":
            self._seen[row_id] = True
            self._remove(current, index)
            self.counts["discarded"] += 1
            self._say(done if not self.dry_run else would, row, decision)
            return
        # retry / forward
        try:
            payload = replay_payload(row, self.archive)
            extras = row_extras(row)  # the message's System V type and priority go with it
            if action == "retry":
                queue_key = int(row["queue_key"])
                if not 0 < queue_key <= 0xFFFFFFFF:
                    raise ReplayRefused(f"queue key {format_key(queue_key)} cannot name a "
                                        "System V queue: forward it to a queue instead")
                replay_key = int(row["message_key"], 16)
            else:
                queue_key, replay_key = decision.to, 0
        except (ReplayRefused, ArchiveError, KeyError, ValueError) as exc:
            self._seen[row_id] = False
            self.counts["failed"] += 1
            self._say("would fail" if self.dry_run else "failed", row, decision, str(exc))
            return
        if self.dry_run:
            self._seen[row_id] = True
            self.counts["replayed" if action == "retry" else "forwarded"] += 1
            self._say(would, row, decision)
            return
        self.bucket.take()
        try:
            self.send(queue_key, payload, replay_key, mtype=max(1, extras["mtype"]),
                      priority=min(max(extras["priority"], 0), 9))
        except RQPError as exc:
            self._seen[row_id] = False
            self.counts["failed"] += 1
            self._say("failed", row, decision, str(exc))
            if isinstance(exc, NotConfirmed):
                self.stopped_by = "stopped: the sending MCA is not taking records"
                self.stop.set()
            return
        self._seen[row_id] = True
        self._remove(current, index)
        self.counts["replayed" if action == "retry" else "forwarded"] += 1
        self._say(done, row, decision)

    def _remove(self, current: _File, index: int) -> None:
        if not self.dry_run:
            current.removed.add(index)
