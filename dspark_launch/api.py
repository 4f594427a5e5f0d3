"""The in-process SPMD Python API: `from dspark_launch import LLM, SamplingParams`.

Construct `LLM` on every rank of a torchrun program (or in a plain process: a world of one) and
call `generate` on every rank with the same arguments; every rank returns the same outputs.
An already initialised default process group is joined as it is and left alone at shutdown
(only the groups the engine made are destroyed); otherwise one is initialised and destroyed.

    llm = LLM()  # the embedded tiny model with its DSpark draft, as the CLI
    outs = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].accept_lens
    llm.shutdown()  # or `with LLM(...) as llm:`
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import numbers
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from dspark_launch.args import parse_bytes
from dspark_launch.comm import ranks_by
from dspark_launch.engine.build import EngineArgs, build_engine
from dspark_launch.engine.params import SamplingParams, not_unicode
from dspark_launch.engine.request import RequestSpec
from dspark_launch.errors import ConfigError
from dspark_launch.models.loader import INDEX_FILE, checkpoint_files
from dspark_launch.outputs import CompletionOutput, OutputProcessor
from dspark_launch.parallel import (
    GAVE_UP,
    NotJoined,
    begin_runtime,
    check_in,
    destroy_parallel_runtime,
    get_parallel,
    init_parallel_runtime,
    is_initialized,
    launch_world_size,
)

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "NotSPMD"]

DEFAULT_DIST_TIMEOUT_S = 300.0
DEVICES = ("auto", "cpu", "cuda")  # the CLI's --device choices
# Gloo keeps a timeout in signed 64-bit microseconds: past this, init_process_group refuses it.
MAX_DIST_TIMEOUT_S = float((2**63 - 1) // 10**6)


@dataclass(frozen=True)
class _Topology:
    """What init_parallel_runtime reads."""

    tp_size: int
    attn_dp_size: int
    device: str
    dist_timeout: float
    timeout_name: str = "dist_timeout"  # as the API user spells it, in a rendezvous timeout


def default_sampling(engine) -> dict:
    """generation_config.json as SamplingParams fields (max_new_tokens -> max_tokens)."""
    defaults = dict(engine.generation_defaults)
    path = Path(engine.checkpoints.model) / "generation_config.json"
    with contextlib.suppress(OSError, ValueError):
        max_new = json.loads(path.read_text()).get("max_new_tokens")
        if isinstance(max_new, int) and max_new > 0:
            defaults["max_tokens"] = max_new
    return defaults


SPMD_RULE = "LLM() and generate() are SPMD, every rank calls them with the same arguments"


class NotSPMD(RuntimeError):
    """The ranks were asked different things (LLM() or generate() is SPMD: every rank calls
    it with the same arguments and gets the same result)."""


class LLM:
    live: weakref.ref | None = None  # the LLM of this process that holds the engine
    # The parallel runtime was made by an LLM (not the user's program) and not destroyed yet:
    # where that LLM was dropped without shutdown(), the next one makes a fresh runtime.
    _made_runtime = False

    def __init__(self, model: str | None = None, draft: str | None = None, *,
                 tp_size: int | None = None, attn_dp_size: int = 1,
                 dist_timeout: float = DEFAULT_DIST_TIMEOUT_S, **engine_args) -> None:
        """`engine_args` are EngineArgs fields (speculative_algorithm, block_size, dtype,
        device, kv_cache_memory ("256MiB" or bytes), max_running_requests, seed, ...)."""
        begin_runtime()  # first: counted on every rank, whatever fails below
        self._owns_runtime = False
        if "device" in engine_args:  # torch.device("cuda") as "cuda"
            engine_args["device"] = _device_name(engine_args["device"])
        device = engine_args.get("device", "auto")
        try:
            _check_arguments(engine_args, tp_size, attn_dp_size, dist_timeout)
            refused = None
        except (ConfigError, TypeError, ValueError) as err:  # agree()'s, below
            # Said at the check-in, as a refusal after the join is: a peer left waiting
            # dist_timeout for a rank that raised here (and caught it) waited 300 s by default.
            # The join takes the defaults for what it cannot use.
            refused = err
            if _world_size() == 1:
                raise
            tp_size, attn_dp_size = None, 1
            dist_timeout = dist_timeout if _timeout_ok(dist_timeout) else DEFAULT_DIST_TIMEOUT_S
            device = device if device in DEVICES and _device_ok(device) else "auto"
        self._dist_timeout = float(dist_timeout)
        if LLM.live is not None and LLM.live() is not None:
            gc.collect()  # an LLM dropped in a reference cycle is not running
        if (other := LLM.live and LLM.live()) is not None and other.engine is not None:
            # It would join the first's parallel state (its tp_size, attn_dp_size and device
            # whatever these say) and break when the first shuts down.
            raise RuntimeError("an LLM is already running in this process; shutdown() it "
                               "first (one engine per process)")
        if LLM._made_runtime and is_initialized():
            # Left by an LLM dropped without shutdown(): joined, its topology would stand
            # whatever this one asks, and nobody would ever destroy its groups.
            LLM._made_runtime = False
            destroy_parallel_runtime()
        world = tp_size or _world_size()

        def agree() -> None:
            """Check in with what this rank was asked (or why it refused it), before any
            group or collective: ranks asked for other topologies or engines would wait in
            mismatched collectives (a hang, or gloo's abort) instead of being named."""
            error = None
            try:
                if refused is not None:
                    raise refused
                self.args = EngineArgs(model=model, draft=draft, **engine_args)
                asked = {"model": _checkpoint(model), "draft": _checkpoint(draft),
                         "tp_size": world,
                         "attn_dp_size": attn_dp_size, "dist_timeout": self._dist_timeout,
                         **{k: repr(v) for k, v in sorted(engine_args.items())}}
            except (ConfigError, TypeError, ValueError) as err:
                error, asked = err, {"error": f"{type(err).__name__}: {err}"}
            self._agree("LLM()", asked)
            if error is not None:
                raise error

        try:
            if not is_initialized():
                init_parallel_runtime(_Topology(world, attn_dp_size, device,
                                                self._dist_timeout), joined=agree)
                self._owns_runtime = LLM._made_runtime = True
            else:
                agree()
            self.engine = build_engine(self.args)
        except NotJoined as err:  # a rank that never came to this LLM()
            self.shutdown()
            raise NotSPMD(f"{err}: {SPMD_RULE}") from None
        except BaseException:
            self.shutdown()
            raise
        LLM.live = weakref.ref(self)
        self.tokenizer = self.engine.tokenizer
        self._indices = itertools.count()  # the same on every rank: generate is SPMD
        self._calls = 0  # generate() calls, for the messages of _agree
        self._out_of_step: str | None = None  # why this rank's engine may disagree (generate)

    # ------------------------------------------------------------------ generate

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**default_sampling(self.engine))

    def generate(self, prompts: str | Sequence[int] | Mapping
                 | Sequence[str | Sequence[int] | Mapping],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Run every prompt to the end; outputs in input order, the same on every rank."""
        if self.engine is None:
            raise RuntimeError("generate() after shutdown(): build a new LLM")
        if self._out_of_step:
            raise RuntimeError(f"this rank's engine may be out of step with the others "
                               f"({self._out_of_step}): shutdown() and build a new LLM on every "
                               f"rank")
        self._calls += 1
        error = None
        try:
            token_lists, texts = self._prompts(prompts)
            params = self._params(sampling_params, len(token_lists))
            for i, (ids, p) in enumerate(zip(token_lists, params)):
                if (why := self.engine.refusal(ids, p)) is not None:
                    raise ValueError(f"prompt {i}: {why}")
                if p.stop and self.tokenizer is None:
                    raise ValueError(f"prompt {i}: stop={list(p.stop)} needs the "
                                     f"checkpoint's tokenizer.json (give stop_token_ids)")
            asked = {"prompts": len(token_lists), "prompt ids": _digest(token_lists),
                     **_asked_params(params)}
        except (TypeError, ValueError) as err:
            error, asked = err, {"error": f"{type(err).__name__}: {err}"}
        # Every rank runs rank 0's requests: a rank asked for others would return rank 0's
        # outputs as its own, and lose step with the others after a different count.
        self._agree(f"generate() call {self._calls}", asked)
        if error is not None:
            raise error
        processor = OutputProcessor(self.tokenizer, self.engine.abort)
        order: dict[str, int] = {}
        results: list[CompletionOutput | None] = [None] * len(token_lists)
        try:
            for i, (ids, text, p) in enumerate(zip(token_lists, texts, params)):
                index = next(self._indices)
                rid = f"llm-{index}"
                order[rid] = i
                processor.add(rid, ids, p)
                self.engine.add_request(RequestSpec(index=index, rid=rid,
                                                    prompt_ids=tuple(ids), params=p,
                                                    prompt_text=text))
            # Step until every request ended and the engine freed what stop strings aborted.
            while len(processor) or self.engine.has_work:
                for delta in processor.process(self.engine.step()):
                    if delta.finished is not None:
                        results[order[delta.rid]] = delta.finished
            self.engine.settle()
        except BaseException as err:
            # Ctrl-C (or an error) mid-batch: its requests end at the next step, not run on
            # to max_tokens inside the next generate() while holding their pages.
            for rid in order:
                if rid in processor:
                    self.engine.abort(rid)
            if order and get_parallel().world_size > 1:
                # The other ranks may have left at another step, or be stepping still: the
                # engines no longer agree, and a next call would return other outputs on
                # each rank (or wait in mismatched collectives).
                self._out_of_step = (f"it left generate() call {self._calls} mid-batch: "
                                     f"{type(err).__name__}")
            raise
        return results  # type: ignore[return-value]

    def _agree(self, call: str, asked: dict) -> None:
        """Check in with every rank (parallel.check_in) and raise NotSPMD on every rank, naming
        what differs and on which ranks, where they were not asked the same."""
        try:
            values = check_in(json.dumps(asked, sort_keys=True, default=repr),
                              f"reach {call}", self._dist_timeout)
        except NotJoined as err:
            self._out_of_step = f"it stopped waiting for rank(s) at {call}"  # they may come
            raise NotSPMD(f"{err}: {SPMD_RULE}") from None
        if values is None or len(set(values)) == 1:
            return
        if gave_up := [r for r, v in enumerate(values) if v == GAVE_UP]:
            self._out_of_step = f"rank(s) {gave_up} stopped waiting for it at {call}"
            raise NotSPMD(f"rank(s) {gave_up} stopped waiting for this rank at {call} "
                          f"(dist_timeout={self._dist_timeout:g} s): {SPMD_RULE}")
        seen = [json.loads(v) for v in values]
        differ = []
        # A rank whose arguments were refused: its error is what differs.
        keys = ["error"] if any("error" in s for s in seen) else sorted({k for s in seen
                                                                          for k in s})
        for key in keys:
            by_value = ranks_by([json.dumps(s[key]) if key in s else "none" for s in seen])
            if len(by_value) > 1:
                differ.append(f"{key}: " + ", ".join(f"rank(s) {ranks} {v}"
                                                     for v, ranks in by_value.items()))
        raise NotSPMD(f"{call} differs across ranks ({'; '.join(differ)}): every rank must "
                      f"call it with the same arguments, and every rank gets the same result")

    def _prompts(self, prompts) -> tuple[list[list[int]], list[str | None]]:
        """A prompt is text, token ids (a list, or a 1-D numpy array or tensor), or vLLM's
        {"prompt": text} / {"prompt_token_ids": ids}; one prompt or a list of them."""
        prompts = _listed(prompts)
        if isinstance(prompts, (str, Mapping)) or (
                isinstance(prompts, Sequence) and prompts and _is_id(prompts[0])):
            prompts = [prompts]
        ids, texts = [], []
        for i, p in enumerate(prompts):
            if isinstance(p, Mapping):
                if set(p) not in ({"prompt"}, {"prompt_token_ids"}):
                    raise TypeError(f"prompt {i}: a dict prompt has one key, 'prompt' (text) "
                                    f"or 'prompt_token_ids' (token ids), got {sorted(p)}")
                p = p.get("prompt", p.get("prompt_token_ids"))
            p = _listed(p)
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is text but the checkpoint has no "
                                     f"tokenizer.json; pass token ids")
                if why := not_unicode(p):
                    raise ValueError(f"prompt {i} {why}")
                ids.append(self.tokenizer.encode(p).ids)  # with a BOS where it adds one,
                # as the CLI job and the server's completions
                texts.append(p)
            elif isinstance(p, Sequence) and all(_is_id(t) for t in p):
                ids.append([int(t) for t in p])
                texts.append(None)
            else:
                raise TypeError(f"prompt {i} must be a string or a list of token ids, "
                                f"got {_kind(p)}")
        return ids, texts

    def _params(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts; give one, or "
                             f"one per prompt")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got "
                                f"{type(p).__name__}")
        return params

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Free the engine's models and pools; destroy the groups this LLM made (a user's
        default process group stays). Safe to call twice."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
        if self._owns_runtime:
            self._owns_runtime = LLM._made_runtime = False
            destroy_parallel_runtime()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _check_arguments(engine_args: dict, tp_size, attn_dp_size, dist_timeout) -> None:
    """What LLM() can refuse before it joins the world: unknown arguments, and those
    init_parallel_runtime reads, checked as the CLI checks its flags (kv_cache_memory given
    as text is parsed in place)."""
    known = {f.name for f in fields(EngineArgs)}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise TypeError(f"LLM() got unknown arguments {unknown}; accepted: {sorted(known)}")
    if isinstance(engine_args.get("kv_cache_memory"), str):
        engine_args["kv_cache_memory"] = parse_bytes(engine_args["kv_cache_memory"],
                                                     "kv_cache_memory")
    if tp_size is not None and (not _is_id(tp_size) or tp_size < 1):
        raise ValueError(f"tp_size={tp_size!r}: expected a whole number >= 1, or None (every "
                         f"rank of the world)")
    if not _is_id(attn_dp_size) or attn_dp_size < 1:
        raise ValueError(f"attn_dp_size={attn_dp_size!r}: expected a whole number >= 1")
    if not _timeout_ok(dist_timeout):
        raise ValueError(f"dist_timeout={dist_timeout!r}: expected a finite number of seconds "
                         f"> 0 (at most {MAX_DIST_TIMEOUT_S:g})")
    device = engine_args.get("device", "auto")
    if device not in DEVICES:
        # (each rank takes the GPU of its LOCAL_RANK: an index would pin every rank to one)
        raise ValueError(f"device={device!r}: expected one of {', '.join(map(repr, DEVICES))} "
                         f"(or torch.device('cpu') / torch.device('cuda'), without an index: "
                         f"each rank takes cuda:LOCAL_RANK)")
    if not _device_ok(device):
        raise ValueError(f"device={device!r}: this torch sees no CUDA device; use 'cpu' or "
                         f"'auto'")


def _timeout_ok(dist_timeout) -> bool:
    try:
        return isinstance(dist_timeout, numbers.Real) and not isinstance(dist_timeout, bool) \
            and 0 < float(dist_timeout) <= MAX_DIST_TIMEOUT_S
    except OverflowError:  # an int past float's range
        return False


def _device_name(device):
    """A torch.device as the name the CLI takes (cuda without an index: each rank takes its
    LOCAL_RANK's); anything else as given."""
    if isinstance(device, torch.device) and device.type in DEVICES and (
            device.index is None or device.type == "cpu"):
        return device.type
    return device


def _device_ok(device: str) -> bool:
    return device != "cuda" or torch.cuda.is_available()


def _asked_params(params: list[SamplingParams]) -> dict:
    """SamplingParams as a check-in compares them: each field by name where every prompt has
    the same (so a message names the field), else a digest of all; fields as == compares them
    (`extra` left out, 0 and 0.0 alike), stops as the sets they are: a program that lists a
    set (`stop=list({...})`) lists it in another order on each rank (str hashes are salted
    per process)."""
    def values(p: SamplingParams) -> dict:
        out = {}
        for f in fields(p):
            if f.compare:
                v = getattr(p, f.name)
                if f.name in ("stop", "stop_token_ids"):
                    v = sorted(set(v))
                out[f.name] = int(v) if isinstance(v, float) and v.is_integer() else v
        return out

    seen = [values(p) for p in params]
    if all(v == seen[0] for v in seen[1:]):
        return {f"sampling_params.{k}": v for k, v in seen[0].items()} if seen else {}
    return {"sampling_params": _digest(seen)}


# The files of a checkpoint directory the engine reads, compared by their bytes (weights by
# their headers and each tensor's first bytes: _weights_digest).
READ_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "calibration.json", INDEX_FILE)
TENSOR_SAMPLE = 64  # bytes read from the start of each tensor
MAX_HEADER = 100 << 20  # safetensors' own limit (a broken file's claimed length is no size)


def _checkpoint(path) -> str | None:
    """A checkpoint as the ranks compare it: what it holds, not where. Nodes may hold one
    checkpoint at different paths, and one path on two nodes may hold different copies (two
    training steps' checkpoints have the same config, names and sizes). What it holds: the
    bytes of the files the engine reads (READ_FILES), and of each weights file the loader
    reads (checkpoint_files) its size, header (names, shapes, offsets) and the first bytes of
    every tensor: training changes every element of a tensor it trains, and these are one
    short read per tensor. Files the engine does not read (a README, trainer_state.json)
    change nothing. A path this rank cannot read as a directory stays as given (the engine
    names it); a non-path raises TypeError, which the check-in reports (agree)."""
    if path is None:
        return None
    try:
        root = Path(path)
        if not root.is_dir():
            return os.fspath(path)
        held = hashlib.sha256()
        for name in READ_FILES:
            if (root / name).is_file():
                held.update(name.encode() + b"\0" + (root / name).read_bytes())
        try:
            for weights in checkpoint_files(root):
                held.update(weights.name.encode() + b"\0" + _weights_digest(weights))
        except ConfigError as err:  # the engine says it after the check-in
            held.update(str(err).encode())
    except (OSError, ValueError) as err:  # unreadable here (a permission, a stale handle)
        return f"{os.fspath(path)} (unreadable: {err})"
    return f"checkpoint {held.hexdigest()[:16]} (files the engine reads, weights sampled)"


def _weights_digest(weights: Path) -> bytes:
    """A safetensors file's size, header and the first TENSOR_SAMPLE bytes of each tensor
    (three samples spread over the file missed a draft whose trained layers lay between
    them, beside frozen copies of the target's embedding)."""
    held = hashlib.sha256()
    with open(weights, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = f.read(min(int.from_bytes(f.read(8).ljust(8, b"\0"), "little"), MAX_HEADER))
        held.update(str(size).encode() + b"\0" + header)
        begin = 8 + len(header)
        try:
            starts = sorted(t["data_offsets"][0] for name, t in json.loads(header).items()
                            if name != "__metadata__")
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            starts = []  # no safetensors header: its bytes above (the loader names it)
        for start in starts:
            f.seek(begin + start)
            held.update(f.read(TENSOR_SAMPLE))
    return held.digest()


def _digest(value) -> str:
    """A short stable name of a value's repr (prompt ids, SamplingParams dataclasses)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else launch_world_size()


def _listed(x):
    """A numpy array or a tensor as the Python list it holds (ids, or lists of ids)."""
    return x.tolist() if hasattr(x, "tolist") and hasattr(x, "ndim") else x


def _is_id(t) -> bool:
    """A token id: any integer but a bool (numpy's too)."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _kind(p) -> str:
    """What a bad prompt is, for its message: a list names its first bad element's type."""
    if isinstance(p, Sequence) and not isinstance(p, str):
        bad = next((t for t in p if not _is_id(t)), None)
        return f"a list holding {type(bad).__name__} {bad!r}"
    return type(p).__name__

