"""CLI flags -> one frozen, validated RunConfig.

The deprecated DP-attention spelling (`--dp-size N --enable-dp-attention`) is mapped here and
nowhere else; everything downstream reads `attn_dp_size`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field

from dspark_launch.engine.build import COUNTS
from dspark_launch.engine.gemm_choice import MODES as GEMM_MODES
from dspark_launch.errors import ConfigError, require_positive
from dspark_launch.parallel import launch_world_size, validate_layout
from dspark_launch.spec.policy import POLICIES

SPEC_ALGORITHMS = ("NONE", "NGRAM", "DFLASH", "DSPARK")
DTYPES = ("auto", "float32", "bfloat16", "float16")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(text: str, flag: str = "--kv-cache-memory") -> int:
    """'512MiB', '2GiB', '1.5GB', '123456' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{flag}={text!r} is not a size; use bytes or a number with a unit "
            f"(e.g. 536870912, 512MiB, 2GiB, 1.5GB)"
        )
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size):  # '1e400 GiB' written out: int() of it raised OverflowError
        raise ConfigError(f"{flag}={text!r} is past any memory; give a size such as 512MiB")
    value = int(size)
    if value <= 0:
        raise ConfigError(f"{flag}={text!r} is {value} bytes; give one byte or more (e.g. "
                          f"512MiB)")
    return value


@dataclass(frozen=True)
class RunConfig:
    # topology
    tp_size: int = 1
    attn_dp_size: int = 1
    device: str = "auto"
    dist_timeout: float = 300.0
    # models
    model: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    speculative_algorithm: str | None = None  # None: chosen from the draft's format
    block_size: int | None = None
    dspark_confidence_threshold: float = 0.0
    ngram_max: int = 3
    speculative_policy: str = "adaptive"
    profile_cost_curve: str = "auto"
    attention_backend: str = "auto"
    cpu_gemm: str = "auto"
    # memory
    kv_cache_memory: int | None = None
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    page_size: int = 1
    disable_prefix_cache: bool = False
    max_running_requests: int = 64
    context_length: int | None = None
    plan: bool = False
    json: bool = False
    # requests and sampling
    prompt: str | None = None
    prompts: str | None = None
    max_new_tokens: int = 128
    chunked_prefill_size: int = 512
    disable_mixed_chunk: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # output
    output: str | None = None
    overwrite: bool = False
    resume: bool = False
    metrics_json: str | None = None
    progress: bool = False
    log_all_ranks: bool = False
    log_level: str = "INFO"
    # `serve`: the OpenAI-compatible server instead of the offline job
    serve: bool = False
    host: str = "127.0.0.1"
    port: int = 30000
    max_queued_requests: int | None = None
    shutdown_grace: float = 20.0
    served_model_name: str | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def attn_tp_size(self) -> int:
        """Only for reports before launch; running code reads get_parallel().attn_tp_size."""
        return self.tp_size // self.attn_dp_size


