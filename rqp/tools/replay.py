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
        action: retry                       # retry | forward | discard | keep (ignore)
        retries: 3                          # RETRY(3): at most 3 retries of this message
        interval: 30s                       # RETRYINT(30): at least 30 s apart (default 60s)
        then: discard                       # once the retries are used up (default keep)
      - reason: UNKNOWN_QUEUE
        queue: 0x52510009
        action: forward
        to: PROD_THE_SCHED_SPARE            # forward's destination: key or .rqprc name
        header: yes                         # HEADER(YES): forward the dead-letter record itself
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
              (within its de-duplication window) recognises the repeat. ``retries: N`` and
              ``interval:`` (runmqdlq's RETRY and RETRYINT) count and space the retries of
              one MESSAGE (its key: a retried message dead-lettered again comes back with the
              same key, as a new row), in the :class:`RetryLedger`; once N are used up the
              row gets ``then:`` (``keep``, the default, ``discard`` or ``forward``).
``forward``   the same to the queue ``to:``. ``header: no`` (the default): the original
              payload, with its original key (like ``retry``: the message keeps its identity).
              ``header: yes``: the payload is the dead-letter record itself (the bytes that
              were on ``DEAD.LETTER.Q``, :class:`DeadLetterRecord`), a new message with a new
              key. RQP cannot name a host: the sending MCA sends to the first host whose
              receiving MCA offers the queue (QUEUE_ASK), so "to another host" means to a queue
              only that host offers.
``discard``   remove it from the archive.
``keep``      leave it (``ignore``, runmqdlq's word, means the same).

A row leaves the archive only once its replay is confirmed (the sending MCA has journaled it)
or it is discarded: the affected archive files are rewritten atomically (new file, fsync,
rename over the old one). A replay stopped between a confirmation and the rewrite leaves rows
that a later replay sends again: with their original key for ``retry`` and ``forward`` with
``header: no`` (recognised by the receiver), with a new one for ``header: yes`` (a duplicate is
possible). A record that cannot be put back (``MALFORMED``, ``header_only``, truncated without
its spill file, too big for ``msgmax``) is refused with the reason and kept; it counts as failed.

:class:`Follower` is ``--follow``: rounds of the same, as dead letters arrive.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fnmatch
import functools
import json
import math
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from rqp import api
from rqp.config import (
    QUEUE_NAME_RE, SenderConfig, agent_queue, did_you_mean, parse_queue_key, read_yaml,
    show_value,
)
from rqp.protocol import reasons
from rqp.protocol.constants import DEFAULT_PRIORITY, INT64_MAX, SURE_MSG, UINT64_MAX
from rqp.protocol.errors import ConfigError, MessageTooBig, QueueFull, RQPError
from rqp.protocol.records import TransmissionFlags, TransmissionRecord
from rqp.protocol.sender import broadcast_queue
from rqp.report.schema import row_problem
from rqp.storage.archive import (
    MALFORMED, STATE, SUFFIX, ArchiveError, LockHeld, UnreadableLine, all_drain_states,
    archive_files, archived_spill, find_rows, is_notice, iso_utc, lock_file, no_duplicate_keys,
    read_archive_lines, rewrite_archive_file, row_extras, row_payload, row_raw_bytes,
)
from rqp.system.files import fsync_dir, write_file_atomically
from rqp.system.queues import format_key

__all__ = [
    "ACTIONS", "RULE_KEYS", "Decision", "Follower", "LedgerEntry", "ReplayRefused", "Replayer",
    "RetryLedger", "Rule", "RulesFile", "TokenBucket", "TransmissionPutter", "decide",
    "header_payload", "load_rules", "message_identity", "parse_age", "replay_payload",
    "resubmit", "rules_from_data",
]

ACTIONS = ("retry", "forward", "discard", "keep", "ignore")
#: runmqdlq's IGNORE leaves a message on the dead-letter queue: here, in the archive (keep).
SYNONYMS = {"ignore": "keep"}
#: What a retry rule does once its ``retries`` are used up.
THEN_ACTIONS = ("keep", "discard", "forward")
RULE_KEYS = ("reason", "queue", "message_type", "host", "older_than", "newer_than", "action",
             "to", "header", "retries", "interval", "then")
TOP_KEYS = ("rules",)
REASON_NAMES = tuple(r.name for r in reasons.REASONS)
MESSAGE_TYPES = ("SURE", "UNSURE", "UNKNOWN")
#: A rewrite of the file in hand at least every this many removed rows / seconds, so that a
#: replay stopped abruptly repeats little.
FLUSH_ROWS = 500
FLUSH_SECONDS = 5.0
DEFAULT_RATE = 100.0
DEFAULT_CONFIRM_TIMEOUT = 30.0
#: runmqdlq's RETRYINT default: a message is retried at most once a minute unless the rule
#: says otherwise.
DEFAULT_RETRY_INTERVAL = 60.0


# --------------------------------------------------------------------------------------------
# Rules


_AGE_RE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>ms|s|m|h|d|w)?")
_AGE_UNITS = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0,
              "w": 7 * 86400.0}
_AGE_EXPECTED = "expected a duration: seconds, or a number with ms, s, m, h, d or w (e.g. 30s, " \
                "10m, 2h, 1d)"


def names_a_host(to: object) -> str | None:
    """What is wrong with a destination that names a host (``web-7:7460``, ``q@web-7``), or
    None: forward, ``then: forward`` and ``resubmit --to`` take a queue."""
    if isinstance(to, str) and ("@" in to or ":" in to.strip().removeprefix("0x")):
        return ("expected a queue (key or .rqprc name): RQP cannot pin a host, the sending MCA "
                "sends to the first host that offers the queue (QUEUE_ASK); to reach one host, "
                "forward to a queue only that host offers")
    return None


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
    #: forward (or then: forward): the dead-letter record itself, not the original payload
    header: bool = False
    #: retry: at most this many retries of one message (None: no limit) ...
    retries: int | None = None
    #: ... at least this many seconds apart ...
    interval: float = DEFAULT_RETRY_INTERVAL
    #: ... and then this action (keep, discard, forward)
    then: str = "keep"

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
    own = functools.partial(agent_queue, config=config)
    rules = []
    for index, raw in enumerate(raw_rules):
        rules.append(_rule(check, index, raw, names, own))
    return rules


