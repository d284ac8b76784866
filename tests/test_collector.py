"""rqp.system.service.tune_collector: what an agent does to Python's cyclic garbage collector
once it is built (each agent calls it in run_daemon). In a child process, so that this one's
collector stays as it is."""

from __future__ import annotations

import subprocess
import sys

from rqp.system.service import GC_YOUNG_THRESHOLD

TUNE = r"""
import gc, sys
gc.set_threshold(int(sys.argv[1]), 10, 10)
class Node:  # a cycle made before: collected, not frozen with the rest
    pass
a, b = Node(), Node()
a.peer, b.peer = b, a
del a, b
from rqp.system.service import tune_collector
tune_collector()
c, d = Node(), Node()  # a cycle made after: still collected, once it is garbage
c.peer, d.peer = d, c
del c, d
print(gc.get_threshold()[0], gc.get_freeze_count(), gc.collect(), gc.get_threshold()[1:])
"""


def tune(young: int) -> list[str]:
    out = subprocess.run([sys.executable, "-c", TUNE, str(young)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split(maxsplit=3)


def test_what_an_agent_made_to_start_is_frozen_and_young_collections_come_less_often():
    threshold, frozen, collected, older = tune(700)  # (Python's default)
    assert int(threshold) == GC_YOUNG_THRESHOLD == 10_000
    assert int(frozen) > 1_000  # the modules, classes and functions imported so far
    assert int(collected) >= 2  # the cycle made after it: collected, not frozen
    assert older.strip() == "(10, 10)"


def test_a_higher_threshold_already_set_is_kept():
    threshold, _, _, _ = tune(50_000)
    assert int(threshold) == 50_000