def build_parser(serve: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_launch" + (" serve" if serve else ""),
        allow_abbrev=False,  # `--tp` must not silently mean --tp-size
        description="Speculative decoding (DFlash / DSpark block drafters) under torchrun. "
        "Run as `torchrun --nproc-per-node N -m dspark_launch [flags]`; outside torchrun it "
        "runs as a world of one. `... -m dspark_launch serve [flags]` runs an OpenAI-compatible "
        "HTTP server instead of the offline job (`serve --help`).",
    )

    def job(text: str | None) -> str | None:
        """A job-only flag's help: none under `serve`, which refuses the flag by name."""
        return argparse.SUPPRESS if serve else text

    g = p.add_argument_group("topology")
    g.add_argument("--tp-size", type=int, default=None,
                   help="tensor-parallel width (default: the torchrun world size)")
    g.add_argument("--attn-dp-size", type=int, default=None,
                   help="data-parallel attention width; attn_tp_size = tp_size / attn_dp_size "
                   "(default 1)")
    g.add_argument("--dp-size", type=int, default=None,
                   help="deprecated: with --enable-dp-attention, same as --attn-dp-size")
    g.add_argument("--enable-dp-attention", action="store_true",
                   help="deprecated: use --attn-dp-size N")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda when available (auto), else cpu")
    g.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds before a stuck collective fails the job (default 300)")
    g = p.add_argument_group("models")
    g.add_argument("--model", default=None,
                   help="target checkpoint dir (HF format); default: the embedded tiny model")
    g.add_argument("--draft", default=None, help="draft checkpoint dir (DFlash or DSpark format)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and KV dtype (auto: the checkpoint's on CUDA, float32 on CPU)")
    g.add_argument("--speculative-algorithm", type=str.upper, choices=SPEC_ALGORITHMS,
                   default=None, help="NONE, NGRAM (prompt lookup), DFLASH or DSPARK "
                   "(default: DSPARK with the embedded model, DFLASH/DSPARK from --draft's "
                   "format, else NONE)")
    g.add_argument("--block-size", type=int, default=None,
                   help="draft block size (default: the draft checkpoint's; NGRAM: 8)")
    g.add_argument("--dspark-confidence-threshold", type=float, default=0.0,
                   help="DSpark: verify each block only up to the first confidence below "
                   "this (0 = full block)")
    g.add_argument("--ngram-max", type=int, default=3, help="NGRAM: longest suffix matched")
    g.add_argument("--speculative-policy", choices=POLICIES, default="adaptive",
                   help="adaptive: cap the drafts verified per step at what measured fastest "
                   "(0 = plain decoding), the cost model deciding per request within the cap "
                   "where that measured faster; model: the cost model alone (calibrated "
                   "acceptance against the profiled cost of the target forward); fixed: "
                   "verify every draft")
    g.add_argument("--profile-cost-curve", choices=("auto", "off"), default="auto",
                   help="auto: profile the target forward's speed over a few token counts at "
                   "start-up (cached per machine and topology); off: start flat and learn "
                   "from measured steps only")
    g.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto",
                   help="auto: triton on CUDA, torch on CPU")
    g.add_argument("--cpu-gemm", choices=GEMM_MODES,
                   default="auto",
                   help="CPU projections: auto times the forward at start-up on torch's "
                   "GEMM and on each kernel with a copy of the weights (oneDNN's packed "
                   "layout; the weights transposed for MKL) and keeps the copy that saves the "
                   "most from the row count where it is faster (cached per machine); torch: "
                   "torch's GEMM only; onednn / transposed: that copy at every row count "
                   "(fp32/bf16 weights on CPU)")
    g = p.add_argument_group("memory")
    g.add_argument("--kv-cache-memory", default=None,
                   help="per-rank KV budget on CPU (bytes or 512MiB / 2GiB); default: a share "
                   "of available RAM split among this node's ranks")
    g.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="CUDA: fraction of free memory for weights + KV (default 0.85)")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="cap on KV rows per rank")
    g.add_argument("--page-size", type=int, default=1, help="KV rows per page (default 1)")
    g.add_argument("--disable-prefix-cache", action="store_true",
                   help="recompute every prompt: no radix prefix cache (shared prompt prefixes "
                   "are cached in the KV pools by default)")
    g.add_argument("--max-running-requests", type=int, default=64,
                   help="requests decoding at once per attn_dp group (default 64)")
    g.add_argument("--context-length", type=int, default=None,
                   help="longest prompt+output (default: the model's max_position_embeddings)")
    g.add_argument("--plan", action="store_true",
                   help=job("print the per-rank memory plan for this topology and exit; reads "
                            "config.json only, launches nothing"))
    g.add_argument("--json", action="store_true", help=job("with --plan: print JSON"))
    g = p.add_argument_group("requests")
    g.add_argument("--prompt", default=None, help=job("one prompt text"))
    g.add_argument("--prompts", default=None,
                   help=job("JSONL ({'prompt'|'input_ids', 'id', and any of max_new_tokens "
                            "(or max_tokens), temperature, top_p, top_k, seed, min_tokens, "
                            "stop_token_ids, ignore_eos}) or plain text, one prompt per line"))
    g.add_argument("--max-new-tokens", type=int, default=128, help=job(None))
    g.add_argument("--chunked-prefill-size", type=int, default=512,
                   help="prefill tokens per step per attn_dp group")
    g.add_argument("--disable-mixed-chunk", action="store_true",
                   help="a step prefills or decodes, never both: prefill chunks run first, "
                   "alone, while decodes wait (SGLang's default; by default chunks ride along "
                   "with the decodes of the same step)")
    g.add_argument("--temperature", type=float, default=0.0, help=job("0 = greedy"))
    g.add_argument("--top-p", type=float, default=1.0, help=job(None))
    g.add_argument("--top-k", type=int, default=0, help=job("0 or -1 = off"))
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--output", default=None,
                   help=job("JSONL, one line per request, input order"))
    g.add_argument("--overwrite", action="store_true", help=job("allow replacing --output"))
    g.add_argument("--resume", action="store_true",
                   help=job("skip requests already completed in --output"))
    g.add_argument("--metrics-json", default=None, help=job("write the rank-0 summary here"))
    g.add_argument("--progress", action="store_true",
                   help=job("progress bar on rank 0 even when stderr is not a TTY"))
    g.add_argument("--log-all-ranks", action="store_true",
                   help="log from every rank, each line prefixed with its rank")
    g.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    if serve:
        add_server_flags(p)
    return p


