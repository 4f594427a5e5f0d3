"""Prompts in: JSONL or plain text, read and tokenized on rank 0, then broadcast.

A line that cannot be read as a request is a configuration error naming the file and line;
a request that is readable but cannot run (empty, or longer than the context) is refused on
its own line of output with a reason, and the others proceed.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_launch.engine.params import (
    ParamError,
    SamplingParams,
    not_unicode,
    outside_vocab,
    refusal,
)
from dspark_launch.engine.request import RequestSpec
from dspark_launch.errors import ConfigError
from dspark_launch.log import logger

# Code windows from the embedded model's held-out files (scripts/make_prompts.py).
BUILTIN_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "prompts" / "heldout.jsonl"


def read_prompt_file(path: str) -> list[dict]:
    """Raw request dicts from a JSONL file (named *.jsonl, or whose first line is a JSON
    object), or one prompt per line of plain text."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--prompts={path}: cannot read the file ({err})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts={path}: the file holds no prompts")
    # A *.jsonl name is a promise: its lines are JSON, a bad one is refused by number. Other
    # names are sniffed: a first line that is a JSON object makes the file JSONL (one that
    # only starts with "{", such as a line of code, does not).
    jsonl = path.endswith(".jsonl") or _json_object(lines[0][1])
    rows: list[dict] = []
    for n, line in lines:
        if not jsonl:
            rows.append({"prompt": line, "_line": n})
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--prompts={path} line {n}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("input_ids" in row):
            raise ConfigError(
                f"--prompts={path} line {n}: expected an object with exactly one of "
                f"'prompt' (text) or 'input_ids' (list of ints)")
        row["_line"] = n
        rows.append(row)
    return rows


# What a line may set beyond its prompt: the token-level fields the engine applies (the flags
# give the defaults). max_new_tokens is the job's name for max_tokens; either is taken.
LINE_SAMPLING = ("temperature", "top_p", "top_k", "seed", "min_tokens", "stop_token_ids",
                 "ignore_eos")
LINE_KEYS = ("prompt", "input_ids", "id", "max_new_tokens", "max_tokens", *LINE_SAMPLING)
# Request fields of the server and the LLM API that work on text, which a job never makes.
TEXT_ONLY = ("stop", "include_stop_str_in_output", "skip_special_tokens")


def _int_field(row: dict, key: str, default: int, where: str) -> int:
    """A line's integer field (the sampling fields are SamplingParams' to check)."""
    value = row.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key}={value!r} must be an integer")
    return value


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def build_specs(
    rows: list[dict],
    tokenizer,
    max_new_tokens: int,
    temperature: float,
    context_limit: int,
    vocab_size: int,
    source: str = "--prompts",
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[RequestSpec]:
    specs: list[RequestSpec] = []
    unknown: dict[str, list[int]] = {}  # key -> lines: metadata, or a misspelt field
    defaults = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    for index, row in enumerate(rows):
        line = row.get("_line", index + 1)
        where = f"{source} line {line}"
        for key in row.keys() - {"_line", *LINE_KEYS}:
            if key in TEXT_ONLY:
                raise ConfigError(f"{where}: {key!r} works on text, which the server and the "
                                  f"LLM API make and a job does not (a job stops at EOS, "
                                  f"max_new_tokens and stop_token_ids)")
            unknown.setdefault(key, []).append(line)
        if "max_new_tokens" in row and "max_tokens" in row:
            raise ConfigError(f"{where}: give max_new_tokens or max_tokens, not both")
        name = "max_tokens" if "max_tokens" in row else "max_new_tokens"
        mnt = _int_field(row, name, max_new_tokens, where)
        if mnt <= 0:
            raise ConfigError(f"{where}: {name}={mnt} must be >= 1")
        text = row.get("prompt")
        if "input_ids" in row:
            ids = row["input_ids"]
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ConfigError(f"{where}: input_ids must be a list of integers")
            if bad := outside_vocab(ids, vocab_size):
                raise ConfigError(
                    f"{where}: input_ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        else:
            if not isinstance(text, str):
                raise ConfigError(f"{where}: prompt must be a string")
            if tokenizer is None:
                raise ConfigError(f"{where}: a text prompt needs the checkpoint's "
                                  f"tokenizer.json (or give input_ids)")
            if why := not_unicode(text):
                raise ConfigError(f"{where}: prompt {why}")
            ids = tokenizer.encode(text).ids if text else []
        try:
            params = SamplingParams(max_tokens=mnt, **{
                **defaults, **{k: row[k] for k in LINE_SAMPLING if k in row}})
        except ParamError as err:
            raise ConfigError(f"{where}: {err}") from None
        specs.append(RequestSpec(
            index=index, rid=str(row.get("id", index)), prompt_ids=tuple(ids), params=params,
            prompt_text=text, refused=refusal(ids, params, context_limit, vocab_size)))
    if unknown:
        named = ", ".join(f"{k!r} ({len(v)} line{'s' if len(v) > 1 else ''} from line {v[0]})"
                          for k, v in sorted(unknown.items()))
        logger.warning("%s: ignored %s: a line takes %s", source, named, ", ".join(LINE_KEYS))
    return specs
