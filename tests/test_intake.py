"""The sending MCA's memory budget (rqp_agents.intake.Budget): how many messages it holds; the
rest wait in the kernel queue. A SIGHUP that changes the window or the hosts resizes it."""

from __future__ import annotations

from rqp.protocol.sender import HELD_AHEAD, budget_size
from rqp_agents.intake import Budget


def test_budget_size_follows_window_and_hosts():
    assert HELD_AHEAD == 64  # what the figures below assume
    assert budget_size(256, 1) == 320 and budget_size(256, 3) == 960  # the window and 64, a host
    assert budget_size(1, 1) == 65


def test_resize_keeps_what_is_held():
    budget = Budget(10)
    assert budget.take(100, timeout=0) == 10
    budget.resize(25)  # a bigger window: 15 more may be taken at once
    assert budget.take(100, timeout=0) == 15
    budget.resize(5)  # smaller than the 25 held: nothing more until 20 are given back
    budget.give(19)
    assert budget.take(1, timeout=0) == 0
    budget.give(1)
    assert budget.take(1, timeout=0) == 0  # 5 held, the new size
    budget.give(5)
    assert budget.take(100, timeout=0) == 5
