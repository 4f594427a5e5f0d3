import gc
import os
import shutil
import sys
import tempfile

import pytest
import torch

# Tests import the helpers in this folder (multirank.py, checkpoints.py) by plain name.
sys.path.insert(0, os.path.dirname(__file__))

# pytest-xdist runs one worker per core: intra-op threads on top of that only spin against
# each other (a 32-token decode went from ~4.5 s to ~0.08 s on a loaded 2-core machine), and a
# fork taken while an OpenMP pool is alive can hang the child.
torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus) -> None:
    """An in-process job that failed between freeze_heap and its engine's shutdown leaves the
    heap frozen: thaw it, so that what it froze is freed before the interpreter exits
    (triton's bindings report what is not)."""
    gc.unfreeze()
    gc.collect()


def pytest_configure(config: pytest.Config) -> None:
    """Start-up cost-curve profiles go to a per-run cache, not the user's. Set here, before the
    test modules are imported: several build their subprocesses' environment at import
    ({**os.environ, ...}), and a session fixture came too late for them (their torchrun jobs
    profiled into ~/.cache/dspark_launch while the suite loaded both cores, where later runs
    of the same topology would read those curves)."""
    os.environ["DSPARK_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark-cost-curves-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.pop("DSPARK_CACHE_DIR", ""), ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_signal_left_over():
    """A test that signals its own process (idle-engine SIGTERM tests) must not leave the
    engine's received-signal flag set for the next test in the same worker."""
    from dspark_launch import failure

    failure._received.clear()
    yield
    failure._received.clear()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """Engine-test checkpoints and prompt files (tests/jobs.py), written once per process."""
    from jobs import assets

    return assets(str(tmp_path_factory.getbasetemp() / "engine_assets"))
