"""The offline JSONL job: one client of the engine. Rank 0 reads and tokenizes the prompts,
adds every request, and every rank steps the engine until no work is left; records are
written (on rank 0) as requests finish."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_launch.comm import broadcast_object
from dspark_launch.engine.build import ASSETS, EngineArgs, build_engine
from dspark_launch.engine.heap import freeze_heap
from dspark_launch.engine.inputs import BUILTIN_PROMPTS, build_specs, read_prompt_file
from dspark_launch.engine.output import (
    OutputWriter,
    format_summary,
    read_records,
    refused_record,
    request_record,
    summarize,
)
from dspark_launch.engine.verify_policy import gather_policy_report
from dspark_launch.errors import ConfigError
from dspark_launch.log import logger
from dspark_launch.parallel import get_parallel

__all__ = ["ASSETS", "JobArgs", "run_job"]


@dataclass(frozen=True)
class JobArgs:
    """The offline job's own inputs (the CLI maps its flags here and to EngineArgs)."""

    prompt: str | None = None
    prompts: str | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    output: str | None = None
    overwrite: bool = False
    resume: bool = False
    metrics_json: str | None = None
    progress: bool = False


def read_requests(job: JobArgs, tokenizer, context_limit: int, vocab_size: int
                  ) -> tuple[list, set[int]]:
    """Rank 0 reads and tokenizes; every rank gets the same specs and the same set of
    requests to skip on --resume (or the same error). Only rank 0 reads --output: other
    nodes may not have it, and rank 0 rewrites it right after."""
    state = get_parallel()
    payload: object = None
    if state.rank == 0:
        try:
            if job.prompts is not None:
                rows, source = read_prompt_file(job.prompts), f"--prompts={job.prompts}"
            elif job.prompt is not None:
                rows, source = [{"prompt": job.prompt}], "--prompt"
            else:
                rows, source = read_prompt_file(str(BUILTIN_PROMPTS)), "built-in prompts"
            specs = build_specs(rows, tokenizer, job.max_new_tokens, job.temperature,
                                context_limit, vocab_size, source, job.top_k, job.top_p)
            skip = {record["index"] for _, record in read_records(job.output, specs)} \
                if job.resume and job.output else set()
            payload = (specs, skip)
        except ConfigError as err:
            payload = err
    payload = broadcast_object(payload)
    if isinstance(payload, ConfigError):
        raise payload
    return payload


def writable(job: JobArgs) -> ConfigError | None:
    """Why rank 0 could not write --output or --metrics-json (None: it can): checked before
    the weights load, not when the job has run (a missing folder was refused at the end, a
    read-only one with a traceback)."""
    for flag, path in (("--output", job.output), ("--metrics-json", job.metrics_json)):
        if path is None:
            continue
        p = Path(path)
        if p.is_dir():
            return ConfigError(f"{flag}={path} is a folder; give a file in it")
        if not p.parent.is_dir():
            return ConfigError(f"{flag}={path}: folder {p.parent} does not exist")
        try:
            if p.exists():
                with open(p, "a"):  # appends nothing
                    pass
            else:  # a scratch file beside where it will be (a dangling link stays as it is)
                with tempfile.NamedTemporaryFile(dir=p.resolve().parent):
                    pass
        except OSError as err:
            return ConfigError(f"{flag}={path}: cannot write there ({err.strerror})")
    return None


def run_job(args: EngineArgs, job: JobArgs) -> int:
    state = get_parallel()
    # Only rank 0 writes them (other nodes may not have the folders): its verdict for all
    refusal = broadcast_object(writable(job) if state.rank == 0 else None)
    if refusal is not None:
        raise refusal
    engine = build_engine(args)
    freeze_heap()
    target = engine.target
    specs, skip = read_requests(job, engine.tokenizer, engine.context_limit,
                                target.config.vocab_size)
    writer, refusal = None, None
    if state.rank == 0:
        try:
            writer = OutputWriter(job.output, job.overwrite, job.resume, engine.tokenizer, specs)
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
    progress = _progress_bar(job, len(runnable)) if state.rank == 0 else None

    def on_finish(records: list[dict]) -> None:
        if writer is None:
            return
        for record in records:
            writer.add(record)
            if job.output is None:
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
        for spec in runnable:
            engine.add_request(spec)  # rank 0 queues; the first step carries them everywhere
        while runnable:
            finished = [o for o in engine.step() if o.finished]
            if finished:
                on_finish([request_record(o) for o in finished])
            if not engine.has_work:
                break
        engine.settle()
    finally:
        if progress is not None:
            progress.close()
        if writer is not None:
            writer.close()
    wall = time.perf_counter() - start
    engine.flush_prefix_cache()
    if not engine.space.is_full():
        raise RuntimeError("KV rows leaked: the allocator is not full after every request ended")
    policy = gather_policy_report(engine)  # collective: every rank
    if state.rank == 0:
        summary = summarize(writer.records[writer.resumed:], wall, {
            "algorithm": engine.checkpoints.algorithm,
            "steps": engine.steps,
            "topology": {"world_size": state.world_size, "tp_size": state.tp_size,
                         "attn_tp_size": state.attn_tp_size, "attn_dp_size": state.attn_dp_size},
            "memory_plan": engine.plan.to_dict(),
            "context_limit": engine.context_limit,
            "dtype": str(target.dtype).replace("torch.", ""),
            "speculative_policy": policy,
        }, prefix_cache=engine.space.cache is not None)
        logger.info("summary:\n%s", format_summary(summary))
        if job.metrics_json:
            Path(job.metrics_json).write_text(json.dumps(summary, indent=2))
    engine.shutdown()
    return 0


def _progress_bar(job: JobArgs, total: int):
    import sys

    if not (job.progress or sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
