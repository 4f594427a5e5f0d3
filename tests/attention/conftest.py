# Must run before any kernel module is decorated by triton.jit: with no GPU the Triton
# backend only works through the interpreter. setdefault keeps a CUDA run on real kernels.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
