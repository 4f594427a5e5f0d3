import os
import sys

# Tests import the helpers in this folder (multirank.py, checkpoints.py) by plain name.
sys.path.insert(0, os.path.dirname(__file__))
