import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls on a shared 2-core box: intra-op threads only spin against each other
    # (measured ~50x slower with the default thread count under load).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
