"""freeze_heap / thaw_heap: the engine thaws only a freeze it started (gc.unfreeze thaws every
frozen object, and a host program or a parent that froze before forking keeps its own).
Each case runs in a fresh interpreter: the test process's own freeze state is not a clean slate."""

from __future__ import annotations

import subprocess
import sys

CASE = """
import gc
from dspark_launch.engine.heap import freeze_heap, thaw_heap
host = {host}
if host:
    gc.freeze()
before = gc.get_freeze_count()
freeze_heap()
during = gc.get_freeze_count()
junk = [[]]
junk[0].append(junk)  # a cycle created while frozen, dropped before the thaw
del junk
thaw_heap()
print(before, during, gc.get_freeze_count())
"""


def _counts(host: bool) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", CASE.format(host=host)], capture_output=True,
                         text=True, check=True).stdout
    before, during, after = (int(x) for x in out.split())
    return before, during, after


def test_thaw_undoes_the_engines_own_freeze() -> None:
    before, during, after = _counts(host=False)
    assert before == 0 and during > 0 and after == 0


def test_thaw_keeps_a_freeze_the_host_made() -> None:
    before, during, after = _counts(host=True)
    assert before > 0 and during >= before
    assert after >= before  # the host's frozen objects are still frozen
