"""The engine's collectives (dspark_launch/comm.py) against gloo's own, side by side on forked
gloo worlds of this machine: the per-call latency of a decode step's all-reduce ([rows, hidden]
fp32) and of the per-step all-gather of a few ints, for recursive doubling over send/recv and
for dist.all_reduce / dist.all_gather (gloo's ring). Each rank pins one intra-op thread.

    python scripts/bench_collectives.py --worlds 2 4 8 --calls 200 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "bench_collectives.json"


def _rank(rank: int, world: int, port: int, shapes: list[list[int]], calls: int,
          repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    from dspark_launch import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    out: dict[str, list[float]] = {}
    ints = torch.zeros(6, dtype=torch.int64)  # the step's exchange: a few ints per rank
    parts = [torch.empty_like(ints) for _ in range(world)]
    for shape in shapes:
        x = torch.zeros(shape)  # summed in place call after call: zeros stay finite
        cases = {
            f"all_reduce {shape} gloo": lambda x=x: dist.all_reduce(x, group=group),
            f"all_reduce {shape} doubling": lambda x=x: comm.all_reduce(x, group),
        }
        if shape is shapes[0]:
            cases["all_gather 6 ints gloo"] = lambda: dist.all_gather(parts, ints, group=group)
            cases["all_gather 6 ints doubling"] = lambda: comm.all_gather(ints, group)
        for _ in range(repeats):
            for name, call in cases.items():  # side by side: the same moment of the machine
                for _ in range(10):
                    call()
                dist.barrier(group)
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                out.setdefault(name, []).append((time.perf_counter() - t0) / calls * 1e3)
    results.put((rank, out))
    dist.destroy_process_group()


def run_world(world: int, shapes: list[list[int]], calls: int, repeats: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, shapes, calls, repeats, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    rank0 = got[0]
    return {name: {"ms_median": round(statistics.median(v), 3), "ms_runs": [round(t, 3) for t in v]}
            for name, v in rank0.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shapes = [[1, 256], [16, 256], [64, 256]]  # decode rows x hidden (the embedded target)
    table = {str(w): run_world(w, shapes, args.calls, args.repeats) for w in args.worlds}
    meta = {"cpus": os.cpu_count(), "calls": args.calls, "repeats": args.repeats,
            "unit": "ms per call on rank 0, median over repeats"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "worlds": table}, indent=1) + "\n")
    for w, rows in table.items():
        for name, r in rows.items():
            print(f"world {w:>2}  {name:<36} {r['ms_median']:8.3f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
