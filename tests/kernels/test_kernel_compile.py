import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run compiles them for real")
def test_kernels_compile_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))  # a cold cache: really compile
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, str(HERE / "_compile_sm90.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("compiled") == 4, run.stdout
