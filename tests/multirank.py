"""Fork real gloo worlds from the test process.

`run_world(n, fn, *args)` forks n ranks that join a gloo world exactly as under torchrun
(env:// rendezvous against a TCP store this process hosts, as torchrun's agent does), runs
`fn(rank, *args)` on every rank and returns the results in rank order. Any rank's exception
is re-raised here with its rank and traceback; a rank that hangs or dies fails the test
within `timeout` seconds and every child is killed.

A world of 8 starts in well under a second on 2 cores, where a fresh torchrun costs ~20 s.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class RankError(AssertionError):
    pass


def _child(rank: int, world_size: int, port: int, env: dict, fn, args, results, go) -> None:
    try:
        # Connect only once every rank is forked: a fork taken while the parent's store thread
        # holds a glibc lock (it resolves each connecting peer) would inherit the lock held.
        go.wait()
        os.environ.update(env)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            # Connect to the store the parent hosts instead of rank 0 serving one (torchrun
            # does the same), so no free-port race between concurrent worlds.
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        torch.set_num_threads(1)  # 8 ranks on 2 cores: oversubscription costs more than it buys
        results.put((rank, "ok", fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        from dspark_launch.parallel import destroy_parallel_runtime

        destroy_parallel_runtime()
        results.close()
        results.join_thread()
        os._exit(0)


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run fn(rank, *args) on a forked gloo world of `world_size`; results in rank order."""
    # No half-dead gloo group may be collected inside a child (it would hang there): collect
    # here, frozen objects too (an in-process job that failed before its engine's shutdown
    # leaves its freeze) ...
    gc.unfreeze()
    gc.collect()
    # ... and what is alive now stays out of the children's collector's view: each rank's
    # collections (engine build and shutdown, teardown) walked this whole process's heap
    # otherwise, ~0.1 s each and a copy of every page they touched. Thawed here once they are
    # forked: this process's own engines collect as usual.
    gc.freeze()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, store.port, env or {}, fn, args, results, go),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    gc.unfreeze()
    go.set()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise RankError(f"ranks {missing} did not finish within {timeout:.0f}s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome]
                if dead and all(r in outcome or not procs[r].is_alive() for r in range(world_size)):
                    # Give the queue a moment to deliver what the dead ones sent.
                    time.sleep(0.2)
                    if results.empty():
                        raise RankError(f"ranks {dead} exited without a result") from None
                continue
            outcome[rank] = (status, value)
            if status == "error":
                break  # fail fast: the others are probably stuck in a collective now
    finally:
        failed = len(outcome) < world_size or any(s == "error" for s, _ in outcome.values())
        for proc in procs:
            proc.join(timeout=0.05 if failed else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del store
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if errors:
        rank = min(errors)
        raise RankError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [outcome[r][1] for r in range(world_size)]