def add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server (`serve`: an OpenAI-compatible HTTP server on rank 0)")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=30000, help="port to bind (default 30000)")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests waiting for their first token beyond this get HTTP 503 with "
                   "Retry-After (default: no limit)")
    g.add_argument("--shutdown-grace", type=float, default=20.0,
                   help="seconds in-flight requests may finish after SIGTERM/SIGINT before "
                   "they are aborted (default 20: plain torchrun sends SIGKILL 30 s after "
                   "its SIGTERM, and a killed server answers nobody)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model, or dspark-tiny)")


def resolve_attn_dp(ns: argparse.Namespace) -> tuple[int, tuple[str, ...]]:
    """Map both spellings of DP attention to attn_dp_size; refuse them together."""
    legacy = ns.dp_size is not None or ns.enable_dp_attention
    if ns.attn_dp_size is not None and legacy:
        raise ConfigError(
            f"--attn-dp-size={ns.attn_dp_size} and the deprecated --dp-size={ns.dp_size} "
            f"--enable-dp-attention={ns.enable_dp_attention} were both given; use only "
            f"--attn-dp-size"
        )
    if not legacy:
        return (ns.attn_dp_size or 1), ()
    if not ns.enable_dp_attention:
        raise ConfigError(
            f"--dp-size={ns.dp_size} without --enable-dp-attention asks for replica data "
            f"parallelism, which is not supported; for DP attention use --attn-dp-size "
            f"{ns.dp_size}"
        )
    if ns.dp_size is None:
        raise ConfigError(
            "--enable-dp-attention needs --dp-size N (or use --attn-dp-size N)"
        )
    warning = (
        f"--dp-size {ns.dp_size} --enable-dp-attention is deprecated; "
        f"use --attn-dp-size {ns.dp_size}"
    )
    return ns.dp_size, (warning,)


