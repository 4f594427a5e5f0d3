"""Build the job on every rank: models -> memory plan -> pools -> proposer -> prompts -> run."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_launch import failure
from dspark_launch.args import RunConfig
from dspark_launch.attention import make_backend
from dspark_launch.comm import agreed, broadcast_object
from dspark_launch.engine.engine import Engine, EngineLimits
from dspark_launch.engine.inputs import BUILTIN_PROMPTS, build_specs, read_prompt_file
from dspark_launch.engine.output import (
    OutputWriter,
    completed_indices,
    format_summary,
    refused_record,
    summarize,
)
from dspark_launch.engine.warmup import largest_batch_step
from dspark_launch.errors import ConfigError
from dspark_launch.log import logger
from dspark_launch.memory.budget import configure_memory, measure_free_bytes
from dspark_launch.memory.build import build_kv_memory
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.transients import check_step_peak, step_shape
from dspark_launch.models.loader import load_model
from dspark_launch.parallel import get_parallel
from dspark_launch.spec.factory import draft_kind_of, make_proposer

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "tiny"


@dataclass(frozen=True)
class Checkpoints:
    model: str
    draft: str | None
    algorithm: str


def resolve_checkpoints(cfg: RunConfig) -> Checkpoints:
    """Which target, draft and algorithm this run uses (the embedded model when no --model)."""
    if cfg.model is None:
        algorithm = cfg.speculative_algorithm or "DSPARK"
        model = ASSETS / "target"
        if not (model / "config.json").is_file():
            raise ConfigError(f"no --model given and the embedded model is missing at {model}")
        draft = None
        if algorithm in ("DFLASH", "DSPARK"):
            draft = ASSETS / algorithm.lower()
            if not (draft / "config.json").is_file():
                raise ConfigError(f"the embedded {algorithm} draft is missing at {draft}")
        return Checkpoints(str(model), None if draft is None else str(draft), algorithm)
    algorithm = cfg.speculative_algorithm
    if algorithm is None:
        algorithm = draft_kind_of(cfg.draft) if cfg.draft else "NONE"
    if algorithm in ("DFLASH", "DSPARK") and draft_kind_of(cfg.draft) != algorithm:
        raise ConfigError(
            f"--speculative-algorithm {algorithm} but --draft={cfg.draft} is a "
            f"{draft_kind_of(cfg.draft)} checkpoint")
    return Checkpoints(cfg.model, cfg.draft, algorithm)


def target_geometry(model) -> KVGeometry:
    c = model.config
    return KVGeometry("target", c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                      c.head_dim, model.dtype)


def load_tokenizer(model_dir: str):
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def read_requests(cfg: RunConfig, tokenizer, context_limit: int, vocab_size: int
                  ) -> tuple[list, set[int]]:
    """Rank 0 reads and tokenizes; every rank gets the same specs and the same set of
    requests to skip on --resume (or the same error). Only rank 0 reads --output: other
    nodes may not have it, and rank 0 rewrites it right after."""
    state = get_parallel()
    payload: object = None
    if state.rank == 0:
        try:
            if cfg.prompts is not None:
                rows, source = read_prompt_file(cfg.prompts), f"--prompts={cfg.prompts}"
            elif cfg.prompt is not None:
                rows, source = [{"prompt": cfg.prompt}], "--prompt"
            else:
                rows, source = read_prompt_file(str(BUILTIN_PROMPTS)), "built-in prompts"
            specs = build_specs(rows, tokenizer, cfg.max_new_tokens, cfg.temperature,
                                context_limit, vocab_size, source)
            skip = completed_indices(cfg.output) if cfg.resume and cfg.output else set()
            payload = (specs, skip)
        except ConfigError as err:
            payload = err
    payload = broadcast_object(payload)
    if isinstance(payload, ConfigError):
        raise payload
    return payload


def _load(cfg: RunConfig, dtype: str, device):
    failure.inject_fault(get_parallel().rank, "load")
    ckpt = resolve_checkpoints(cfg)
    target = load_model(ckpt.model, dtype, device)
    parts = make_proposer(cfg, ckpt.algorithm, ckpt.draft, target, device, dtype)
    check_block_size(cfg, parts, target.config.max_position_embeddings)
    return ckpt, target, parts


def check_block_size(cfg: RunConfig, parts, max_position_embeddings: int) -> None:
    """A draft block longer than the context can never be verified (a block of 100k mask
    tokens per step would run for minutes before failing): refuse it. One longer than the
    draft was trained for runs, but its later slots were never trained: warn."""
    if parts.algorithm == "NONE":
        return
    if cfg.context_length is not None:
        limit, source = cfg.context_length, "--context-length"
    else:
        limit, source = max_position_embeddings, "the model's max_position_embeddings"
    if parts.block_size > limit:
        raise ConfigError(
            f"--block-size={parts.block_size} is larger than the context limit of {limit} "
            f"tokens ({source}); use a block size of at most {limit}")
    trained = parts.draft.config.block_size if parts.draft is not None else None
    if trained and parts.block_size > trained and get_parallel().rank == 0:
        logger.warning("--block-size=%d is larger than the draft's trained block size %d: "
                       "slots past %d were never trained and will rarely be accepted",
                       parts.block_size, trained, trained)


def run_job(cfg: RunConfig) -> int:
    state = get_parallel()
    device = state.device
    free_before = measure_free_bytes(device) if device.type == "cuda" else None
    # On CPU "auto" computes in fp32: bf16 matmuls there are slow and flip near-ties between
    # a batched verify and one-token decoding. On CUDA "auto" keeps the checkpoint's dtype.
    dtype = "float32" if cfg.dtype == "auto" and device.type == "cpu" else cfg.dtype
    # Checkpoints are read per rank (each its own shards): agree before the next collective.
    failure.progress.phase = "loading"  # a signal stops every rank here at once (nothing to write)
    ckpt, target, proposer_parts = agreed(lambda: _load(cfg, dtype, device))
    failure.progress.phase = "allocating pools"
    failure.inject_fault(state.rank, "budget")  # test hook: a budget error on one rank only
    round_rows = max(1 + proposer_parts.max_drafts, proposer_parts.block_rows)
    model_limit = cfg.context_length or target.config.max_position_embeddings
    step = step_shape(cfg, target.config, target.dtype, proposer_parts.max_drafts,
                      proposer_parts.block_rows, proposer_parts.draft)
    plan = configure_memory(cfg, target_geometry(target), proposer_parts.geometry, device,
                            free_before, step, model_limit + round_rows)
    context_limit = min(model_limit, plan.max_total_tokens - round_rows + 1)
    if context_limit < 2:
        raise ConfigError(
            f"the KV pool holds {plan.max_total_tokens} tokens per rank, too few for one "
            f"round of {round_rows} rows; raise --kv-cache-memory or --max-total-tokens")
    memory = build_kv_memory(plan, target_geometry(target), proposer_parts.geometry,
                             cfg.max_running_requests, context_limit + round_rows, device,
                             target, proposer_parts.draft)
    failure.progress.phase = "startup"
    backend = make_backend(cfg.attention_backend, device)
    proposer = proposer_parts.build(memory, backend)
    # CUDA only (no peak statistics on CPU): one step at the largest batch within its price.
    check_step_peak(plan.transient_bytes, step,
                    lambda: largest_batch_step(target, proposer, memory, backend, step), device)
    if state.rank == 0:
        logger.info(
            "target %s (%s), algorithm %s%s, KV: %d tokens/rank (cells target %d + draft %d "
            "bytes), budget %d bytes/rank (%s) incl. %d bytes of step transients, context "
            "limit %d, attention %s",
            ckpt.model, str(target.dtype).replace("torch.", ""), ckpt.algorithm,
            f" draft {ckpt.draft}" if ckpt.draft else "", plan.max_total_tokens,
            plan.target_cell, plan.draft_cell, plan.budget_bytes, plan.budget_rule,
            plan.transient_bytes, context_limit, backend.name)

    tokenizer = load_tokenizer(ckpt.model)
    specs, skip = read_requests(cfg, tokenizer, context_limit, target.config.vocab_size)
    writer, refusal = None, None
    if state.rank == 0:
        try:
            writer = OutputWriter(cfg.output, cfg.overwrite, cfg.resume, tokenizer, specs)
        except ConfigError as err:
            refusal = err
    # Only rank 0 opens --output; every rank must leave with its refusal, not wait in a step.
    refusal = broadcast_object(refusal)
    if refusal is not None:
        raise refusal
    if writer is not None:
        for spec in specs:
            if spec.refused and spec.index not in skip:
                writer.add(refused_record(spec))
    runnable = [s for s in specs if not s.refused and s.index not in skip]
    limits = EngineLimits(
        max_running=cfg.max_running_requests, chunk_size=cfg.chunked_prefill_size,
        context_limit=context_limit, eos_ids=tuple(target.config.eos_token_ids), seed=cfg.seed,
        top_k=cfg.top_k, top_p=cfg.top_p)
    engine = Engine(target, proposer, memory, backend, limits)
    progress = _progress_bar(cfg, len(runnable)) if state.rank == 0 else None

    def on_finish(records: list[dict]) -> None:
        if writer is None:
            return
        for record in records:
            writer.add(record)
            if cfg.output is None:
                print(json.dumps({"id": record["id"], "text": record.get("text"),
                                  "output_ids": record["output_ids"]}), flush=True)
        if progress is not None:
            progress.update(len(records))
            done = writer.records[writer.resumed:]
            rounds = [n for r in done for n in r["accept_lens"]]
            elapsed = time.perf_counter() - start
            progress.set_postfix(
                tok_s=f"{sum(r['completion_tokens'] for r in done) / max(elapsed, 1e-9):.1f}",
                tau=f"{sum(rounds) / len(rounds):.2f}" if rounds else "-")

    start = time.perf_counter()
    try:
        engine.run(runnable, on_finish)
    finally:
        if progress is not None:
            progress.close()
        if writer is not None:
            writer.close()
    wall = time.perf_counter() - start
    if not memory.space.is_full():
        raise RuntimeError("KV rows leaked: the allocator is not full after every request ended")
    if state.rank == 0:
        summary = summarize(writer.records[writer.resumed:], wall, {
            "algorithm": ckpt.algorithm,
            "steps": engine.steps,
            "topology": {"world_size": state.world_size, "tp_size": state.tp_size,
                         "attn_tp_size": state.attn_tp_size, "attn_dp_size": state.attn_dp_size},
            "memory_plan": plan.to_dict(),
            "context_limit": context_limit,
            "dtype": str(target.dtype).replace("torch.", ""),
        })
        logger.info("summary:\n%s", format_summary(summary))
        if cfg.metrics_json:
            Path(cfg.metrics_json).write_text(json.dumps(summary, indent=2))
    return 0


def _progress_bar(cfg: RunConfig, total: int):
    import sys

    if not (cfg.progress or sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)

