"""`--plan`: the per-rank memory plan for any topology, from config.json files alone.

Nothing launches and nothing is allocated: each rank's live state is published with
override_parallel(tp, attn_dp, tp_rank=r) and priced through the same plan_memory() and
price_step() the engine uses, and its weights are summed over the models' own parameters
built on the meta device, so the plan cannot drift from what a real launch would allocate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_launch.errors import ConfigError
from dspark_launch.memory.budget import (
    GIB,
    MemoryPlan,
    context_of_pool,
    measure_free_bytes,
    plan_memory,
    run_need_bytes,
)
from dspark_launch.memory.geometry import KVGeometry, dtype_from_name
from dspark_launch.memory.transients import (
    StepShape,
    Transients,
    price_step,
    round_shape,
    step_shape,
)
from dspark_launch.memory.weights import WeightBytes, weights_per_rank
from dspark_launch.parallel import override_parallel

BLOCK_DRAFTERS = ("DFLASH", "DSPARK")
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
    """--model/--draft, or the embedded tiny target and the draft of the algorithm asked
    (DSpark's by default), as a launch picks them (engine/build.py resolve_checkpoints:
    --speculative-algorithm DFLASH was priced with the DSpark draft, and refused)."""
    if cfg.model is not None:
        return Path(cfg.model), (Path(cfg.draft) if cfg.draft else None)
    algorithm = cfg.speculative_algorithm or "DSPARK"
    target = TINY / "target"
    draft = TINY / algorithm.lower() if algorithm in BLOCK_DRAFTERS else None
    if not (target / "config.json").is_file():
        raise ConfigError(
            f"no --model given and the embedded tiny model is missing ({target / 'config.json'})"
            f"; pass --model DIR"
        )
    return target, (draft if draft is not None and (draft / "config.json").is_file() else None)


def model_dtype(run: str, parsed) -> torch.dtype:
    """--dtype, else the checkpoint's as the launch reads it (ModelConfig / DraftConfig:
    `dtype` before `torch_dtype`, float32 without either; the plan read them the other way
    round and refused a config without one)."""
    return parsed.dtype if run == "auto" else dtype_from_name(run)


def _on_cuda(cfg) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def plan_budget(cfg, weight_bytes: int, need_bytes: int) -> tuple[int, str]:
    """The per-rank budget the plan prices, and the rule that set it.

    weight_bytes: the largest rank's weights; need_bytes: what the run can use (the CPU
    default's size, run_need_bytes).
    """
    if cfg.kv_cache_memory is not None:
        return cfg.kv_cache_memory, "--kv-cache-memory"
    if not _on_cuda(cfg):
        # The target machine's RAM is unknown here; a launch caps this by its RAM share.
        return need_bytes, ("fit: max running requests x context, both pools + transients "
                            "(a CPU launch caps it by its RAM share)")
    # Estimate: free now * fraction minus this rank's weights (built on meta, nothing is
    # read). A real launch measures around loading instead.
    free = measure_free_bytes(torch.device("cuda", 0))
    budget = int(free * cfg.mem_fraction_static - weight_bytes)
    return budget, (
        f"estimate: free {free / GIB:.2f} GiB * --mem-fraction-static "
        f"{cfg.mem_fraction_static} - weights/rank {weight_bytes / GIB:.2f} GiB"
    )


@dataclass(frozen=True)
class Models:
    """What --plan knows of the run: configs, dtypes, algorithm, block size."""

    target_dir: Path
    draft_dir: Path | None
    target: object  # ModelConfig
    draft: object | None  # DraftConfig, None without a block drafter
    target_dtype: torch.dtype
    draft_dtype: torch.dtype | None
    algorithm: str
    block_size: int


def read_models(cfg) -> Models:
    """Parse the configs as a launch would (models/ parsers; imported lazily: --plan is the
    one part of memory/ that reads model configs)."""
    from dspark_launch.models.config import ModelConfig, run_dtype
    from dspark_launch.models.draft_config import DraftConfig, validate_against_target
    from dspark_launch.spec.factory import NGRAM_BLOCK

    target_dir, draft_dir = checkpoint_dirs(cfg)
    # --device cpu computes "auto" in fp32 (a launch there got 2.6x fewer KV tokens than
    # this plan priced in the checkpoint's bf16); auto or cuda: the checkpoint's dtype, as
    # a GPU launch computes it, wherever the plan runs (it prices other machines' launches)
    dtype = run_dtype(cfg.dtype, cfg.device == "cpu")
    raw_target = read_config(target_dir, "target")
    target = ModelConfig.from_dict(raw_target, source=str(target_dir / "config.json"))
    draft, draft_dtype, block = None, None, cfg.block_size or NGRAM_BLOCK
    algorithm = cfg.speculative_algorithm
    if draft_dir is not None:
        raw_draft = read_config(draft_dir, "draft")
        parsed = DraftConfig.from_dict(raw_draft, source=str(draft_dir / "config.json"))
        algorithm = algorithm or parsed.kind
        if algorithm in BLOCK_DRAFTERS and algorithm != parsed.kind:
            raise ConfigError(f"--speculative-algorithm {algorithm} but --draft={draft_dir} "
                              f"is a {parsed.kind} checkpoint")
        if algorithm == parsed.kind:  # NONE / NGRAM build no draft, so price none
            validate_against_target(parsed, target)
            draft, draft_dtype = parsed, model_dtype(dtype, parsed)
            block = cfg.block_size or parsed.block_size
    if algorithm in BLOCK_DRAFTERS and draft is None:
        raise ConfigError(f"--speculative-algorithm {algorithm} needs --draft (a {algorithm} "
                          f"checkpoint directory)")
    return Models(target_dir, draft_dir if draft else None, target, draft,
                  model_dtype(dtype, target), draft_dtype,
                  algorithm or "NONE", block)


def _geometries(m: Models) -> tuple[KVGeometry, KVGeometry | None]:
    t = m.target
    target = KVGeometry("target", t.num_hidden_layers, t.num_key_value_heads, t.head_dim,
                        t.head_dim, m.target_dtype)
    if m.draft is None:
        return target, None
    d = m.draft
    return target, KVGeometry("draft", d.num_hidden_layers, d.num_key_value_heads, d.head_dim,
                              d.head_dim, m.draft_dtype)


@dataclass(frozen=True)
class RankPlan:
    plan: MemoryPlan
    weights: WeightBytes
    transients: Transients

    def to_dict(self) -> dict:
        return {**self.plan.to_dict(), "weights": self.weights.to_dict(),
                "weights_gib": round(self.weights.total / GIB, 4),
                "transients": self.transients.to_dict()}


def per_rank_plans(cfg, m: Models) -> tuple[list[RankPlan], StepShape, str]:
    """Every rank priced under its own published state, as a launch would price it."""
    target, draft = _geometries(m)
    max_drafts, block_rows = round_shape(m.algorithm, m.block_size)
    limit = cfg.context_length or m.target.max_position_embeddings
    request_rows = limit + max(1 + max_drafts, block_rows)
    parts = []
    for rank in range(cfg.tp_size):
        with override_parallel(cfg.tp_size, cfg.attn_dp_size, tp_rank=rank):
            shape = step_shape(cfg, m.target, m.target_dtype, max_drafts, block_rows, m.draft)
            weights = weights_per_rank(m.target, m.target_dtype, m.draft, m.draft_dtype,
                                       cfg.tp_size, cfg.attn_dp_size, rank)
            cell = target.cell_bytes() + (draft.cell_bytes() if draft else 0)
            trans = price_step(shape)
            need = run_need_bytes(cell, cfg.page_size, cfg.max_running_requests,
                                  request_rows, trans.total)
            parts.append((shape, weights, trans, need))
    budget, rule = plan_budget(cfg, max(w.total for _, w, _, _ in parts),
                               max(n for *_, n in parts))
    plans = []
    for rank, (_shape, weights, trans, _need) in enumerate(parts):
        with override_parallel(cfg.tp_size, cfg.attn_dp_size, tp_rank=rank):
            plan = plan_memory(budget, target, draft, cfg.page_size, cfg.max_total_tokens,
                               trans.total, rule)
        plans.append(RankPlan(plan, weights, trans))
    return plans, parts[0][0], rule


def build_report(cfg) -> dict:
    m = read_models(cfg)
    target, draft = _geometries(m)
    ranks, shape, rule = per_rank_plans(cfg, m)
    budget = ranks[0].plan.budget_bytes
    agreed = min(r.plan.max_total_tokens for r in ranks)  # what the MIN all-reduce would give
    max_drafts, block_rows = round_shape(m.algorithm, m.block_size)
    context_of_pool(agreed, cfg.context_length or m.target.max_position_embeddings,
                    max(1 + max_drafts, block_rows))
    return {
        "tp_size": cfg.tp_size,
        "attn_dp_size": cfg.attn_dp_size,
        "attn_tp_size": cfg.tp_size // cfg.attn_dp_size,
        "page_size": cfg.page_size,
        "max_total_tokens_cap": cfg.max_total_tokens,
        "budget_bytes": budget,
        "budget_source": rule,
        "algorithm": m.algorithm,
        "block_size": m.block_size,
        "target": _geometry_dict(target, m.target_dir),
        "draft": _geometry_dict(draft, m.draft_dir) if draft else None,
        "step": {**shape.to_dict(), "forward_rows": shape.forward_rows,
                 "logit_rows": shape.logit_rows},
        "max_total_tokens": agreed,
        "ranks": [r.to_dict() for r in ranks],
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
    t, d, ranks = report["target"], report["draft"], report["ranks"]
    lines = [
        f"memory plan: tp={report['tp_size']} attn_tp={report['attn_tp_size']} "
        f"attn_dp={report['attn_dp_size']} page_size={report['page_size']} "
        f"budget/rank={report['budget_bytes']} B ({report['budget_bytes'] / GIB:.2f} GiB, "
        f"{report['budget_source']})",
        _geometry_line("target", t),
        _geometry_line("draft", d) if d else "draft : none",
        _weights_line(ranks),
        *_transients_lines(report),
    ]
    header = (
        f"{'rank':>4} {'dp_rk':>5} {'tp_rk':>5} {'tgt_kvh':>7} {'drf_kvh':>7} "
        f"{'tgt_cell':>9} {'drf_cell':>9} {'tokens':>10} {'tgt_GiB':>8} {'drf_GiB':>8} "
        f"{'trans_GiB':>9} {'budget_GiB':>10} {'wts_GiB':>8}"
    )
    lines += [header, "-" * len(header)]
    for r in ranks:
        lines.append(
            f"{r['tp_rank']:>4} {r['attn_dp_rank']:>5} {r['attn_tp_rank']:>5} "
            f"{r['target_kv_heads_per_rank']:>7} {r['draft_kv_heads_per_rank']:>7} "
            f"{r['target_cell']:>9} {r['draft_cell']:>9} {r['max_total_tokens']:>10} "
            f"{r['target_pool_gib']:>8.3f} {r['draft_pool_gib']:>8.3f} "
            f"{r['transient_gib']:>9.3f} {r['budget_gib']:>10.3f} {r['weights_gib']:>8.3f}"
        )
    lines.append(
        f"max_total_tokens (MIN over ranks) = {report['max_total_tokens']}; "
        f"cell = kv_heads_per_rank * (head_dim + v_head_dim) * layers * itemsize; "
        f"pools hold max_total_tokens + page_size rows (page 0 is the padding dummy) in "
        f"budget - transients; weights are not in the KV budget"
    )
    return "\n".join(lines)


def _weights_line(ranks: list[dict]) -> str:
    w = ranks[0]["weights"]
    same = all(r["weights"] == w for r in ranks)
    return (
        f"weights/rank: target {w['target']} B + draft {w['draft']} B = {w['total']} B "
        f"({w['total'] / GIB:.3f} GiB){' on every rank' if same else ' on rank 0 (see wts_GiB)'}"
        f"; the models' own parameters built on meta at this topology"
    )


def _transients_lines(report: dict) -> list[str]:
    s = report["step"]
    lines = [
        f"step: {report['algorithm']} block {report['block_size']}: R={s['max_running']} x "
        f"{s['verify_rows']} verify rows (or a {s['chunk_rows']}-row prefill chunk) = "
        f"{s['forward_rows']} forward rows, {s['logit_rows']} logit rows, "
        f"{s['max_running'] * s['draft_slots']} draft distributions"
    ]
    seen: dict[str, list[int]] = {}
    for r in report["ranks"]:
        x = r["transients"]
        key = (
            f"{x['total']} B ({x['total'] / GIB:.3f} GiB) = deferred draft context "
            f"{x['deferred']} + max(propose: draft {x['draft']}, "
            f"verify: draft_q {x['draft_q']} + features {x['features']} + max(attention "
            f"{x['attention']} + mlp {x['mlp']} + split_k {x['split_k']}, verify_logits "
            f"{x['verify_logits']} + sampler {x['sampler']}))"
        )
        seen.setdefault(key, []).append(r["tp_rank"])
    for key, ranks in seen.items():
        who = "every rank" if len(seen) == 1 else f"ranks {_span(ranks)}"
        lines.append(f"transients/rank ({who}): {key}")
    return lines


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def _geometry_line(role: str, g: dict) -> str:
    return (
        f"{role:<6}: {g['path']}  layers={g['num_layers']} kv_heads={g['num_kv_heads']} "
        f"head_dim={g['head_dim']} v_head_dim={g['v_head_dim']} dtype={g['dtype']}"
    )


def print_plan(cfg) -> None:
    report = build_report(cfg)
    print(json.dumps(report, indent=2) if cfg.json else format_table(report), flush=True)
