"""The decoders under generated and mutated streams (rqp.tools.fuzz): the suite runs 20,000
cases of a fixed seed every time; scripts/fuzz runs a million (issue 12)."""

from __future__ import annotations

import pytest

from rqp.tools import fuzz


def test_twenty_thousand_mutated_streams_raise_only_the_protocol_error():
    figures = fuzz.fuzz(seed=20261123, count=20_000, out=None)
    assert figures["requests"] > 5_000 and figures["answers"] > 1_000  # not all refused early
    assert figures["extended"] > figures["requests"]  # MESSAGE_EX decoded too
    assert figures["rss_after"] - figures["rss_before"] < fuzz.RSS_SLACK


def test_a_failure_names_the_case_and_how_to_reproduce_it(monkeypatch):
    def broken(data, chunks):
        raise KeyError("boom")
    monkeypatch.setattr(fuzz, "run_case", broken)
    with pytest.raises(AssertionError, match=r"case 3 of seed 5 raised KeyError.*--seed 5 "
                                             r"--start 3 --count 1"):
        fuzz.fuzz(seed=5, count=1, start=3, out=None)


def test_cases_are_reproducible():
    assert fuzz.case_stream(9, 42) == fuzz.case_stream(9, 42)
    assert fuzz.case_stream(9, 42) != fuzz.case_stream(9, 43)
