"""Results out: one JSONL line per request (flushed as it finishes, input order at the end)
and the rank-0 summary."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from dspark_launch.engine.request import RequestOutput, RequestSpec
from dspark_launch.errors import ConfigError
from dspark_launch.failure import inject_fault, signals_held
from dspark_launch.spec.policy import format_policy


def request_record(out: RequestOutput) -> dict:
    """Everything about a finished request (the same on every rank)."""
    end = out.finished_at or out.arrival
    ttft = (out.first_token_at - out.arrival) if out.first_token_at else None
    n_out = len(out.output_ids)
    tpot = (end - out.first_token_at) / (n_out - 1) if out.first_token_at and n_out > 1 else None
    return {
        "index": out.index,
        "id": out.rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": n_out,
        "output_ids": list(out.output_ids),
        "finish_reason": out.finish_reason,
        "accept_lens": list(out.accept_lens),
        "rounds": len(out.accept_lens),
        "drafts": out.drafts,
        "accepted_drafts": out.accepted_drafts,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "latency_s": end - out.arrival,
        "draft_s": out.draft_s,
        "verify_s": out.verify_s,
        "preemptions": out.preemptions,
        "cached_tokens": out.cached_tokens,
        "prefill_tokens": out.prefill_tokens,
    }


def refused_record(spec: RequestSpec) -> dict:
    return {
        "index": spec.index, "id": spec.rid, "prompt_tokens": len(spec.prompt_ids),
        "completion_tokens": 0, "output_ids": [], "finish_reason": "refused",
        "error": spec.refused, "accept_lens": [], "rounds": 0, "drafts": 0,
        "accepted_drafts": 0, "ttft_s": None, "tpot_s": None,
        "latency_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "preemptions": 0,
        "cached_tokens": 0, "prefill_tokens": 0,
    }


def read_records(path: str, specs: list[RequestSpec] | None = None) -> list[tuple[str, dict]]:
    """The finished lines of an output file to resume, as (line, record): every line a JSON
    object with an integer "index", but a torn last one (a crash mid-write: that request runs
    again). Anything else is no output of this tool's, and resuming rewrites the file: its
    lines were dropped as if torn (a notes file, or the --prompts file, given as --output
    was replaced by one record). With `specs`, a record whose prompt is not the job's at its
    index is another job's output, and refused too, and so is one that ran with other
    sampling settings (two runs' records would mix in one file)."""
    p = Path(path)
    if not p.exists():
        return []
    fix = "pass --overwrite to replace it, or choose another --output"
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, IsADirectoryError) as err:
        raise ConfigError(f"--output={path} cannot be resumed ({err}); {fix}") from None
    prompts = {s.index: s for s in specs or []}
    kept = []
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines):
                break  # torn by a crash: that request runs again
            raise ConfigError(f"--output={path} line {n} is not JSON, so not an output of "
                              f"this tool's; {fix}") from None
        if not isinstance(record, dict) or type(record.get("index")) is not int:
            raise ConfigError(f"--output={path} line {n} is no request record (a JSON object "
                              f"with an integer \"index\"); {fix}")
        spec = prompts.get(record["index"])
        if specs is not None and spec is None:
            raise ConfigError(f"--output={path} line {n}: request {record['index']} there is "
                              f"not one of this job's {len(specs)} (--resume continues the "
                              f"job that wrote the file); {fix}")
        if spec is not None and (why := _differs(record, spec)):
            raise ConfigError(f"--output={path} line {n}: request {record['index']} there ran "
                              f"{why} (--resume continues the job that wrote the file, with "
                              f"its prompts and flags); {fix}")
        kept.append((line, record))
    return kept