def _rule(check: _Checker, index: int, raw: object, names: Mapping[str, int] | None,
          own: Callable[[int], str | None]) -> Rule:
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
    action = SYNONYMS.get(action.strip().lower(), action.strip().lower())

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
    if action == "retry":
        if raw.get("retries") is not None:
            value = raw["retries"]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad("retries", value, "expected a whole number of retries, 1 or more (leave it "
                    "out for no limit)")
            fields["retries"] = value
        if raw.get("interval") is not None:
            try:
                fields["interval"] = parse_age(raw["interval"])
            except ValueError:
                bad("interval", raw["interval"], _AGE_EXPECTED)
        if raw.get("then") is not None:
            then = raw["then"]
            text = SYNONYMS.get(then.strip().lower(), then.strip().lower()) \
                if isinstance(then, str) else then
            if text not in THEN_ACTIONS:
                bad("then", then, "expected what to do once the retries are used up: "
                    + ", ".join(THEN_ACTIONS) + did_you_mean(then, THEN_ACTIONS))
            if "retries" not in fields:
                bad("then", then, "'then' is what happens once 'retries' are used up: give "
                    "'retries' too")
            fields["then"] = text
    else:
        for key in ("retries", "interval", "then"):
            if raw.get(key) is not None:
                bad(key, raw[key], f"{key!r} is only for action 'retry' (this rule's action "
                    f"is {action!r})")
    forwards = action == "forward" or fields.get("then") == "forward"
    if forwards:
        if raw.get("to") is None:
            what = "action 'forward'" if action == "forward" else "'then: forward'"
            check.fail(path, f"{what} needs key 'to': the queue (key or .rqprc name) to "
                       "forward to")
        to = raw["to"]
        if (problem := names_a_host(to)) is not None:
            bad("to", to, problem)
        fields["to"] = queue_key("to", to)
        if (agents := own(fields["to"])) is not None:  # (YAML's 0x5251dead is an int: hex)
            bad("to", f"{to:#x}" if type(to) is int else to,
                f"expected an application's queue: {fields['to']:#010x} is "
                f"{agents} of the agents, which no receiving MCA offers (forwarded there, a "
                "dead letter would wait for ever)")
        if raw.get("header") is not None:
            header = raw["header"]
            if isinstance(header, str) and header.strip().lower() in ("yes", "no"):
                header = header.strip().lower() == "yes"
            if not isinstance(header, bool):
                bad("header", raw["header"], "expected yes (forward the dead-letter record "
                    "itself) or no (the original payload)")
            fields["header"] = header
    else:
        for key in ("to", "header"):
            if raw.get(key) is not None:
                bad(key, raw[key], f"{key!r} is only for action 'forward' or 'then: forward' "
                    f"(this rule's action is {action!r})")
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
        return self.rule.to if self.rule and self.action == "forward" else None

    @property
    def header(self) -> bool:
        return bool(self.rule and self.rule.header)


def decide(rules: Iterable[Rule], row: Mapping, now_ns: int) -> Decision:
    """The first matching rule's action; ``keep`` when none matches."""
    for rule in rules:
        if rule.matches(row, now_ns):
            return Decision(rule.action, rule)
    return Decision("keep", None)


# --------------------------------------------------------------------------------------------
# What was done to each message before


@dataclasses.dataclass
class LedgerEntry:
    """What the handler did to one message: ``retries`` by a retry rule, the last at
    ``last_ns``; ``resent`` by forward or resubmit, the last at ``resent_ns``."""

    retries: int = 0
    last_ns: int = 0
    resent: int = 0
    resent_ns: int = 0
    #: The ``id`` of the archive row the last retry put back: that row still in the archive
    #: later means a run stopped before it left (see :meth:`Replay._retry_gate`).
    row: str = ""


def message_identity(row: Mapping) -> str:
    """The name of a MESSAGE (not of a row) in the ledger: its RQP key, which a retried,
    forwarded or resubmitted message keeps (flag ``REPLAY_KEY``), so that its dead letter, if
    it comes back, is counted with the earlier ones; a message that never had a key (0) by the
    row's ``id``."""
    key = str(row.get("message_key") or "")
    try:  # (a key that is no number names no message: a trial's 0xZZ stopped dlq show)
        if key and int(key, 16) != 0:
            return key.lower()
    except ValueError:
        pass
    return f"id:{row.get('id')}"


