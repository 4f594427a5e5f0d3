"""`--plan`: the per-rank memory plan for any topology, from config.json files alone.

Nothing launches and nothing is allocated: each rank's live state is published with
override_parallel(tp, attn_dp, tp_rank=r) and priced through the same plan_memory() the
engine uses, so the plan cannot drift from what a real launch would allocate.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_launch.errors import ConfigError
from dspark_launch.memory.budget import GIB, MemoryPlan, measure_free_bytes, plan_memory
from dspark_launch.memory.geometry import KVGeometry, dtype_from_name, geometry_from_config
from dspark_launch.parallel import override_parallel

TINY = Path(__file__).resolve().parent.parent / "assets" / "tiny"


def read_config(directory: str | Path, role: str) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{role} checkpoint {directory}: {path} does not exist")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{role} checkpoint {path} is not readable JSON: {err}") from None


def checkpoint_dirs(cfg) -> tuple[Path, Path | None]:
    """--model/--draft, or the embedded tiny target + DSpark draft."""
    if cfg.model is not None:
        return Path(cfg.model), (Path(cfg.draft) if cfg.draft else None)
    target, draft = TINY / "target", TINY / "dspark"
    if not (target / "config.json").is_file():
        raise ConfigError(
            f"no --model given and the embedded tiny model is missing ({target / 'config.json'})"
            f"; pass --model DIR"
        )
    return target, (draft if (draft / "config.json").is_file() else None)


def config_dtype(cfg_dtype: str, config: dict, role: str) -> torch.dtype:
    if cfg_dtype != "auto":
        return dtype_from_name(cfg_dtype)
    name = config.get("torch_dtype") or config.get("dtype")
    if name is None:
        raise ConfigError(f"{role} config.json has no torch_dtype/dtype; pass --dtype")
    return dtype_from_name(name)


def _on_cuda(cfg) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def plan_budget(cfg, dirs: list[Path]) -> tuple[int, str]:
    """The per-rank budget the plan prices, and where it came from."""
    if cfg.kv_cache_memory is not None:
        return cfg.kv_cache_memory, "--kv-cache-memory"
    if not _on_cuda(cfg):
        raise ConfigError(
            "--plan on CPU needs --kv-cache-memory (the per-rank KV budget, e.g. 8GiB): "
            "without launching, this machine's RAM says nothing about the target's"
        )
    # Estimate: free now * fraction minus this rank's share of the weight files (sizes
    # only; nothing is read). A real launch measures around loading instead.
    weights = sum(f.stat().st_size for d in dirs for f in d.glob("*.safetensors"))
    free = measure_free_bytes(torch.device("cuda", 0))
    budget = int(free * cfg.mem_fraction_static - weights / cfg.tp_size)
    return budget, (
        f"estimate: free {free / GIB:.2f} GiB * --mem-fraction-static "
        f"{cfg.mem_fraction_static} - weights {weights / GIB:.2f} GiB / tp {cfg.tp_size}"
    )


def per_rank_plans(
    cfg, budget: int, target: KVGeometry, draft: KVGeometry | None
) -> list[MemoryPlan]:
    plans = []
    for rank in range(cfg.tp_size):
        with override_parallel(cfg.tp_size, cfg.attn_dp_size, tp_rank=rank):
            plans.append(
                plan_memory(budget, target, draft, cfg.page_size, cfg.max_total_tokens)
            )
    return plans


def build_report(cfg) -> dict:
    target_dir, draft_dir = checkpoint_dirs(cfg)
    target_cfg = read_config(target_dir, "target")
    target = geometry_from_config(
        "target", target_cfg, config_dtype(cfg.dtype, target_cfg, "target")
    )
    draft = None
    if draft_dir is not None:
        draft_cfg = read_config(draft_dir, "draft")
        draft = geometry_from_config(
            "draft", draft_cfg, config_dtype(cfg.dtype, draft_cfg, "draft")
        )
    dirs = [target_dir] + ([draft_dir] if draft_dir else [])
    budget, source = plan_budget(cfg, dirs)
    plans = per_rank_plans(cfg, budget, target, draft)
    agreed = min(p.max_total_tokens for p in plans)  # what the MIN all-reduce would give
    return {
        "tp_size": cfg.tp_size,
        "attn_dp_size": cfg.attn_dp_size,
        "attn_tp_size": cfg.tp_size // cfg.attn_dp_size,
        "page_size": cfg.page_size,
        "max_total_tokens_cap": cfg.max_total_tokens,
        "budget_bytes": budget,
        "budget_source": source,
        "target": _geometry_dict(target, target_dir),
        "draft": _geometry_dict(draft, draft_dir) if draft else None,
        "max_total_tokens": agreed,
        "ranks": [p.to_dict() for p in plans],
    }


def _geometry_dict(g: KVGeometry, directory: Path) -> dict:
    return {
        "path": str(directory),
        "num_layers": g.num_layers,
        "num_kv_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
        "v_head_dim": g.v_head_dim,
        "dtype": str(g.dtype).removeprefix("torch."),
    }


def format_table(report: dict) -> str:
    t, d = report["target"], report["draft"]
    lines = [
        f"memory plan: tp={report['tp_size']} attn_tp={report['attn_tp_size']} "
        f"attn_dp={report['attn_dp_size']} page_size={report['page_size']} "
        f"budget/rank={report['budget_bytes']} B ({report['budget_bytes'] / GIB:.2f} GiB, "
        f"{report['budget_source']})",
        _geometry_line("target", t),
        _geometry_line("draft", d) if d else "draft : none",
    ]
    header = (
        f"{'rank':>4} {'dp_rk':>5} {'tp_rk':>5} {'tgt_kvh':>7} {'drf_kvh':>7} "
        f"{'tgt_cell':>9} {'drf_cell':>9} {'tokens':>10} {'tgt_GiB':>8} {'drf_GiB':>8} "
        f"{'budget_GiB':>10}"
    )
    lines += [header, "-" * len(header)]
    for r in report["ranks"]:
        lines.append(
            f"{r['tp_rank']:>4} {r['attn_dp_rank']:>5} {r['attn_tp_rank']:>5} "
            f"{r['target_kv_heads_per_rank']:>7} {r['draft_kv_heads_per_rank']:>7} "
            f"{r['target_cell']:>9} {r['draft_cell']:>9} {r['max_total_tokens']:>10} "
            f"{r['target_pool_gib']:>8.3f} {r['draft_pool_gib']:>8.3f} {r['budget_gib']:>10.3f}"
        )
    lines.append(
        f"max_total_tokens (MIN over ranks) = {report['max_total_tokens']}; "
        f"cell = kv_heads_per_rank * (head_dim + v_head_dim) * layers * itemsize; "
        f"pools hold max_total_tokens + page_size rows (page 0 is the padding dummy)"
    )
    return "\n".join(lines)


def _geometry_line(role: str, g: dict) -> str:
    return (
        f"{role:<6}: {g['path']}  layers={g['num_layers']} kv_heads={g['num_kv_heads']} "
        f"head_dim={g['head_dim']} v_head_dim={g['v_head_dim']} dtype={g['dtype']}"
    )


def print_plan(cfg) -> None:
    report = build_report(cfg)
    print(json.dumps(report, indent=2) if cfg.json else format_table(report), flush=True)
