import pytest
import torch
from _jobs import Assets, assets


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls on a shared 2-core box: extra intra-op threads only contend.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Assets:
    """Checkpoints and prompt files, written once per test process."""
    return assets(str(tmp_path_factory.getbasetemp() / "engine_assets"))