class RetryLedger:
    """``{archive}/.state/replay-ledger.jsonl``: per message (:func:`message_identity`), how
    often and when it was put back, so that ``retries`` and ``interval`` hold across runs,
    restarts and ``kill -9``.

    One JSON line per change, the message's entry as it now is (``{"message": "0x...",
    "retries": 2, "last_ns": ..., "resent": 0, "resent_ns": 0}``; the last line of a message
    wins), appended and fsynced BEFORE the message is put back: a kill in between costs the
    message one retry, never gives it one more than the rule allows. Appending keeps a retry's
    cost the same however many messages the ledger knows; a line a crash cut short is ignored
    (its message was not put back). Read at every round; a writer (who holds the replay lock)
    compacts it when it has more than twice the lines it needs: the entries touched within
    :data:`KEEP_DAYS` days, written to a new file, fsynced and renamed over it (a message
    dead-lettered again after that long counts from zero)."""

    NAME = "replay-ledger.jsonl"
    KEEP_DAYS = 30
    #: Lines beyond twice the entries before a compaction.
    SLACK = 1000

    def __init__(self, archive: str | os.PathLike, *, writable: bool = True,
                 now_ns: int | None = None) -> None:
        self.path = Path(archive) / STATE / self.NAME
        self.writable = writable
        self.entries: dict[str, LedgerEntry] = {}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            raise ArchiveError(f"{self.path}: cannot read the replay ledger: "
                               f"{exc.strerror or exc}") from None
        lines = 0
        #: Lines that could not be read, but one a crash cut short (its message was not put
        #: back): the retries they counted are not counted (a trial: skipped unsaid).
        self.unreadable = 0
        #: Lines cut short, as by a crash while one was written (its message was not put
        #: back then), or damaged so: said too (a trial's damaged line passed unsaid).
        self.cut_short = 0
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            lines += 1
            try:
                fields = json.loads(line, object_pairs_hook=no_duplicate_keys)  # (a key
                name = fields.pop("message")  # given twice read as the last: a re-check)
                row = fields.pop("row", "")
                if not isinstance(row, str):
                    raise ValueError("row is no string")
                if not isinstance(name, str) or "retries" not in fields or any(
                        type(v) is not int for v in fields.values()):  # (a re-check's line
                    raise ValueError("not a ledger line")  # of no count set it back to 0,
                values = fields  # and "retries": true read as 1)
                if not all(0 <= v <= INT64_MAX for v in values.values()):  # (a trial's
                    raise ValueError("out of range")  # retries -3 gave 5 retries of 2)
                self.entries[name] = LedgerEntry(**values, row=row)
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError,
                    RecursionError):  # (nested too deeply: a re-check's stopped the handler)
                # one a crash cut short is the start of a line this class writes
                if line.startswith(b'{"message":"') and not line.rstrip().endswith(b"}"):
                    self.cut_short += 1
                else:
                    self.unreadable += 1
        self._torn = bool(data) and not data.endswith(b"\n")
        if writable and lines > 2 * len(self.entries) + self.SLACK:
            self._compact(time.time_ns() if now_ns is None else now_ns)

    def get(self, row: Mapping) -> LedgerEntry:
        return self.entries.get(message_identity(row)) or LedgerEntry()

    def note(self, row: Mapping, now_ns: int, *, retry: bool) -> LedgerEntry:
        """Count one retry (or one forward/resubmit) of the row's message, durably."""
        name = message_identity(row)
        entry = self.entries.setdefault(name, LedgerEntry())
        if retry:
            entry.retries += 1
            entry.last_ns = now_ns
            entry.row = str(row.get("id") or "")
        else:
            entry.resent += 1
            entry.resent_ns = now_ns
        if self.writable:
            self._append(name, entry)
        return entry

    @staticmethod
    def _line(name: str, entry: LedgerEntry) -> bytes:
        return (json.dumps({"message": name, **dataclasses.asdict(entry)},
                           separators=(",", ":")) + "\n").encode()

    def _append(self, name: str, entry: LedgerEntry) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (b"\n" if self._torn else b"") + self._line(name, entry))
            os.fsync(fd)
        finally:
            os.close(fd)
        self._torn = False
        if new:
            fsync_dir(self.path.parent)

    def _compact(self, now_ns: int) -> None:
        horizon = now_ns - self.KEEP_DAYS * 86400 * 10**9
        self.entries = {name: e for name, e in self.entries.items()
                        if max(e.last_ns, e.resent_ns) >= horizon}
        write_file_atomically(self.path, b"".join(self._line(name, e)
                                                  for name, e in self.entries.items()))
        self._torn = False


# --------------------------------------------------------------------------------------------
# Putting messages back


class ReplayRefused(RQPError):
    """This record cannot be put back (the message says why); it is kept in the archive."""


def check_destination(row: Mapping, queue_key: int, config: SenderConfig | None,
                      instead: str) -> None:
    """:class:`ReplayRefused` unless ``row`` may be put back on ``queue_key``: a System V key,
    none of the agents' own queues (no receiving MCA offers them: a trial's row for
    ``DEAD.LETTER.Q`` left the archive and waited for ever), no broadcast copy
    (:func:`refuse_broadcast_copy`). ``instead``: what to do then (a rule's or ``--to``)."""
    if not 0 < queue_key <= 0xFFFFFFFF:
        raise ReplayRefused(f"queue key {format_key(queue_key)} cannot name a System V queue: "
                            f"{instead}")
    if (agents := agent_queue(queue_key, config)) is not None:
        raise ReplayRefused(f"queue {format_key(queue_key)} is {agents} of the agents, not a "
                            f"destination (no receiving MCA offers it): {instead}")
    refuse_broadcast_copy(row, queue_key, config)


def refuse_broadcast_copy(row: Mapping, queue_key: int, config: SenderConfig | None) -> None:
    """A dead letter whose queue key is a broadcast name of this host's ``.rqprc`` (or whose
    sending MCA's detail says so) and that names a destination host is one host's copy: put
    back on that key, the sending MCA sends it to every host of the name, each with a new
    key, and each that has it puts it again (a trial: once more on each). RQP cannot pin a
    host; the operator looks on that one, then forwards or discards it."""
    host = row.get("destination_host")
    if not host:  # (a broadcast message that reached no host: to every host, as it should)
        return
    named = config is not None and queue_key in config.broadcast_keys
    if not named and not (row.get("agent") == "sender" and broadcast_queue(queue_key)
                          in (row.get("detail") or "")):  # (a .rqprc without the name)
        return
    raise ReplayRefused(
        f"a copy for {host} of broadcast queue {format_key(queue_key)}: put back on that "
        "queue it would go to every host of the broadcast name with new keys, and each that "
        f"has it would put it again; look on {host}, then forward it to a queue (a rule's "
        "to:, --to QUEUE) or discard it")


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


