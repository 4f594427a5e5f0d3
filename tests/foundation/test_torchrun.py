"""The real entry point under real torchrun: one node of 4 ranks, and two 'nodes' on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import write_checkpoint

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Flags for a tiny real job: a random checkpoint that shards over 4 ranks, two prompts."""
    root = tmp_path_factory.mktemp("torchrun")
    model = write_checkpoint(root / "model", "qwen3", num_layers=1)
    prompts = Path(root / "prompts.jsonl")
    prompts.write_text('{"input_ids": [5, 6, 7]}\n{"input_ids": [9, 10]}\n')
    return ["--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "3",
            "--kv-cache-memory", "8MiB"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layouts(log: str) -> list[dict]:
    rows = [json.loads(line.split("LAYOUT ", 1)[1]) for line in log.splitlines()
            if "LAYOUT " in line]
    return sorted(rows, key=lambda r: r["rank"])


def test_torchrun_four_ranks_report_the_layout(job: list[str]) -> None:
    cmd = TORCHRUN + [
        "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "dspark_launch", "--dp-size", "2", "--enable-dp-attention", *job,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _layouts(proc.stderr)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert (r["tp_size"], r["attn_tp_size"], r["attn_dp_size"]) == (4, 2, 2)
        assert r["attn_dp_rank"] == r["rank"] // 2 and r["attn_tp_rank"] == r["rank"] % 2
        assert r["attn_tp_ranks"] == [2 * r["attn_dp_rank"], 2 * r["attn_dp_rank"] + 1]
        assert r["attn_tp_rank_sum"] == sum(r["attn_tp_ranks"])
        assert r["local_rank"] == r["rank"] and r["backend"] == "gloo"
    # The deprecated spelling warns once (rank 0), not once per rank.
    assert proc.stderr.count("--enable-dp-attention is deprecated") == 1


def test_two_nodes_on_loopback_span_the_node_boundary(job: list[str]) -> None:
    port = _free_port()
    agents = [
        subprocess.Popen(
            TORCHRUN + [
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "dspark_launch", "--attn-dp-size", "1", *job,
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        )
        for node in (0, 1)
    ]
    outs = [a.communicate(timeout=240) for a in agents]
    for agent, (_, err) in zip(agents, outs):
        assert agent.returncode == 0, err[-3000:]
    rows = _layouts(outs[0][1])  # rank 0 lives on node 0 and logs everyone's layout
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in rows] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1),
    ]
    for r in rows:
        # One attention-TP group of 4 crossing the node boundary; the all-reduce proves it.
        assert r["attn_tp_ranks"] == [0, 1, 2, 3] and r["attn_tp_rank_sum"] == 6
        assert r["tp_rank"] == r["rank"] and r["world_size"] == 4
