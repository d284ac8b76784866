"""What changed since the previous run: new reasons, queues whose dead-letter rate jumped,
growing hosts. Plain Python over the two runs' aggregates (no Spark): :mod:`rqp.report.compute`
collects them (this run's written tables, the previous run's ``summary.json`` and Parquet
tables) and puts :func:`compare`'s result in ``summary.json`` (``trends``) and the page.

The previous run is a previous report's output directory: the latest earlier complete run
under ``--reports DIR`` (:mod:`rqp.report.history`), or ``--previous DIR``.

Rate, defined
-------------

Each run reads the whole archive as it is then, so each run has a window: from its first to
its last dead letter (``first_seen`` .. ``last_seen``, at least one hour, so that a burst of a
few seconds is not a rate of thousands an hour). A queue's or a host's **rate** in a run is its
dead letters in that run divided by the run's window in hours: dead letters per hour over the
window. Rates, not counts, are compared because the windows differ: a report over eight days
of archive and one over nine are comparable per hour, not in total.

What this does not measure, said here rather than hidden: the archive is not only appended
to. ``rqpctl dlq replay`` removes rows it retried or discarded, and an operator may delete old
files; then a queue's count falls, and its rate may fall, without fewer failures. A rate over a
long window also moves slowly: a burst shows as a jump when it is large beside the history in
the window (it is, for the daily run of the timer over a sensibly kept archive). The counts of
both runs are shown beside every rate, so the reader can judge.

* **new reasons**: reasons with dead letters in this run and none in the previous one;
* **queues whose rate jumped**: rate at least :data:`JUMP_FACTOR` times the previous one (a
  queue absent before had rate 0) and at least :data:`MIN_CHANGE` more dead letters than
  before (so that 1 -> 3 is not a jump);
* **growing hosts**: source and destination hosts (each role on its own) whose rate grew, the
  largest growth first, with at least :data:`MIN_CHANGE` more dead letters.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["JUMP_FACTOR", "MIN_CHANGE", "TOP", "RATE_DEFINITION", "RunFacts", "window_hours",
           "compare"]

#: A queue's rate "jumped" when it is at least this many times the previous one ...
JUMP_FACTOR = 2.0
#: ... and it has at least this many more dead letters (hosts: to count as growing).
MIN_CHANGE = 10
#: Rows of each list.
TOP = 15

RATE_DEFINITION = ("dead letters per hour over each run's window (its first to its last dead "
                   "letter, at least one hour)")


@dataclass(frozen=True)
class RunFacts:
    """One run's aggregates, as :func:`compare` needs them."""

    generated_at: str | None
    first_seen: str | None
    last_seen: str | None
    dead_letters: int
    reasons: Mapping[str | None, int]
    #: queue key (hex) -> (name or None, count)
    queues: Mapping[str | None, tuple[str | None, int]]
    source_hosts: Mapping[str | None, int]
    destination_hosts: Mapping[str | None, int]
    output: str | None = None
    #: True when only the previous summary's top lists were there (no Parquet tables).
    partial: bool = False

    @classmethod
    def from_rows(cls, summary: Mapping, reasons: Iterable[Mapping], queues: Iterable[Mapping],
                  source_hosts: Iterable[Mapping], destination_hosts: Iterable[Mapping],
                  output: str | None = None, partial: bool = False) -> RunFacts:
        """From a summary (its times and total) and the rows of ``by_reason``, ``by_queue``,
        ``by_source_host`` and ``by_destination_host``."""
        return cls(
            generated_at=summary.get("generated_at"),
            first_seen=summary.get("first_seen"),
            last_seen=summary.get("last_seen"),
            dead_letters=int(summary.get("totals", {}).get("dead_letters") or 0),
            reasons={r["reason"]: int(r["count"]) for r in reasons},
            queues={q["queue_key_hex"]: (q.get("queue_name"), int(q["count"])) for q in queues},
            source_hosts={h["source"]: int(h["count"]) for h in source_hosts},
            destination_hosts={h["destination"]: int(h["count"]) for h in destination_hosts},
            output=output, partial=partial)

    @property
    def hours(self) -> float:
        return window_hours(self.first_seen, self.last_seen)


def _parse(iso: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))


def window_hours(first_seen: str | None, last_seen: str | None) -> float:
    """The hours from ``first_seen`` to ``last_seen`` (ISO strings), at least 1."""
    if not first_seen or not last_seen:
        return 1.0
    return max(1.0, (_parse(last_seen) - _parse(first_seen)).total_seconds() / 3600)


def _rate(count: int, hours: float) -> float:
    return round(count / hours, 3)


def compare(current: RunFacts, previous: RunFacts, *, jump_factor: float = JUMP_FACTOR,
            min_change: int = MIN_CHANGE, top: int = TOP) -> dict:
    """The ``trends`` of ``summary.json`` (see the module docstring)."""
    now_h, before_h = current.hours, previous.hours
    new_reasons = sorted(
        ({"reason": r, "count": n} for r, n in current.reasons.items()
         if n and not previous.reasons.get(r)),
        key=lambda r: (-r["count"], str(r["reason"])))

    jumped = []
    for key, (name, count) in current.queues.items():
        before_name, before = previous.queues.get(key, (None, 0))
        rate, before_rate = _rate(count, now_h), _rate(before, before_h)
        if count - before >= min_change and rate >= jump_factor * before_rate and rate > 0:
            jumped.append({
                "queue_key_hex": key, "queue_name": name or before_name, "count": count,
                "previous_count": before, "rate_per_hour": rate,
                "previous_rate_per_hour": before_rate,
                "factor": round(rate / before_rate, 2) if before_rate else None,
            })
    jumped.sort(key=lambda q: (-(q["rate_per_hour"] - q["previous_rate_per_hour"]),
                               str(q["queue_key_hex"])))

    growing = []
    for role, now, before in (("source", current.source_hosts, previous.source_hosts),
                              ("destination", current.destination_hosts,
                               previous.destination_hosts)):
        for host, count in now.items():
            was = before.get(host, 0)
            rate, before_rate = _rate(count, now_h), _rate(was, before_h)
            if count - was >= min_change and rate > before_rate:
                growing.append({"host": host, "role": role, "count": count,
                                "previous_count": was, "rate_per_hour": rate,
                                "previous_rate_per_hour": before_rate,
                                "growth_per_hour": round(rate - before_rate, 3)})
    growing.sort(key=lambda h: (-h["growth_per_hour"], h["role"], str(h["host"])))

    return {
        "previous": {
            "output": previous.output,
            "generated_at": previous.generated_at,
            "first_seen": previous.first_seen,
            "last_seen": previous.last_seen,
            "dead_letters": previous.dead_letters,
            "window_hours": round(before_h, 3),
            "partial": previous.partial,
        },
        "window_hours": round(now_h, 3),
        "rate_definition": RATE_DEFINITION,
        "jump_factor": jump_factor,
        "min_change": min_change,
        "dead_letters": {
            "count": current.dead_letters, "previous_count": previous.dead_letters,
            "rate_per_hour": _rate(current.dead_letters, now_h),
            "previous_rate_per_hour": _rate(previous.dead_letters, before_h),
        },
        "new_reasons": new_reasons[:top],
        "queues_jumped": jumped[:top],
        "growing_hosts": growing[:top],
    }
