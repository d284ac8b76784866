"""The agents' rate-limited log lines (rqp_agents.daemon.RateLimitedLog, SpellLog)."""

from __future__ import annotations

import logging
import re

from rqp_agents import daemon
from rqp_agents.daemon import RateLimitedLog, SpellLog


def test_the_count_held_back_is_named_for_every_line_of_the_limit(monkeypatch, caplog):
    """A trial: "connection from X closed (43 more of this kind not logged ...)" where the 43
    were first-frame time-outs, which go through the same limit. The count now names what
    the limit covers, not the kind of the line it is added to."""
    now = [100.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: now[0])
    log = logging.getLogger("rqp.test-rate-limit")
    lines = RateLimitedLog(log, interval=10.0, burst=1,
                           what="connections closed, lost or timed out")
    with caplog.at_level(logging.INFO, logger=log.name):
        lines.report("connection from %s timed out", logging.INFO, "a")
        for peer in "bcd":  # over the burst: held back, counted
            lines.report("no complete frame from %s", logging.INFO, peer)
        now[0] += 10.0  # the next interval
        lines.report("connection from %s closed", logging.INFO, "e")
    first, second = (r.getMessage() for r in caplog.records)
    assert first == "connection from a timed out"
    assert re.fullmatch(r"connection from e closed \(3 more connections closed, lost or timed "
                        r"out not logged since \d\d:\d\d:\d\d\)", second), second
    assert lines.count == 5


def test_what_is_held_back_is_said_at_exit(monkeypatch, caplog):
    """A trial stopped a receiving MCA with 22 connections: 20 'closing connection' lines, and
    the 2 held back were never counted, as no later line of that limit came."""
    now = [100.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: now[0])
    log = logging.getLogger("rqp.test-rate-limit-exit")
    lines = RateLimitedLog(log, interval=10.0, burst=1, what="connections closed")
    quiet = RateLimitedLog(log, interval=10.0, burst=1, what="nothing held")
    with caplog.at_level(logging.INFO, logger=log.name):
        quiet.report("one line", logging.INFO)
        for peer in "abc":
            lines.report("closing connection from %s: stopping", logging.WARNING, peer)
        daemon.flush_held_lines()
        daemon.flush_held_lines()  # (said once)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said[:2] == [(logging.INFO, "one line"),
                        (logging.WARNING, "closing connection from a: stopping")]
    assert len(said) == 3 and said[2][0] == logging.WARNING
    assert re.fullmatch(r"2 more connections closed not logged since \d\d:\d\d:\d\d",
                        said[2][1]), said[2][1]


def test_a_condition_that_comes_and_goes_is_said_once_a_while_and_when_it_lasts(caplog):
    """Trial 11: a full disk, freed by each delivery, logged 'the journal cannot take SURE
    records' and 'takes SURE records again' 21 times each in 22 s. Limited to one a minute,
    trial 12's log then ended with 'takes again' while the journal was full for two
    minutes. Now a short spell within the minute is counted, one that lasts is said."""
    now = [0.0]
    log = logging.getLogger("rqp.test-spells")
    spells = SpellLog(log, again=60.0, lasting=10.0, clock=lambda: now[0])

    def spell(seconds: float) -> None:  # seen full each second, then free again
        for _ in range(int(seconds)):
            spells.still("full")
            now[0] += 1.0
        spells.over("free again")

    with caplog.at_level(logging.DEBUG, logger=log.name):
        spell(2)  # said, and its end
        for _ in range(5):
            now[0] += 3.0
            spell(2)  # within the minute, short: counted, at DEBUG only
        now[0] += 3.0
        spell(30)  # lasts: said after 10 s, with the count, and its end
        now[0] += 70.0
        spell(1)  # a minute after the last line: said at once
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert said == [("ERROR", "full"), ("WARNING", "free again"),
                    ("ERROR", "full (and 5 more time(s) for a moment since the last such "
                              "line)"), ("WARNING", "free again"),
                    ("ERROR", "full"), ("WARNING", "free again")]
    spells.over("free again")  # (not in a spell: nothing)
    assert len([r for r in caplog.records if r.levelno > logging.DEBUG]) == 6


def test_a_keyed_limit_lets_each_key_be_heard_and_bounds_the_keys(monkeypatch, caplog):
    """A trial: one limit for every failed handshake let a scanner's reason hide a real
    host's. One limit per key; keys beyond the bound share one more."""
    from rqp_agents.daemon import KeyedRateLimitedLog

    now = [100.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: now[0])
    log = logging.getLogger("rqp.test-keyed")
    lines = KeyedRateLimitedLog(log, 10.0, what="of this kind", others="of other kinds",
                                keys=2)
    with caplog.at_level(logging.INFO, logger=log.name):
        for _ in range(3):
            lines.report("scan", "no certificate")
        lines.report("expired", "certificate has expired")
        lines.report("third", "a third reason")  # beyond the bound: the shared limit
        lines.report("fourth", "a fourth reason")  # held back with it
        now[0] += 10.0
        lines.report("scan", "no certificate")
        lines.report("fifth", "a fifth reason")
    got = [r.getMessage() for r in caplog.records]
    assert got[:3] == ["no certificate", "certificate has expired", "a third reason"], got
    assert re.fullmatch(r"no certificate \(2 more of this kind not logged since "
                        r"\d\d:\d\d:\d\d\)", got[3]), got
    assert re.fullmatch(r"a fifth reason \(1 more of other kinds not logged since "
                        r"\d\d:\d\d:\d\d: 1 of 'fourth'\)", got[4]), got
    assert lines.count == 8 and len(got) == 5
    # a re-check: a peer that made more reasons than places kept a new one, a real host's,
    # to the shared limit for good. Keys idle for three intervals give their places up...
    now[0] += 30.0
    with caplog.at_level(logging.INFO, logger=log.name):
        caplog.clear()
        lines.report("sixth", "a sixth reason")  # (scan and expired idle 30 s: freed)
        lines.report("seventh", "a seventh reason")
        lines.report("seventh", "a seventh reason")  # (held by its own limit)
        lines.report("eighth", "an eighth reason")  # (no place now: the shared limit...)
        lines.report("ninth", "a ninth reason")  # (...which holds this one back, named)
        got = [r.getMessage() for r in caplog.records]
        caplog.clear()
        daemon.flush_held_lines()
        held = sorted(r.getMessage() for r in caplog.records if r.name == log.name)
    assert got == ["a sixth reason", "a seventh reason", "an eighth reason"], got
    assert [re.sub(r"\d\d:\d\d:\d\d", "T", line) for line in held] == [
        "1 more of other kinds not logged since T: 1 of 'ninth'",
        "seventh: 1 more of this kind not logged since T"], held
    assert lines.count == 13