def sampling_record(spec: RequestSpec) -> dict:
    """The settings a request ran with, as its output line keeps them (for --resume)."""
    p = spec.params
    return {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k, "seed": p.seed, "min_tokens": p.min_tokens,
            "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos}


def _differs(record: dict, spec: RequestSpec) -> str | None:
    """How the record's request differs from spec's, as OutputWriter.add wrote it (None:
    the same; a record written before its settings were kept is checked by its prompt)."""
    if spec.prompt_text is not None:
        same = record.get("prompt") == spec.prompt_text
    else:
        same = record.get("input_ids") == list(spec.prompt_ids)
    if not same:
        return "another prompt than this job's"
    # A record keeps the settings of its version: those it has are compared.
    ran, asked = record.get("sampling") or {}, sampling_record(spec)
    if changed := ", ".join(f"{k}={ran[k]!r} (now {v!r})" for k, v in asked.items()
                            if k in ran and ran[k] != v):
        return f"with other sampling settings: {changed}"
    return None


class OutputWriter:
    """Rank 0 only. Lines are appended and flushed as requests finish, so a crash loses nothing
    that was done; close() rewrites the file in input order. Every rewrite is atomic, so a crash
    at any point leaves the old file or the new one, whole: no finished line is ever lost."""

    def __init__(self, path: str | None, overwrite: bool, resume: bool, tokenizer=None,
                 specs: list[RequestSpec] | None = None) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self.prompts = {s.index: s for s in specs or []}
        self.records: list[dict] = []
        self.resumed = 0  # records carried over from an earlier run (not this run's work)
        self._file = None
        if path is None:
            return
        p = Path(path)
        if p.exists() and not (overwrite or resume):
            raise ConfigError(
                f"--output={path} already exists; pass --overwrite to replace it or --resume "
                f"to continue it")
        if p.parent and not p.parent.exists():
            raise ConfigError(f"--output={path}: folder {p.parent} does not exist")
        if resume and p.exists():
            kept = read_records(path, specs)
            self.records = [record for _, record in kept]
            self.resumed = len(self.records)
            # Drop a torn last line (a crash mid-write) so appends start on a line of their
            # own, without ever truncating the file in place.
            replace_atomically(p, [line for line, _ in kept])
            self._file = open(p, "a", encoding="utf-8")  # noqa: SIM115 - held across the run
        else:
            self._file = open(p, "w", encoding="utf-8")  # noqa: SIM115 - held across the run

    def add(self, record: dict) -> dict:
        spec = self.prompts.get(record["index"])
        if spec is not None:
            if spec.prompt_text is not None:
                record["prompt"] = spec.prompt_text
            else:
                record["input_ids"] = list(spec.prompt_ids)
            record["sampling"] = sampling_record(spec)
        if self.tokenizer is not None:
            record["text"] = self.tokenizer.decode(record["output_ids"])
        self.records.append(record)
        self._write(record)
        return record

    def _write(self, record: dict) -> None:
        if self._file is not None:
            with signals_held():  # a second Ctrl-C waits for the line to be whole
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        ordered = sorted(self.records, key=lambda r: r["index"])
        replace_atomically(Path(self.path), [json.dumps(r) for r in ordered])


def replace_atomically(path: Path, lines: list[str]) -> None:
    """Replace `path` by `lines`: write a temp file in the same folder (so the rename cannot
    cross file systems), fsync it, rename it over `path`, fsync the folder. A crash at any
    point leaves either the old file or the new one, whole (at worst a stale temp file)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for n, line in enumerate(lines):
                if n == len(lines) // 2:
                    inject_fault(None, "rewrite-partial")
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        inject_fault(None, "rewrite-written")
        os.replace(tmp, path)
        inject_fault(None, "rewrite-replaced")
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself survives a power loss
        finally:
            os.close(folder)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def summarize(records: list[dict], wall_s: float, extra: dict, prefix_cache: bool = True
              ) -> dict:
    """The rank-0 summary: throughput, tau and its histogram, latency percentiles, and the
    prefix cache's hit rate (None without a cache)."""
    ran = [r for r in records if r["finish_reason"] != "refused"]
    rounds = [n for r in ran for n in r["accept_lens"]]
    out_tokens = sum(r["completion_tokens"] for r in ran)
    ttft = [r["ttft_s"] for r in ran if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ran if r["tpot_s"] is not None]
    cached = sum(r.get("cached_tokens", 0) for r in ran)
    computed = sum(r.get("prefill_tokens", 0) for r in ran)
    drafts = sum(r.get("drafts", 0) for r in ran)  # a resumed record may predate them
    accepted = sum(r.get("accepted_drafts", 0) for r in ran)
    return {
        "requests": len(records),
        "refused": len(records) - len(ran),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in records)),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ran),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "rounds": len(rounds),
        "mean_tau": sum(rounds) / len(rounds) if rounds else None,
        "tau_histogram": {str(k): v for k, v in sorted(Counter(rounds).items())},
        "drafts": drafts,
        "accepted_drafts": accepted,
        "acceptance_rate": accepted / drafts if drafts else None,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "tpot_p50_s": _percentile(tpot, 50),
        "tpot_p99_s": _percentile(tpot, 99),
        # Prefill positions taken from the prefix cache vs computed, over every admission.
        "cached_tokens": cached,
        "prefill_tokens": computed,
        "prefix_hit_rate": cached / (cached + computed) if prefix_cache and cached + computed
        else None,
        **extra,
    }


def format_summary(s: dict) -> str:
    tau = "n/a" if s["mean_tau"] is None else f"{s['mean_tau']:.2f}"
    tps = "n/a" if s["output_tokens_per_s"] is None else f"{s['output_tokens_per_s']:.1f}"
    lines = [
        f"requests {s['requests']} (refused {s['refused']}), tokens in {s['prompt_tokens']} "
        f"out {s['output_tokens']}, wall {s['wall_s']:.2f}s, {tps} tok/s",
        f"algorithm {s.get('algorithm')}, mean tau {tau} over {s['rounds']} rounds, "
        f"histogram {s['tau_histogram']}",
    ]
    if s.get("acceptance_rate") is not None:
        lines.append(f"drafts: {s['accepted_drafts']} of {s['drafts']} verified were accepted "
                     f"({s['acceptance_rate']:.1%})")
    if s.get("prefix_hit_rate") is not None:
        lines.append(f"prefix cache: {s['cached_tokens']} prefill tokens cached, "
                     f"{s['prefill_tokens']} computed, hit rate {s['prefix_hit_rate']:.1%}")
    if s["ttft_p50_s"] is not None:
        lines.append(f"TTFT p50 {s['ttft_p50_s'] * 1e3:.1f} ms p99 {s['ttft_p99_s'] * 1e3:.1f} ms")
    if s["tpot_p50_s"] is not None:
        lines.append(f"TPOT p50 {s['tpot_p50_s'] * 1e3:.1f} ms p99 {s['tpot_p99_s'] * 1e3:.1f} ms")
    if s.get("speculative_policy"):
        lines.append(format_policy(s["speculative_policy"]))
    return "\n".join(lines)
