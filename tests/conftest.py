import os
import sys

import torch

# Tests import the helpers in this folder (multirank.py, checkpoints.py) by plain name.
sys.path.insert(0, os.path.dirname(__file__))

# pytest-xdist runs one worker per core: intra-op threads on top of that only spin against
# each other (a 32-token decode went from ~4.5 s to ~0.08 s on a loaded 2-core machine), and a
# fork taken while an OpenMP pool is alive can hang the child.
torch.set_num_threads(1)
