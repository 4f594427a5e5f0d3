"""Online serving benchmark: open-loop Poisson arrivals against live servers, one per algorithm.

    python scripts/bench_serving_server.py [--nproc 2] [--rates 2 8 16 32] [--num-requests 128]
        [--repeats 3] [--temperature 0] [--max-tokens 64] [--algorithms NONE DSPARK]
        [--out docs/bench/serving_online.json] [--plot docs/bench/serving_online.png]
        [--url http://127.0.0.1:30000]

The script launches one `dspark_launch serve` per algorithm (torchrun with --nproc ranks, or a
world of one for --nproc 1) on the embedded model and waits for /health on each. At each
request rate it sends --num-requests streaming completions whose arrival times are a Poisson
process (exponential gaps, seeded: every algorithm sees the same arrivals and prompts). Open
loop: a request is sent at its arrival time whether or not earlier ones finished.

The servers take turns, one rate at a time, in an order that rotates every rate and repeat,
so a slow spell of a shared machine lands on all of them alike (an idle server waits on its
queue). One unmeasured pass at the highest rate first lets each server's verify-length policy
learn, as a long-running server's has. Per rate it reports output throughput (tokens / (last
finish - first arrival)), TTFT (arrival -> first streamed text) and TPOT ((finish - first
token) / (tokens - 1)) p50 and p99, and mean tau from the responses' meta_info: the median
over --repeats, each repeat's values kept in `runs`. With --url the given server is measured
instead (no launch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "dspark_launch/assets/prompts/heldout.jsonl"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, algorithm: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    launcher = [sys.executable, "-m", "dspark_launch"] if args.nproc == 1 else [
        sys.executable, "-m", "dspark_launch.launch", "--standalone", "--nproc-per-node",
        str(args.nproc), "-m", "dspark_launch"]
    cmd = [*launcher, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--speculative-algorithm", algorithm, "--kv-cache-memory", args.kv_cache_memory,
           "--max-running-requests", str(args.max_running_requests), *args.server_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{algorithm} server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{algorithm} server not healthy after 300 s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one_request(url: str, prompt: str, args, arrival: float, out: dict) -> None:
    """Stream one completion; record first-text and finish times (perf_counter)."""
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "ignore_eos": True}
    first = None
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                choice = chunk["choices"][0]
                if first is None and choice["text"]:
                    first = time.perf_counter()
                if choice.get("meta_info"):
                    out["meta"] = choice["meta_info"]
        out.update(arrival=arrival, first=first, end=time.perf_counter())
    except requests.RequestException as err:
        out.update(error=str(err))


def run_rate(url: str, prompts: list[str], rate: float, args) -> dict:
    rng = random.Random(args.seed)
    gaps = [rng.expovariate(rate) for _ in prompts]
    results = [{} for _ in prompts]
    threads = []
    start = time.perf_counter()
    due = start
    for i, (prompt, gap) in enumerate(zip(prompts, gaps)):
        due += gap if i else 0.0
        time.sleep(max(0.0, due - time.perf_counter()))
        t = threading.Thread(target=one_request, args=(url, prompt, args,
                                                       time.perf_counter(), results[i]))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    ok = [r for r in results if "error" not in r and r.get("meta")]
    tokens = [r["meta"]["completion_tokens"] for r in ok]
    ttft = [r["first"] - r["arrival"] for r in ok if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) / (n - 1) for r, n in zip(ok, tokens)
            if r["first"] is not None and n > 1]
    rounds = [a for r in ok for a in r["meta"]["accept_lens"]]
    wall = max(r["end"] for r in ok) - start if ok else float("nan")
    return {
        "rate_req_s": rate, "requests": len(prompts), "errors": len(prompts) - len(ok),
        "output_tokens": sum(tokens), "wall_s": wall,
        "output_tok_s": sum(tokens) / wall if ok else None,
        "request_s": len(ok) / wall if ok else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "mean_tau": sum(rounds) / len(rounds) if rounds else None,
    }


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_tok_s", "output tokens / s"), ("ttft_p50_s", "TTFT p50 (s)"),
              ("ttft_p99_s", "TTFT p99 (s)"), ("tpot_p50_s", "TPOT p50 (s)"),
              ("tpot_p99_s", "TPOT p99 (s)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (key, label) in zip(axes, panels):
        for algorithm, rows in results.items():
            ax.plot([r["rate_req_s"] for r in rows], [r[key] or 0 for r in rows], marker="o",
                    label=algorithm)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


METRICS = ("output_tok_s", "request_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
           "tpot_p99_s", "mean_tau", "wall_s")


def median_row(runs: list[dict]) -> dict:
    """One rate's repeats -> their medians, each repeat kept in `runs`."""
    out = {k: runs[0][k] for k in ("rate_req_s", "requests", "output_tokens")}
    out["errors"] = sum(r["errors"] for r in runs)
    for k in METRICS:
        values = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(values) if values else None
    out["runs"] = runs
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="measure this running server instead")
    ap.add_argument("--nproc", type=int, default=1, help="ranks per server (torchrun if > 1)")
    ap.add_argument("--algorithms", nargs="+", default=["NONE", "DSPARK"])
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 16.0, 32.0])
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                    help="extra flags for `dspark_launch serve` (last on the line)")
    ap.add_argument("--out", default=str(ROOT / "docs/bench/serving_online.json"))
    ap.add_argument("--plot", default=None,
                    help="the plot's path (default: --out's, with .png; a run with its own --out "
                    "wrote over the committed plot)")
    args = ap.parse_args()

    rows = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line]
    prompts = [rows[i % len(rows)] for i in range(args.num_requests)]
    names = ["server"] if args.url else args.algorithms
    urls: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    runs: dict[str, dict[float, list[dict]]] = {n: {rate: [] for rate in args.rates}
                                                 for n in names}
    try:
        for name in names:
            if args.url:
                urls[name] = args.url
                continue
            log = Path(tempfile.gettempdir()) / f"bench_serving_server_{name}.log"
            proc, urls[name] = start_server(args, name, log)
            procs.append(proc)
        for name in names:  # warm-up: not recorded
            run_rate(urls[name], prompts, max(args.rates), args)
        turn = 0
        for rep in range(args.repeats):
            for rate in args.rates:
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for name in order:
                    r = run_rate(urls[name], prompts, rate, args)
                    runs[name][rate].append(r)
                    print(f"repeat {rep} {name:7s} rate {rate:5.1f} req/s: "
                          f"{r['output_tok_s'] or 0:7.1f} tok/s  TTFT p50 "
                          f"{r['ttft_p50_s'] or 0:.3f} p99 {r['ttft_p99_s'] or 0:.3f} s  TPOT p50 "
                          f"{r['tpot_p50_s'] or 0:.4f} p99 {r['tpot_p99_s'] or 0:.4f} s  tau "
                          f"{r['mean_tau'] or 0:.2f}  errors {r['errors']}", flush=True)
    finally:
        for proc in procs:
            stop_server(proc)
    results = {name: [median_row(runs[name][rate]) for rate in args.rates] for name in names}
    for name in names:
        for r in results[name]:
            print(f"median {name:7s} rate {r['rate_req_s']:5.1f} req/s: "
                  f"{r['output_tok_s'] or 0:7.1f} tok/s  TPOT p50 {r['tpot_p50_s'] or 0:.4f} s  "
                  f"tau {r['mean_tau'] or 0:.2f}")
    meta = {"nproc": args.nproc, "num_requests": args.num_requests, "repeats": args.repeats,
            "temperature": args.temperature, "max_tokens": args.max_tokens,
            "threads_per_rank": args.threads,
            "max_running_requests": args.max_running_requests, "seed": args.seed,
            "server_args": args.server_args, "model": "embedded tiny Qwen3 + drafts",
            "device": "cpu"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    plot(results, Path(args.plot) if args.plot else Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
