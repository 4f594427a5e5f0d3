"""What start-up measurements leave on disk for the next run: one JSON file per machine key.

The cost curve (spec/cost_curve.py) and the CPU GEMM choice (engine/gemm_choice.py) are
measured once per machine, topology and model shape; the next run with the same key reads
them instead of measuring again, for MAX_AGE_S after they were written. `DSPARK_CACHE_DIR`
(default ~/.cache/dspark_launch) holds one directory per kind; `DSPARK_CACHE_MAX_AGE_S`
overrides the age.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from dspark_launch.errors import ConfigError

# A measurement is one moment of the machine: a shared host's load, its clocks and its
# neighbours move, and the GEMM choice that rounds 32-34 read from the cache was one noisy
# moment kept for weeks (docs/bench/HISTORY.md, round 35). Past this age a run measures again
# (a few seconds at start-up) and stores the new one.
MAX_AGE_S = 7 * 24 * 3600.0
WRITTEN_AT = "written_at"  # the stored object's time of writing (seconds since the epoch)


def max_age_s() -> float:
    """MAX_AGE_S, or DSPARK_CACHE_MAX_AGE_S where set (0: measure at every start)."""
    text = os.environ.get("DSPARK_CACHE_MAX_AGE_S")
    if text is None:
        return MAX_AGE_S
    try:
        age = float(text)
    except ValueError:
        age = -1.0
    if not age >= 0:  # (NaN too)
        raise ConfigError(f"DSPARK_CACHE_MAX_AGE_S={text!r}: expected a number of seconds, "
                          f"0 or more (0: measure at every start)")
    return age


def cache_dir(kind: str) -> Path:
    root = os.environ.get("DSPARK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dspark_launch")
    return Path(root) / kind


def device_name(device: torch.device) -> str:
    """The processor a measurement ran on, for its key: the GPU's name, or the CPU's model and
    core count (a cache directory on a shared home must not hand one CPU's timings to
    another: which GEMM wins, and by how much, is the CPU's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{os.cpu_count()}"


def cache_key(machine: dict) -> str:
    """A stable name for a measurement's conditions (machine, topology, shapes, ...)."""
    blob = json.dumps(machine, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def read_json(directory: Path, key: str) -> dict | None:
    """The stored object, or None: missing, unreadable, or written more than max_age_s() ago
    (or at no known time, or in this clock's future): measure again."""
    try:
        data = json.loads((directory / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    written = data.get(WRITTEN_AT)
    if not isinstance(written, (int, float)) or not 0 <= time.time() - written <= max_age_s():
        return None
    return data


def write_json(directory: Path, key: str, data: dict) -> Path | None:
    """Write atomically (ranks of other jobs may read concurrently); a read-only cache
    directory only costs the next run a new measurement."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{key}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**data, WRITTEN_AT: time.time()}, indent=1, default=str))
        tmp.replace(path)
        return path
    except OSError:
        return None
