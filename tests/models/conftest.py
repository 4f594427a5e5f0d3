import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls on a shared 2-core box: intra-op threads only spin against each other
    # (measured ~50x slower with the default thread count under load). Module-scoped and
    # autouse so it is in force before module fixtures build models and fork gloo worlds:
    # forking a parent with a live OpenMP pool is how fork-based worlds hang.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