def header_payload(row: Mapping) -> bytes:
    """HEADER(YES): the dead-letter record itself, the bytes that were on ``DEAD.LETTER.Q``
    (:class:`DeadLetterRecord`, reason, hosts, key and the payload it kept), or
    :class:`ReplayRefused`."""
    if row.get("reason") == MALFORMED:
        raise ReplayRefused("a MALFORMED record is not a dead-letter record: it cannot be "
                            "forwarded with header: yes (discard or keep it)")
    try:
        return row_raw_bytes(row)
    except ArchiveError as exc:
        raise ReplayRefused(str(exc)) from None


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

    def wait_time(self) -> float:
        """Seconds until the next take would return."""
        self._refill()
        return max(0.0, (1.0 - self.tokens) / self.rate)

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


def held_files(archive: Path) -> set[str]:
    """The files of a drain batch not finished: their records may still be on the queue, and
    the drain recognises them by the ids in these files, so none of their rows may leave."""
    held = set()
    for state in all_drain_states(archive).values():
        if state is not None and not state.done:
            held.update(state.files)
    return held


HELD = "its drain batch is not finished (the record may still be on DEAD.LETTER.Q): run " \
       "rqp-dlq-drain first"


def replay_lock(archive: Path, wait: float = 0.0):
    """The lock every command that rewrites archive files holds (replay, resubmit): two
    rewrites of one file at once would lose one's removals. ``--follow`` holds it for a
    round at a time, so that a resubmit (which waits ``wait`` seconds for it) gets in
    between."""
    return lock_file(archive / STATE / "rqpctl-replay.lock",
                     f"an rqpctl dlq replay or resubmit of {archive}", wait=wait)


