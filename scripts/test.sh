#!/usr/bin/env bash
# Install (CPU torch from the 2.13 line, so no multi-GB CUDA build) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch>=2.4,<2.14" -e ".[test]"
ruff check .
# worksteal: the longest tests (8-rank and torchrun jobs) tend to come last; an idle worker
# takes over queued tests from a busy one instead of waiting for it.
# pytest-xdist's workers outlive a killed controller (two of them once kept both cores busy
# after a killed run), so the suite runs in a process group of its own (set -m), which ends
# with this script however it ends.
set -m
python -m pytest -n 2 --dist worksteal tests "$@" &
suite=$!
trap 'kill -TERM -- -"$suite" 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
wait "$suite"
