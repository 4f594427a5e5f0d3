"""EngineArgs -> a running Engine on every rank: models, memory plan, pools, proposer, tokenizer.

Called on every rank after init_parallel_runtime. The CLI (args.py) and the Python API map
their own inputs to EngineArgs; the engine never sees argparse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dspark_launch import failure
from dspark_launch.attention import make_backend
from dspark_launch.comm import agreed
from dspark_launch.engine.engine import Engine, EngineLimits
from dspark_launch.engine.gemm_choice import choose_gemm
from dspark_launch.engine.verify_policy import build_verify_policy
from dspark_launch.engine.warmup import largest_batch_step
from dspark_launch.errors import ConfigError, require_positive
from dspark_launch.log import logger
from dspark_launch.memory.budget import configure_memory, context_of_pool, measure_free_bytes
from dspark_launch.memory.build import build_kv_memory
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.radix_cache import RadixCache
from dspark_launch.memory.transients import check_step_peak, step_shape
from dspark_launch.models.config import run_dtype
from dspark_launch.models.layers.gemm import NEVER
from dspark_launch.models.loader import load_model
from dspark_launch.parallel import get_parallel
from dspark_launch.spec.factory import draft_kind_of, make_proposer

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "tiny"


# EngineArgs' counts: each >= 1 where set (args.py checks the flags by these names too)
COUNTS = ("page_size", "max_running_requests", "chunked_prefill_size", "max_total_tokens",
          "block_size", "context_length", "ngram_max")


@dataclass(frozen=True)
class EngineArgs:
    """Everything the engine needs, with the CLI flag names (see args.py for their help)."""

    model: str | None = None  # None: the embedded tiny model (and its draft)
    draft: str | None = None
    speculative_algorithm: str | None = None  # None: from the draft's format (NONE without)
    block_size: int | None = None
    dspark_confidence_threshold: float = 0.0
    ngram_max: int = 3
    speculative_policy: str = "adaptive"  # or "model" or "fixed" (spec/policy.py)
    profile_cost_curve: str = "auto"  # or "off"
    dtype: str = "auto"
    device: str = "auto"  # informational: the device is chosen by init_parallel_runtime
    attention_backend: str = "auto"
    cpu_gemm: str = "auto"  # or "torch" or "onednn" (engine/gemm_choice.py)
    kv_cache_memory: int | None = None
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    page_size: int = 1
    disable_prefix_cache: bool = False
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    disable_mixed_chunk: bool = False
    context_length: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        # LLM() builds these without the CLI's checks: chunked_prefill_size=0 scheduled
        # nothing and ended every request at once, page_size=0 divided by zero
        for name in COUNTS:
            require_positive(name, getattr(self, name))


@dataclass(frozen=True)
class Checkpoints:
    model: str
    draft: str | None
    algorithm: str


def resolve_checkpoints(args: EngineArgs) -> Checkpoints:
    """Which target, draft and algorithm this run uses (the embedded model when no model)."""
    if args.model is None:
        algorithm = args.speculative_algorithm or "DSPARK"
        model = ASSETS / "target"
        if not (model / "config.json").is_file():
            raise ConfigError(f"no --model given and the embedded model is missing at {model}")
        draft = None
        if algorithm in ("DFLASH", "DSPARK"):
            draft = ASSETS / algorithm.lower()
            if not (draft / "config.json").is_file():
                raise ConfigError(f"the embedded {algorithm} draft is missing at {draft}")
        return Checkpoints(str(model), None if draft is None else str(draft), algorithm)
    algorithm = args.speculative_algorithm
    if algorithm is None:
        algorithm = draft_kind_of(args.draft) if args.draft else "NONE"
    if algorithm in ("DFLASH", "DSPARK") and draft_kind_of(args.draft) != algorithm:
        raise ConfigError(
            f"--speculative-algorithm {algorithm} but --draft={args.draft} is a "
            f"{draft_kind_of(args.draft)} checkpoint")
    return Checkpoints(args.model, args.draft, algorithm)


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


def generation_defaults(model_dir: str) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json (SamplingParams names)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out = {k: cfg[k] for k in ("temperature", "top_p", "top_k") if k in cfg}
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def _load(args: EngineArgs, dtype: str, device):
    failure.inject_fault(get_parallel().rank, "load")
    ckpt = resolve_checkpoints(args)
    target = load_model(ckpt.model, dtype, device)
    parts = make_proposer(args, ckpt.algorithm, ckpt.draft, target, device, dtype)
    check_block_size(args, parts, target.config.max_position_embeddings)
    return ckpt, target, parts


def check_block_size(args: EngineArgs, parts, max_position_embeddings: int) -> None:
    """A draft block longer than the context can never be verified (a block of 100k mask
    tokens per step would run for minutes before failing): refuse it. One longer than the
    draft was trained for runs, but its later slots were never trained: warn."""
    if parts.algorithm == "NONE":
        return
    if args.context_length is not None:
        limit, source = args.context_length, "--context-length"
    else:
        limit, source = max_position_embeddings, "the model's max_position_embeddings"
    if parts.block_size > limit:
        block = (f"--block-size={parts.block_size}" if args.block_size is not None else
                 f"the draft's block size {parts.block_size}" if parts.draft is not None else
                 f"the default block size {parts.block_size}")
        raise ConfigError(
            f"{block} is larger than the context limit of {limit} tokens ({source}); pass "
            f"--block-size N with N at most {limit}")
    trained = parts.draft.config.block_size if parts.draft is not None else None
    if trained and parts.block_size > trained and get_parallel().rank == 0:
        logger.warning("--block-size=%d is larger than the draft's trained block size %d: "
                       "slots past %d were never trained and will rarely be accepted",
                       parts.block_size, trained, trained)


def build_engine(args: EngineArgs) -> Engine:
    """Every rank, after the parallel state exists. Raises ConfigError on every rank alike."""
    state = get_parallel()
    device = state.device
    free_before = measure_free_bytes(device) if device.type == "cuda" else None
    dtype = run_dtype(args.dtype, device.type == "cpu")
    # Checkpoints are read per rank (each its own shards): agree before the next collective.
    failure.progress.phase = "loading"  # a signal stops every rank here at once (nothing to write)
    ckpt, target, parts = agreed(lambda: _load(args, dtype, device))
    failure.progress.phase = "allocating pools"
    failure.inject_fault(state.rank, "budget")  # test hook: a budget error on one rank only
    round_rows = max(1 + parts.max_drafts, parts.block_rows)
    model_limit = args.context_length or target.config.max_position_embeddings
    if model_limit < 2:
        raise ConfigError(f"a context of {model_limit} tokens (--context-length, or the "
                          f"model's max_position_embeddings) holds no prompt and a new token; "
                          f"give 2 or more")
    step = step_shape(args, target.config, target.dtype, parts.max_drafts, parts.block_rows,
                      parts.draft)
    plan = configure_memory(args, target_geometry(target), parts.geometry, device, free_before,
                            step, model_limit + round_rows)
    context_limit = context_of_pool(plan.max_total_tokens, model_limit, round_rows)
    memory = build_kv_memory(plan, target_geometry(target), parts.geometry,
                             args.max_running_requests, context_limit + round_rows, device,
                             target, parts.draft)
    if not args.disable_prefix_cache:
        # Inside the priced pools: the cache holds pages of the same allocator.
        memory.space.attach_cache(RadixCache(memory.space.allocator))
    failure.progress.phase = "startup"
    backend = make_backend(args.attention_backend, device)
    proposer = parts.build(memory, backend)
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
    limits = EngineLimits(
        max_running=args.max_running_requests, chunk_size=args.chunked_prefill_size,
        context_limit=context_limit, eos_ids=tuple(target.config.eos_token_ids), seed=args.seed,
        mixed_chunk=not args.disable_mixed_chunk)
    engine = Engine(target, proposer, memory, backend, limits, load_tokenizer(ckpt.model))
    # Before the cost curve: it times the forward on the kernel chosen here.
    _, gemm_source = choose_gemm(engine, args.cpu_gemm)
    if state.rank == 0 and device.type == "cpu":
        logger.info("cpu gemm: %s (%s)", "torch's" if engine.gemm_from_rows == NEVER else
                    f"{engine.gemm_kernel} copy of the weights from {engine.gemm_from_rows} rows",
                    gemm_source)
    engine.checkpoints = ckpt
    engine.plan = plan
    engine.generation_defaults = generation_defaults(ckpt.model)
    engine.policy = build_verify_policy(engine, args.speculative_policy, args.profile_cost_curve,
                                        ckpt.draft, ckpt.algorithm)
    return engine