class Replayer:
    """Applies rules to every row of an archive directory (see the module doc).

    ``send(queue_key, payload, replay_key)`` puts one message back and returns once it is
    confirmed (a :class:`TransmissionPutter`); it is needed unless ``dry_run``. If it has a
    ``ready()`` that gives a reason, nothing is put (nor a retry counted): as if not confirmed. ``out`` gets
    one line per record acted on (every record in a dry run) and the summary. ``clock``
    (Unix ns; default the wall clock, or ``now_ns`` if given) is what ``older_than`` and the
    retry ``interval`` are measured with. ``follow``: rounds for :class:`Follower` (a row's
    line is said once, not every round; a sending MCA that takes nothing pauses the round
    instead of stopping).
    """

    def __init__(self, archive: str | os.PathLike, rules: list[Rule], *,
                 send: Callable[..., None] | None = None, dry_run: bool = False,
                 rate: float = DEFAULT_RATE, limit: int | None = None,
                 config: SenderConfig | None = None, out: Callable[[str], None] = print,
                 now_ns: int | None = None, stop: threading.Event | None = None,
                 bucket: TokenBucket | None = None, clock: Callable[[], int] | None = None,
                 follow: bool = False) -> None:
        self.archive = Path(archive)
        self.rules = rules
        self.send = send
        self.dry_run = dry_run
        self.limit = limit
        self.config = config
        self.out = out
        self.clock = clock or ((lambda: now_ns) if now_ns is not None else time.time_ns)
        self.now_ns = self.clock()
        self.stop = stop or threading.Event()
        self.bucket = bucket or TokenBucket(rate)
        self.ledger: RetryLedger | None = None
        self.follow = follow
        self.counts: collections.Counter = collections.Counter()
        self.acted = 0
        self.stopped_by: str | None = None
        self.paused = False  # (follow) the sending MCA took nothing: this round ends
        #: (follow) Whether to end the round after the record in hand (a SIGHUP: the rules
        #: are read again before the next; a re-check's round of 10,000 rows ran 100 s on).
        self.interrupt: Callable[[], bool] | None = None
        self.next_due_ns: int | None = None  # the earliest retry that waits for its interval
        self._seen: dict[str, bool] = {}  # id -> removed from the archive
        self._told: dict[str, str] = {}  # (follow) id -> the verb last said about it
        self._again: str | None = None  # the row _retry_gate let be put back uncounted
        if not dry_run and send is None and any(
                r.action in ("retry", "forward") or r.then == "forward" for r in rules):
            raise ValueError("a Replayer that retries or forwards needs send=")

    # -- output --------------------------------------------------------------------------

    def _queue(self, key: int) -> str:
        name = self.config.queue_name(key) if self.config is not None and key <= 0xFFFFFFFF \
            else None
        return format_key(key) + (f" ({name})" if name else "")

    def _say(self, verb: str, row: Mapping, decision: Decision | None, note: str = "",
             told: str | None = None) -> None:
        """One line of what was done with ``row`` (``decision`` None: it fits no rule's
        reading, being no archive line, and says so in ``note``); ``told``: what names it
        between rounds (else its id)."""
        if self.follow:
            told = told or row.get("id")
            if self._told.get(told) == verb:
                return  # said in an earlier round
            self._told[told] = verb
        if decision is None:  # (a line with no id: "-", a trial's said "None")
            shown = row.get("id")
            self.out(f"{verb:<14} {'-' if shown is None else shown!s:.40} {note}")
            return
        rule = decision.rule.name if decision.rule else "no rule matched"
        to = f" -> {self._queue(decision.to)}" if decision.to is not None else ""
        self.out(f"{verb:<14} {row.get('id')} {row.get('reason', '?'):<22} queue "
                 f"{self._queue(int(row.get('queue_key', 0)))}{to} key {row.get('message_key')} "
                 f"{row.get('message_type')} [{rule}]" + (f": {note}" if note else ""))

    def summary(self) -> str:
        return summary_line(self.counts, dry_run=self.dry_run, stopped_by=self.stopped_by)

    # -- the run -------------------------------------------------------------------------

    def locked(self):
        """The replay lock (nothing for a dry run, which changes nothing)."""
        return contextlib.nullcontext() if self.dry_run else replay_lock(self.archive)

    def run(self) -> collections.Counter:
        with self.locked():
            self.run_round()
        return self.counts

    def run_round(self) -> collections.Counter:
        """Every row once (the lock held by the caller); ``counts`` are this round's. The
        ledger is read again: a resubmit may have run between two rounds."""
        self.now_ns = self.clock()
        self.ledger = RetryLedger(self.archive, writable=not self.dry_run, now_ns=self.now_ns)
        ledger = self.ledger
        bad = (ledger.unreadable, ledger.cut_short)
        if any(bad) and self._told.get("\0ledger") != bad:
            self._told["\0ledger"] = bad  # (--follow: once, until it changes)
            if ledger.unreadable:
                self.out(f"warning        {ledger.path}: {ledger.unreadable} line(s) cannot be "
                         "read: the retries and forwards they counted are not counted")
            if ledger.cut_short:
                self.out(f"warning        {ledger.path}: {ledger.cut_short} line(s) cut short, "
                         "as by a replay killed while it wrote one (its message was not put "
                         "back then): not counted")
        self.counts = collections.Counter()
        self._seen = {}
        self.paused = False
        self.next_due_ns = None
        self._run()
        if self.follow and not self.paused and not self.stop.is_set() and not (
                self.interrupt is not None and self.interrupt()):  # what is still there
            self._told = {key: verb for key, verb in self._told.items()
                          if key in self._seen or key.endswith(SUFFIX) or key == "\0ledger"}
        return self.counts

    def _run(self) -> None:
        held = held_files(self.archive)
        for path in archive_files(self.archive):
            if self._stopping():
                break
            try:
                rows = list(read_archive_lines(path))
            except ArchiveError as exc:
                if not self.follow or self._told.get(path.name) != "failed":
                    self.out(f"failed         {exc}")
                    self._told[path.name] = "failed"
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
        if self.paused or (self.interrupt is not None and self.interrupt()):
            return True
        if self.stop.is_set():
            self.stopped_by = self.stopped_by or "stopped by a signal"
            return True
        if self.limit is not None and self.acted >= self.limit:
            self.stopped_by = f"stopped at --limit {self.limit}"
            return True
        return False

    def _retry_gate(self, row: Mapping, decision: Decision) -> tuple[Decision, str]:
        """A retry rule's decision for this message given its ledger entry: the retry, a
        wait for the interval (action ``wait``), or, its retries used up, the rule's
        ``then``; with a note that says which."""
        rule = decision.rule
        entry = self.ledger.get(row)
        of = f" of {rule.retries}" if rule.retries is not None else ""
        if entry.retries and entry.row and entry.row == row.get("id"):
            # This very row was put back, and a run stopped before it left the archive (a
            # trial: killed after the confirmations, its 84 delivered rows stayed, counted as
            # retried, and got their 'then: keep'). Sent again with its key, not counted:
            # recognised where it arrived, and delivered where it did not.
            self._again = row.get("id")
            return decision, (
                f"retry {entry.retries}{of} again: put back at {iso_utc(entry.last_ns)} by a "
                "run that stopped before its row left the archive (with its key: recognised "
                "if it arrived)")
        if rule.retries is not None and entry.retries >= rule.retries:
            return Decision(rule.then, rule), (
                f"its retries are used up ({entry.retries}{of}, the last at "
                f"{iso_utc(entry.last_ns)}): {rule.then}")
        due = entry.last_ns + int(rule.interval * 1e9) if entry.retries else 0
        if due > self.now_ns:
            self.next_due_ns = due if self.next_due_ns is None else min(self.next_due_ns, due)
            return Decision("wait", rule), (
                f"retry {entry.retries + 1}{of} not before {iso_utc(due)} (interval "
                f"{rule.interval:g}s)")
        return decision, f"retry {entry.retries + 1}{of}"

    def _forward_gate(self, row: Mapping, decision: Decision) -> tuple[Decision, str]:
        """A message forwarded with its key is forwarded once: dead-lettered again after that
        (its row is newer than the forward), a rule that matches it again would send it round
        for ever (under ``--follow`` at every round); it is kept, saying so."""
        entry = self.ledger.get(row)
        if entry.resent and int(row.get("timestamp_ns") or 0) > entry.resent_ns:
            return Decision("keep", decision.rule), (
                f"it was forwarded (or resubmitted) at {iso_utc(entry.resent_ns)} and "
                "dead-lettered again: kept, not forwarded round again (rqpctl dlq resubmit "
                "puts it back by hand)")
        return decision, ""

    def _one(self, current: _File, index: int, row: dict | UnreadableLine, held: bool) -> None:
        # (its line in the file: "row N" counted no blank lines, a trial)
        place = f"line {getattr(row, 'number', None) or index + 1}"
        raw = getattr(row, "raw", b"")
        if isinstance(row, UnreadableLine):  # (not even JSON: kept as it is, the others go on)
            problem, row = row.problem, {}
        else:
            problem = row_problem(row)
        if problem is not None:  # (no rule can be read against it: kept, the others go on)
            # (named by its bytes: its id may be none, or no string, and its place moves when
            # a round rewrites the file, which said it again, a trial)
            where = f"\0{current.path.name}:{zlib.crc32(raw)}"
            self._seen[where] = False
            self.counts["failed"] += 1
            self._say("would fail" if self.dry_run else "failed", row, None,
                      f"{current.path}: {place} is no dead-letter archive line: "
                      f"{problem}; kept in the archive", told=where)
            return
        decision = decide(self.rules, row, self.now_ns)
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
        note = ""
        if decision.action in ("retry", "forward") and not decision.header and is_notice(row):
            decision, note = Decision("keep", decision.rule), NOTICE_KEPT
        elif decision.action == "retry":
            decision, note = self._retry_gate(row, decision)
        elif decision.action == "forward" and not decision.header:
            decision, note = self._forward_gate(row, decision)
        action = decision.action
        if action in ("keep", "wait"):
            self._seen[row_id] = False
            self.counts["kept"] += 1
            if action == "wait":
                self._say("waiting" if not self.dry_run else "would wait", row, decision, note)
            elif note:  # its retries are used up, or it was forwarded once already
                self._say("kept" if not self.dry_run else "would keep", row, decision, note)
            elif self.dry_run:
                self._say(_VERBS["keep"][1], row, decision)
            return
        done, would = _VERBS[action]
        self.acted += 1
        if held:
            self._seen[row_id] = False
            self.counts["kept"] += 1
            self._say("kept", row, decision, HELD)
            return
        if action == "discard":
            self._seen[row_id] = True
            self._remove(current, index)
            self.counts["discarded"] += 1
            self._say(done if not self.dry_run else would, row, decision, note)
            return
        # retry / forward
        try:
            extras = row_extras(row)  # the message's System V type and priority go with it
            mtype, priority = max(1, extras["mtype"]), min(max(extras["priority"], 0), 9)
            if action == "retry":
                payload = replay_payload(row, self.archive)
                queue_key = int(row["queue_key"])
                check_destination(row, queue_key, self.config,
                                  "forward it to an application's queue instead")
                replay_key = int(row["message_key"], 16)
            elif decision.header:  # a new message: the dead letter, with type 1
                payload, queue_key, replay_key, mtype = header_payload(row), decision.to, 0, 1
            else:  # the message, with its key: forwarded, it is still the same message
                payload = replay_payload(row, self.archive)
                queue_key, replay_key = decision.to, int(row["message_key"], 16)
        except (ReplayRefused, ArchiveError, KeyError, ValueError) as exc:
            self._seen[row_id] = False
            self.counts["failed"] += 1
            where = "" if isinstance(exc, ReplayRefused) else \
                f"{current.path}: line {getattr(row, 'number', None) or index + 1}: "
            self._say("would fail" if self.dry_run else "failed", row, decision,
                      where + str(exc))  # (a bad payload named only its row's id: a trial)
            return
        if self.dry_run:
            self._seen[row_id] = True
            self.counts["replayed" if action == "retry" else "forwarded"] += 1
            self._say(would, row, decision, note)
            return
        try:
            ready = getattr(self.send, "ready", None)  # (a sending MCA to take it, at all?)
            if ready is not None and (problem := ready()):
                raise NotConfirmed(problem)
            if action == "retry" and self._again != row_id:  # counted before it is sent:
                # never one retry too many (a row put back again, see _retry_gate: not twice)
                at = self.clock() + int(self.bucket.wait_time() * 1e9)  # (when take lets it go)
                self.ledger.note(row, at, retry=True)
            self.bucket.take()  # (after the fsync of the note: the rate holds for the sends)
            self.send(queue_key, payload, replay_key, mtype=mtype, priority=priority)
        except (RQPError, ValueError) as exc:  # (ValueError: a record no check above foresaw:
            self._seen[row_id] = False  # it fails alone, as a trial's --follow did not)
            if isinstance(exc, NotConfirmed) and self.follow:
                # nothing failed: the row stays, and is put back once a sending MCA runs
                self.paused = True
                self.counts["kept"] += 1
                self._say("waiting", row, decision, f"{exc}; kept until one runs")
                return
            self.counts["failed"] += 1
            if isinstance(exc, MessageTooBig) and decision.header:
                exc = RQPError(f"{exc}; the record with its header is {len(payload)} bytes: "
                               "forward it with header: no")
            if isinstance(exc, NotConfirmed) and self.follow:
                self.paused = True
            self._say("failed", row, decision, str(exc))
            if isinstance(exc, NotConfirmed) and not self.follow:
                self.stopped_by = "stopped: the sending MCA is not taking records"
                self.stop.set()
            return
        if action == "forward":
            self.ledger.note(row, self.clock(), retry=False)
        self._seen[row_id] = True
        self._remove(current, index)
        self.counts["replayed" if action == "retry" else "forwarded"] += 1
        self._say(done, row, decision, note)

    def _remove(self, current: _File, index: int) -> None:
        if not self.dry_run:
            current.removed.add(index)


