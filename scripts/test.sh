#!/usr/bin/env bash
# Install (CPU torch from the 2.13 line, so no multi-GB CUDA build) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch>=2.4,<2.14" -e ".[test]"
ruff check .
# worksteal: the longest tests (8-rank and torchrun jobs) tend to come last; an idle worker
# takes over queued tests from a busy one instead of waiting for it
python -m pytest -n 2 --dist worksteal tests "$@"
