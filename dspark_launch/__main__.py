"""torchrun entry: parse -> resolve -> init_parallel_runtime -> build engine -> run -> teardown.

    torchrun --nproc-per-node 8 -m dspark_launch [flags]
    python -m dspark_launch [flags]            # a world of one
    torchrun --nproc-per-node 2 -m dspark_launch serve --port 30000 [flags]   # HTTP server
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback

import torch

from dspark_launch.args import RunConfig, resolve_config
from dspark_launch.comm import all_gather_object
from dspark_launch.errors import LaunchError
from dspark_launch.failure import (
    EXIT_CODES,
    FAILED,
    agree,
    install_signal_handlers,
    progress,
    received_signal,
    record_signals_only,
    roll_call,
    signal_verdict,
    store_of_world,
)
from dspark_launch.log import logger, setup_logging
from dspark_launch.parallel import (
    ParallelState,
    destroy_parallel_runtime,
    get_parallel,
    init_parallel_runtime,
)


def layout_report(state: ParallelState) -> dict:
    """This rank's place in the world, with the attn_tp group proven by a real all-reduce."""
    from dspark_launch.comm import attn_tp_all_reduce

    member_sum = attn_tp_all_reduce(torch.tensor([state.rank], dtype=torch.int64,
                                                 device=state.device))
    return {
        "rank": state.rank,
        "node_rank": state.node_rank,
        "local_rank": state.local_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "world_size": state.world_size,
        "tp_size": state.tp_size,
        "tp_rank": state.tp_rank,
        "attn_tp_size": state.attn_tp_size,
        "attn_tp_rank": state.attn_tp_rank,
        "attn_dp_size": state.attn_dp_size,
        "attn_dp_rank": state.attn_dp_rank,
        "attn_tp_ranks": list(state.attn_tp_ranks),
        "attn_tp_rank_sum": int(member_sum.item()),
        "backend": state.backend,
        "device": str(state.device),
    }


def report_topology() -> list[dict]:
    """Gather every rank's layout to rank 0 and print it there, one JSON line per rank."""
    state = get_parallel()
    mine = layout_report(state)
    everyone: list[dict] = all_gather_object(mine)
    if state.rank == 0:
        logger.info(
            "topology: world=%d tp=%d attn_tp=%d attn_dp=%d backend=%s",
            state.world_size, state.tp_size, state.attn_tp_size, state.attn_dp_size,
            state.backend,
        )
        for row in everyone:
            logger.info("LAYOUT %s", json.dumps(row, sort_keys=True))
    return everyone


def run(cfg: RunConfig) -> int:
    install_signal_handlers()
    progress.phase, progress.step = "startup", 0
    state = init_parallel_runtime(cfg)
    setup_logging(state.rank, cfg.log_all_ranks, cfg.log_level)
    if state.rank == 0:
        for warning in cfg.warnings:
            logger.warning(warning)
    try:
        report_topology()
        if cfg.serve:
            from dspark_launch.serve.server import serve

            return serve(cfg, engine_and_job_args(cfg)[0])
        from dspark_launch.engine.runner import run_job

        return run_job(*engine_and_job_args(cfg))
    except BaseException as err:  # noqa: BLE001 - every failure ends as one named line
        return stop(state, err)


def stop(state: ParallelState, err: BaseException) -> int:
    """End this rank after `err`, as every rank agrees: one line, said once, one exit code."""
    record_signals_only()
    if isinstance(err, KeyboardInterrupt):  # a second signal: now, without a roll call
        signum = getattr(err, "signum", received_signal()) or signal.SIGINT
        # ... but with its verdict posted (no wait), or its peers name it as dead
        roll_call(store_of_world(), state.rank, state.world_size, signal_verdict(signum), 0.0)
        return EXIT_CODES.get(signum, 130)
    if not isinstance(err, Exception):
        raise err  # SystemExit and the like: not a failure to report
    if isinstance(err, LaunchError) and getattr(err, "agreed", False):
        # Raised alike on every rank from data they all hold (a divergence): rank 0 says it.
        if state.rank == 0:
            print(f"dspark_launch: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    end = agree(state.rank, state.world_size, err)
    if end is None:  # this rank's own failure: its traceback, here
        print(f"dspark_launch: error: rank {state.rank} failed during {progress.where()}: "
              f"{type(err).__name__}: {err}\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        roll_call(store_of_world(), state.rank, state.world_size, FAILED, 0.0)
        return 1
    if end.speak:
        print(f"dspark_launch: error: {end.line}", file=sys.stderr, flush=True)
    return end.exit_code


def engine_and_job_args(cfg: RunConfig):
    """The CLI's RunConfig -> the engine's EngineArgs and the offline job's JobArgs (same
    field names: each takes its own)."""
    from dataclasses import fields

    from dspark_launch.engine.build import EngineArgs
    from dspark_launch.engine.runner import JobArgs

    def pick(cls):
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    return pick(EngineArgs), pick(JobArgs)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            cfg = resolve_config(argv)
        except LaunchError as err:
            # Every rank parses the same flags to the same verdict: rank 0 says it, once (each
            # rank printed it before: 8 lines at tp8)
            if os.environ.get("RANK", "0") == "0":
                print(f"dspark_launch: error: {err}", file=sys.stderr, flush=True)
            return err.exit_code
        if cfg.plan:
            from dspark_launch.memory.plan import print_plan

            print_plan(cfg)
            return 0
        return run(cfg)
    except LaunchError as err:
        # Raised before the ranks could agree (the device, the topology): alike on a node's
        # ranks, so its first says it (every rank printed it: 8 lines at tp8), or the one the
        # error names (the lowest rank that joined, for ranks that did not)
        speaker = getattr(err, "speaker", None)
        if (os.environ.get("RANK", "0") == str(speaker) if speaker is not None
                else os.environ.get("LOCAL_RANK", "0") == "0"):
            print(f"dspark_launch: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt as err:  # a second signal: stop without the step boundary
        return EXIT_CODES.get(getattr(err, "signum", received_signal()), 130)
    finally:
        destroy_parallel_runtime()


if __name__ == "__main__":
    sys.exit(main())
