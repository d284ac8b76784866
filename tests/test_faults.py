"""SURE means sure: a stream of 10,000 SURE (and 2,000 UNSURE) messages through each kind of
fault, over several random seeds. SURE: none lost, none duplicated, none out of order.
UNSURE: may be lost, never duplicated; at a graceful stop of the receiving MCA, none lost
without a dead letter. The report table is printed (pytest -s shows it).
"""

from __future__ import annotations

import os

import pytest

from tests.chaos import NOTHING_UNSEEN, SCENARIOS, Report, duplicate_bound, run

SEEDS = [int(s) for s in os.environ.get("RQP_FAULT_SEEDS", "1,2").split(",")]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sure_messages_survive(testbed, scenario, seed):
    check(run(testbed, scenario, seed))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sure_messages_survive_in_message_ex_frames(testbed, scenario):
    """The same faults with every message sent as MESSAGE_EX (mtype 2, spec section 6)."""
    check(run(testbed, scenario, SEEDS[0], mtype=2))


def check(report: Report) -> None:
    print("\n" + Report.HEADER + "\n" + report.row())
    assert len(report.faults) == 3, report.faults
    assert (report.sure_lost, report.sure_out_of_order) == (0, 0), report.row()
    assert report.sure_duplicated <= duplicate_bound(report.scenario, len(report.faults)), \
        report.row()
    assert report.sure_delivered == report.sure_sent
    assert report.unsure_duplicated == 0, report.row()
    assert report.unsure_delivered + report.unsure_lost == report.unsure_sent
    if report.scenario in NOTHING_UNSEEN:
        assert report.unsure_unseen == 0, report.row()
    assert report.wrong_mtype == 0, report.row()
