import os
import sys

import pytest
import torch

# The job helpers live beside the engine tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "engine"))

from _jobs import Assets, assets  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Assets:
    return assets(str(tmp_path_factory.getbasetemp() / "engine_assets"))
