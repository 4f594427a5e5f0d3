"""Never a hung job: signals become an agreed stop, a broken collective becomes a named failure.

- SIGINT / SIGTERM only set a flag. The engine exchanges the flag with every rank at each step
  boundary (inside the step's all-gather), so all ranks stop after the same step, write what
  finished, destroy their groups and exit 130 / 143.
- A collective that fails (a peer died: its sockets closed; or --dist-timeout expired: a peer
  is stuck) is answered with a roll call through the rendezvous store, which outlives any worker,
  so the lowest surviving rank can name the ranks that did not answer and the step they were in.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch.distributed as dist

from dspark_launch.errors import LaunchError

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(LaunchError):
    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}; completed requests "
                         f"are in the output")
        self.exit_code = EXIT_CODES.get(signum, 1)


@dataclass
class Progress:
    phase: str = "startup"
    step: int = 0

    def where(self) -> str:
        return f"step {self.step}" if self.phase == "decode" else self.phase


progress = Progress()
_received: list[int] = []


def _on_signal(signum: int, _frame) -> None:
    if _received:  # a second signal: stop waiting for the step boundary
        raise KeyboardInterrupt
    _received.append(signum)


def install_signal_handlers() -> None:
    _received.clear()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


def received_signal() -> int:
    """The first stop signal received (0 if none)."""
    return _received[0] if _received else 0


def roll_call(rank: int, world_size: int, wait_s: float = 3.0) -> list[int]:
    """Ranks that do not check in through the store within wait_s (dead or stuck)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store left to ask
        return []
    key = f"dspark/alive/{progress.phase}/{progress.step}"
    try:
        store.set(f"{key}/{rank}", "1")
        deadline = time.monotonic() + wait_s
        missing = list(range(world_size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{key}/{r}"])]
            time.sleep(0.1)
        return missing
    except Exception:  # noqa: BLE001 - the store itself is gone: nothing to name
        return []


def describe_collective_failure(rank: int, world_size: int, err: BaseException) -> tuple[bool, str]:
    """(should this rank print, the one-line message) after a failed collective."""
    missing = roll_call(rank, world_size)
    alive = [r for r in range(world_size) if r not in missing]
    speaker = not alive or rank == min(alive)
    who = f"rank(s) {missing}" if missing else "a peer rank"
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return speaker, (
        f"{who} of {world_size} stopped answering during {progress.where()} "
        f"(noticed by rank {rank}: {first_line})")


FAULT_ENV = "DSPARK_FAULT"  # test hook: "RANK:STEP:raise|kill|hang", first attempt only


def inject_fault(rank: int, step: int) -> None:
    """Fail on purpose where DSPARK_FAULT says, so failure handling is tested for real."""
    spec = os.environ.get(FAULT_ENV)
    # Only the first attempt fails: a job restarted by torchrun --max-restarts runs clean.
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    want_rank, want_step, kind = spec.split(":")
    if int(want_rank) != rank or int(want_step) != step:
        return
    if kind == "raise":
        raise ValueError(f"fault injected by {FAULT_ENV}={spec}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(10**6)
