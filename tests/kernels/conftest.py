# Set before anything decorates a kernel with triton.jit (it reads the flag then); under
# pytest-xdist every worker imports this conftest before collecting the test modules.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