NOTICE_KEPT = ("a notice: the sending MCA of the source host keeps this SURE message and "
               "sends it again itself (or dead-letters it there when its retry budget runs "
               "out); put back from here it would arrive twice (rqpctl dlq resubmit --notices "
               "ID puts it back by hand, if its sender is gone for good)")
#: Why resubmit refuses a notice unless told (a trial's resubmit put one on a second host).
NOTICE_REFUSED = ("a notice: the sending MCA of the source host keeps this SURE message and "
                  "sends it again itself; resubmitted, it would arrive twice. Give --notices "
                  "only if that sender is gone for good (its state_dir lost)")


def summary_line(counts: Mapping[str, int], *, dry_run: bool = False,
                 stopped_by: str | None = None) -> str:
    parts = ", ".join(f"{key} {counts.get(key, 0)}" for key in SUMMARY_KEYS)
    if dry_run:
        parts = "dry run, nothing changed: would have " + parts
    if stopped_by:
        parts += f" ({stopped_by})"
    return parts


# --------------------------------------------------------------------------------------------
# Following the archive as dead letters arrive


#: --follow's waits between rounds with nothing to do: from MIN_POLL, doubling, up to --poll.
MIN_POLL = 0.1
DEFAULT_POLL = 5.0


class Follower:
    """``rqpctl dlq replay --follow`` (runmqdlq's WAIT(YES)): the replay in rounds, until
    ``stop``.

    Each round runs ``drain()`` first when ``pending()`` says ``DEAD.LETTER.Q`` holds records
    (``--drain``: ``rqp-dlq-drain --once`` into the archive, so that a dead letter is handled
    without anything else running), then applies the rules to every row. Between rounds it
    waits on what can bring work, checked at a poll interval that starts at
    :data:`MIN_POLL` and doubles up to ``poll`` while nothing happens: a file of the archive
    (or a drain state) changed, ``pending()``, or the earliest retry whose ``interval`` has
    passed. A drain that failed (``drain()`` returned False: another drain holds the lock, a
    problem it has said) is tried again every ``poll`` seconds, not whenever ``pending()``.
    A sending MCA that takes nothing pauses the rounds for ``poll`` seconds. Nothing is
    retried in a tight loop: a message waits its rule's interval between retries, whatever
    the rounds do. The replay lock is held for a round at a time (and the ledger read again
    for each), so that ``rqpctl dlq resubmit`` can run in between.
    """

    def __init__(self, replayer: Replayer, *, drain: Callable[[], bool | None] | None = None,
                 pending: Callable[[], bool] | None = None, poll: float = DEFAULT_POLL,
                 out: Callable[[str], None] = print,
                 wait: Callable[[float], bool] | None = None,
                 rules: RulesFile | None = None) -> None:
        self.replayer = replayer
        self.drain = drain
        self.pending = pending
        self.rules = rules
        self.poll = max(poll, MIN_POLL)
        self.out = out
        self.stop = replayer.stop
        self.wait = wait or self._wait_or_reload  # (True: stopped)
        self.totals: collections.Counter = collections.Counter()
        self.rounds = 0
        self.drain_failed = False

    def _wait_or_reload(self, seconds: float) -> bool:
        """Wait ``seconds``, or until stopped (True) or asked to read the rules again (a
        SIGHUP, which the stop event does not wake: a re-check's reload came 11 s late)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.stop.wait(min(left, RELOAD_LOOK)):
                return True
            if self.rules is not None and self.rules.changed():
                return False
        return self.stop.is_set()

    def summary(self) -> str:
        """What was done over all rounds; kept and failed as the last round left them."""
        return summary_line(self.totals, dry_run=self.replayer.dry_run,
                            stopped_by=self.replayer.stopped_by)

    def run(self) -> collections.Counter:
        was_paused, other = False, None
        if self.rules is not None:  # (a round stops at a SIGHUP, after the record in hand)
            self.replayer.interrupt = self.rules.changed
        while not self.stop.is_set():
            if self.rules is not None:
                if self.rules.changed():
                    if (rules := self.rules.load(self.out)) is not None:
                        self.replayer.rules = rules
                else:
                    self.rules.edited(self.out)
            if self.drain is not None:
                pending = self.pending is None or self.pending()
                self.drain_failed = pending and self.drain() is False
            before = self._signature()  # (after our drain: its files are the round's)
            try:
                with self.replayer.locked():
                    counts = self.replayer.run_round()
            except LockHeld as exc:  # (a replay or resubmit by hand: a trial's handler
                if other is None:  # exited 1 at once, and its unit would give up)
                    self.out(f"waiting        {exc}: trying again every {self.poll:g}s")
                other = exc
                self.wait(self.poll)
                continue
            if other is not None:
                self.out("resumed        the other replay has ended")
                other = None
            self.rounds += 1
            for key in ("replayed", "forwarded", "discarded"):
                self.totals[key] += counts[key]
            for key in ("kept", "failed"):
                self.totals[key] = counts[key]
            if self.replayer.stopped_by and not self.stop.is_set():
                break  # --limit
            if self.replayer.paused and not was_paused:  # (said once, not every --poll)
                self.out(f"paused         the sending MCA is not taking records: trying "
                         f"again every {self.poll:g}s")
            elif was_paused and not self.replayer.paused:
                self.out("resumed        the sending MCA takes records again")
            was_paused = self.replayer.paused
            self._wait(before)
        if self.stop.is_set():
            self.replayer.stopped_by = self.replayer.stopped_by or "stopped by a signal"
        return self.totals

    def _signature(self) -> tuple:
        """What the archive looks like: its files and the drain states (a batch finished
        releases the rows it held)."""
        paths = archive_files(self.replayer.archive)
        state = self.replayer.archive / STATE
        if state.is_dir():
            paths += sorted(state.glob("*.last"))
        out = []
        for path in paths:
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            out.append((path.name, st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _wait(self, before: tuple) -> None:
        """Until something may bring work; ``before``: the archive's signature before the
        round just run."""
        if self.rules is not None and self.rules.changed():  # (a SIGHUP ended the round)
            return
        if self.replayer.paused:
            self.wait(self.poll)
            return
        seen = self._signature()
        if _changed_beside(before, seen):
            return  # (a file written while the round ran, after it listed the archive: a
            # trial's shared archive kept another host's dead letter unhandled, as nothing
            # changed after it)
        delay = MIN_POLL
        while True:
            timeout = delay
            due = self.replayer.next_due_ns
            if due is not None:
                timeout = min(timeout, max(0.0, (due - self.replayer.clock()) / 1e9))
            if self.wait(timeout):
                return
            if due is not None and self.replayer.clock() >= due:
                return
            if self.pending is not None and self.drain is not None and (
                    delay >= self.poll if self.drain_failed else self.pending()):
                return
            if self._signature() != seen:
                return
            if self.rules is not None:
                if self.rules.changed():  # (SIGHUP)
                    return
                self.rules.edited(self.out)  # (said while idle too, once)
            delay = min(delay * 2, self.poll)


#: How often a --follow that waits looks whether a SIGHUP asked for its rules (seconds).
RELOAD_LOOK = 0.1


class RulesFile:
    """The rules file of a ``--follow``, read again on SIGHUP (:meth:`request`, ``systemctl
    reload``): a trial's handler went on applying the rules it started with, and a SIGHUP
    ended it without a word. Only when asked: a re-check's file read as it changed, half
    written, was a valid file that discarded every row. A file changed since it was read is
    said once (:meth:`edited`); one with a mistake is said, and the rules it had are kept."""

    def __init__(self, path: str | os.PathLike, config: SenderConfig | None,
                 check: Callable[[list[Rule]], None] | None = None,
                 requested: threading.Event | None = None) -> None:
        """``requested``: the event a SIGHUP sets (one set before: read again at once)."""
        self.path, self.config, self.check = Path(path), config, check
        self._requested = requested or threading.Event()
        self._seen = self._signature()
        self._edit_said = False

    def _signature(self) -> tuple | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns

    def request(self) -> None:
        """Read it again before the next record (SIGHUP; safe in a signal handler)."""
        self._requested.set()

    def changed(self) -> bool:
        """Whether it is to be read again (asked, and not yet read)."""
        return self._requested.is_set()

    def edited(self, out: Callable[[str], None]) -> None:
        """Say once that the file changed since it was read and is not applied yet (once
        until the next reload, however many writes: a re-check's slow write said it 3 times)."""
        if not self._edit_said and self._signature() != self._seen:
            self._edit_said = True
            out(f"rules changed  {self.path} changed since it was read; not applied until "
                "SIGHUP (systemctl reload rqp-dlq-handler.service)")

    def load(self, out: Callable[[str], None]) -> list[Rule] | None:
        """The rules as the file says them now, or None (said why) to keep the old ones."""
        self._requested.clear()
        self._seen, self._edit_said = self._signature(), False
        try:
            rules = load_rules(self.path, config=self.config)
            if self.check is not None:
                self.check(rules)
        except (ConfigError, OSError) as exc:
            out(f"not reloaded   {exc}; still applying the rules it had")
            return None
        out(f"reloaded       {self.path} ({len(rules)} rule(s))")
        return rules


def _changed_beside(before: tuple, after: tuple) -> bool:
    """Whether an archive's signature ``after`` a round shows what the round did not do itself:
    a file that was not there ``before`` it (another host's drain, a resubmit cannot: the round
    holds the lock), or a drain state changed. The round only rewrites or removes the archive
    files it listed."""
    old = {entry[0]: entry for entry in before}
    return any(entry[0] not in old or (not entry[0].endswith(SUFFIX) and old[entry[0]] != entry)
               for entry in after)


# --------------------------------------------------------------------------------------------
# One-off repair


#: How long ``rqpctl dlq resubmit`` waits for a replay's round to finish (``--follow`` holds
#: the lock a round at a time).
RESUBMIT_LOCK_WAIT = 60.0


def resubmit(archive: str | os.PathLike, ids: list[str], send: Callable[..., None], *,
             to: int | None = None, edit: Callable[[Mapping, bytes], bytes] | None = None,
             config: SenderConfig | None = None, out: Callable[[str], None] = print,
             clock: Callable[[], int] = time.time_ns,
             notices: bool = False) -> collections.Counter:
    """``rqpctl dlq resubmit``: put these dead letters back (on their queue, or ``to``), each
    as ``retry`` does (SURE, confirmed, with its original key), ``edit(row, payload)`` giving
    the payload to send (Azure Service Bus Explorer's repair and resubmit). Every copy of a row
    leaves the archive once its message is confirmed. A row that cannot be put back (or
    whose edit is refused: :class:`ReplayRefused`) is kept and counts as failed; the others
    go on. Edits are made before the replay lock is taken, then the rows are looked up again
    (one that a ``--follow`` round handled meanwhile is said to be gone). A notice
    (:func:`is_notice`) is refused unless ``notices``: its sender sends it again itself."""
    archive = Path(archive)
    counts: collections.Counter = collections.Counter()
    say = Replayer(archive, [], dry_run=True, config=config, out=out)._queue
    payloads: dict[str, bytes] = {}
    handled: set[str] = set()  # (two prefixes of one id: it is sent once)
    for given, places in find_rows(archive, ids).items():
        path, index, row = places[0]
        if row["id"] in handled:
            continue
        handled.add(row["id"])
        try:
            problem = row_problem(row)  # (as replay reads it: a trial's priority 10 was sent)
            if problem is not None:
                raise ReplayRefused(f"{path}: line {getattr(row, 'number', index + 1)} is no "
                                    f"dead-letter archive line: {problem}")
            if is_notice(row) and not notices:
                raise ReplayRefused(NOTICE_REFUSED)
            payload = replay_payload(row, archive)
            payloads[given] = edit(row, payload) if edit is not None else payload
        except (ReplayRefused, ArchiveError) as exc:
            counts["failed"] += 1
            out(f"failed         {row['id']}: {exc}")
    if not payloads:
        return counts
    with replay_lock(archive, wait=RESUBMIT_LOCK_WAIT):
        ledger = RetryLedger(archive)
        try:
            found = find_rows(archive, list(payloads))
        except ArchiveError as exc:
            raise ArchiveError(f"{exc} (handled meanwhile by a replay?): nothing resubmitted") \
                from None
        files: dict[Path, _File] = {}
        held = held_files(archive)
        for given, payload in payloads.items():
            places = found[given]
            row = places[0][2]
            queue_key = int(row["queue_key"]) if to is None else to
            try:
                if any(path.name in held for path, _, _ in places):
                    raise ReplayRefused(HELD)
                check_destination(row, queue_key, config, "give --to QUEUE")
                extras = row_extras(row)
                send(queue_key, payload, int(row["message_key"], 16),
                     mtype=max(1, extras["mtype"]), priority=min(max(extras["priority"], 0), 9))
            except (ReplayRefused, RQPError, KeyError, ValueError) as exc:
                counts["failed"] += 1
                out(f"failed         {row['id']}: {exc}")
                if isinstance(exc, NotConfirmed):
                    break
                continue
            for path, index, _ in places:
                if path not in files:
                    files[path] = _File(path, list(read_archive_lines(path)))  # (its bad
                    # lines are kept as they are)
                files[path].removed.add(index)
            ledger.note(row, clock(), retry=False)
            counts["resubmitted"] += 1
            edited = " (edited)" if edit is not None else ""
            out(f"resubmitted    {row['id']} queue {say(queue_key)} key {row['message_key']}"
                f"{edited}: {len(payload)} bytes")
        for current in files.values():
            current.flush()
    return counts