def resolve_config(argv: list[str] | None = None, world_size: int | None = None) -> RunConfig:
    """Parse and validate once. argparse's own errors exit 2 with usage; ours raise ConfigError."""
    argv = list(sys.argv[1:] if argv is None else argv)
    serve = bool(argv) and argv[0] == "serve"
    parser = build_parser(serve)
    ns = parser.parse_args(argv[1:] if serve else argv)
    if serve:
        validate_server_flags(ns, parser)
    world = launch_world_size() if world_size is None else world_size
    attn_dp_size, warnings = resolve_attn_dp(ns)
    tp_size = ns.tp_size if ns.tp_size is not None else world
    if ns.plan:
        validate_layout(tp_size=tp_size, attn_dp_size=attn_dp_size)  # any size: nothing launches
    else:
        validate_layout(tp_size=tp_size, attn_dp_size=attn_dp_size, world_size=world)
    for name in COUNTS:  # EngineArgs checks them too, by field name (for LLM())
        require_positive("--" + name.replace("_", "-"), getattr(ns, name))
    require_positive("--max-new-tokens", ns.max_new_tokens)
    require_positive("--temperature", ns.temperature, allow_zero=True)
    if ns.top_k == -1:  # vLLM/SGLang spelling of "off"
        ns.top_k = 0
    require_positive("--top-k", ns.top_k, allow_zero=True)
    require_positive("--dist-timeout", ns.dist_timeout)
    if not 0.0 < ns.top_p <= 1.0:
        raise ConfigError(f"--top-p={ns.top_p} must be in (0, 1]")
    if not 0.0 < ns.mem_fraction_static < 1.0:
        raise ConfigError(f"--mem-fraction-static={ns.mem_fraction_static} must be in (0, 1)")
    if not 0.0 <= ns.dspark_confidence_threshold <= 1.0:
        raise ConfigError(
            f"--dspark-confidence-threshold={ns.dspark_confidence_threshold} must be in [0, 1]"
        )
    if ns.prompt is not None and ns.prompts is not None:
        raise ConfigError("--prompt and --prompts were both given; use one")
    if ns.json and not ns.plan:
        raise ConfigError("--json only applies to --plan")
    if ns.resume and ns.overwrite:
        raise ConfigError("--resume and --overwrite were both given: --resume continues "
                          "--output, --overwrite replaces it; use one")
    if ns.resume and ns.output is None:
        raise ConfigError("--resume needs --output FILE (the requests it skips live there)")
    if ns.draft is not None and ns.model is None:
        raise ConfigError(f"--draft={ns.draft} needs --model (the target it was trained for)")
    algorithm = ns.speculative_algorithm
    if algorithm in ("DFLASH", "DSPARK") and ns.draft is None and ns.model is not None:
        raise ConfigError(f"--speculative-algorithm {algorithm} needs --draft DIR")
    if algorithm in ("NONE", "NGRAM") and ns.draft is not None:
        raise ConfigError(
            f"--draft={ns.draft} was given but --speculative-algorithm is {algorithm}; "
            f"use DFLASH or DSPARK, or drop --draft"
        )
    kv_bytes = None if ns.kv_cache_memory is None else parse_bytes(ns.kv_cache_memory)
    return RunConfig(
        tp_size=tp_size,
        attn_dp_size=attn_dp_size,
        device=ns.device,
        dist_timeout=ns.dist_timeout,
        model=ns.model,
        draft=ns.draft,
        dtype=ns.dtype,
        speculative_algorithm=algorithm,
        block_size=ns.block_size,
        dspark_confidence_threshold=ns.dspark_confidence_threshold,
        ngram_max=ns.ngram_max,
        speculative_policy=ns.speculative_policy,
        profile_cost_curve=ns.profile_cost_curve,
        attention_backend=ns.attention_backend,
        cpu_gemm=ns.cpu_gemm,
        kv_cache_memory=kv_bytes,
        mem_fraction_static=ns.mem_fraction_static,
        max_total_tokens=ns.max_total_tokens,
        page_size=ns.page_size,
        disable_prefix_cache=ns.disable_prefix_cache,
        max_running_requests=ns.max_running_requests,
        context_length=ns.context_length,
        plan=ns.plan,
        json=ns.json,
        prompt=ns.prompt,
        prompts=ns.prompts,
        max_new_tokens=ns.max_new_tokens,
        chunked_prefill_size=ns.chunked_prefill_size,
        disable_mixed_chunk=ns.disable_mixed_chunk,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        output=ns.output,
        overwrite=ns.overwrite,
        resume=ns.resume,
        metrics_json=ns.metrics_json,
        progress=ns.progress,
        log_all_ranks=ns.log_all_ranks,
        log_level=ns.log_level,
        warnings=warnings,
        **({"serve": True, "host": ns.host, "port": ns.port,
            "max_queued_requests": ns.max_queued_requests, "shutdown_grace": ns.shutdown_grace,
            "served_model_name": ns.served_model_name} if serve else {}),
    )


def validate_server_flags(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for flag in ("prompt", "prompts", "output", "resume", "plan", "json"):
        if getattr(ns, flag):
            raise ConfigError(f"--{flag} does not apply to `serve` (requests come over HTTP)")
    # Accepted and ignored before: a server given --temperature 0.7 answered greedily
    for names, why in (
            (("temperature", "top_p", "top_k", "max_new_tokens"), "each request sets its own "
             "(unset fields take the checkpoint's generation_config.json)"),
            (("metrics_json", "overwrite", "progress"), "it writes no job output (its "
             "metrics are at GET /metrics)")):
        for name in names:
            if getattr(ns, name) != parser.get_default(name):
                raise ConfigError(f"--{name.replace('_', '-')} does not apply to `serve`: {why}")
    if not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port={ns.port} must be in [0, 65535]")
    require_positive("--max-queued-requests", ns.max_queued_requests)
    require_positive("--shutdown-grace", ns.shutdown_grace, allow_zero=True)
