"""The output processor above the engine: committed tokens -> text deltas, stop strings, results.

The engine stops on tokens only (EOS, stop_token_ids, max_tokens); this layer detokenizes each
request's tokens one by one (detokenize.TextStream) and, when a stop string appears, cuts the
text where it starts, ends the request with finish_reason "stop" and asks the engine to abort
it (which frees its KV pages at the next step). The token that stopped a request (EOS or one of
its stop_token_ids) stays in its token ids but not in its text, as in vLLM; with
include_stop_str_in_output both the stop string and that token's text stay. It is
deterministic in the engine's outputs, so every rank that runs it on the same outputs gets the
same results (LLM.generate relies on that).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark_launch.detokenize import TextStream
from dspark_launch.engine.params import SamplingParams

# Engine finish reasons as OpenAI clients know them.
OPENAI_REASONS = {"stop": "stop", "length": "length", "context_length": "length",
                  "abort": "abort", "kv_capacity": "length"}


@dataclass
class CompletionOutput:
    """One finished request as the API returns it (the same on every rank)."""

    rid: str
    index: int
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    accept_lens: list[int]  # tokens committed per verify round
    engine_finish_reason: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0  # prompt positions served from the prefix cache (first admission)
    drafts: int = 0  # drafts verified, over every round
    accepted_drafts: int = 0  # ... of which the verification accepted
    error: str | None = None  # why the engine refused the request (finish_reason "refused")

    @property
    def mean_tau(self) -> float | None:
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else None


@dataclass
class CompletionDelta:
    """What one step produced for one request: new text and tokens, and the end if it ended."""

    rid: str
    index: int
    text: str
    token_ids: list[int]
    finished: CompletionOutput | None = None


@dataclass
class _Tracked:
    prompt_ids: list[int]
    params: SamplingParams
    stream: TextStream
    token_ids: list[int] = field(default_factory=list)
    accept_lens: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer, abort: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.abort = abort
        self._tracked: dict[str, _Tracked] = {}

    def add(self, rid: str, prompt_ids, params: SamplingParams) -> None:
        stream = TextStream(self.tokenizer, params.stop, params.skip_special_tokens,
                            params.min_tokens, params.include_stop_str_in_output)
        self._tracked[rid] = _Tracked(list(prompt_ids), params, stream)

    def forget(self, rid: str) -> None:
        self._tracked.pop(rid, None)

    def __contains__(self, rid: str) -> bool:
        return rid in self._tracked

    def __len__(self) -> int:
        return len(self._tracked)

    def process(self, outputs) -> list[CompletionDelta]:
        """Engine RequestOutputs of one step -> one delta per tracked request."""
        deltas = []
        for out in outputs:
            req = self._tracked.get(out.rid)
            if req is None:  # ended here by a stop string; the engine's abort echo
                continue
            deltas.append(self._advance(req, out))
        return deltas

    def _advance(self, req: _Tracked, out) -> CompletionDelta:
        text, new_ids = "", []
        req.accept_lens = list(out.accept_lens)
        # The engine's "stop" is the last token it commits (EOS or a stop token id)
        silent = out.finished and out.finish_reason == "stop" \
            and not req.params.include_stop_str_in_output
        for k, tok in enumerate(out.new_token_ids):
            req.token_ids.append(tok)
            new_ids.append(tok)
            if silent and k == len(out.new_token_ids) - 1:
                break  # the stop token: no text of its own
            step = req.stream.push(tok)
            text += step.text
            if step.stopped is not None:
                self.abort(out.rid)
                return self._finish(req, out, text, new_ids, "stop", step.stopped)
        if not out.finished:
            return CompletionDelta(out.rid, out.index, text, new_ids)
        tail = req.stream.finish()
        text += tail.text
        if tail.stopped is not None:  # completed by the held tail (an unfinished character)
            return self._finish(req, out, text, new_ids, "stop", tail.stopped)
        reason = OPENAI_REASONS.get(out.finish_reason, out.finish_reason or "stop")
        stop_reason = None
        if out.finish_reason == "stop" and req.token_ids and \
                req.token_ids[-1] in req.params.stop_token_ids:
            stop_reason = req.token_ids[-1]
        return self._finish(req, out, text, new_ids, reason, stop_reason)

    def _finish(self, req: _Tracked, out, text: str, new_ids: list[int], reason: str,
                stop_reason) -> CompletionDelta:
        del self._tracked[out.rid]
        accept = _cut_rounds(req.accept_lens, len(req.token_ids))
        # A stop string ends the request here, before the engine does: it ends now.
        first, end, arrival = out.first_token_at, out.finished_at or time.time(), out.arrival
        n = len(req.token_ids)
        result = CompletionOutput(
            rid=out.rid, index=out.index, prompt_token_ids=req.prompt_ids,
            text=req.stream.text, token_ids=list(req.token_ids), finish_reason=reason,
            stop_reason=stop_reason, accept_lens=accept, engine_finish_reason=out.finish_reason,
            ttft_s=(first - arrival) if first is not None and arrival is not None else None,
            tpot_s=(end - first) / (n - 1) if first is not None and end is not None and n > 1
            else None,
            preemptions=out.preemptions, cached_tokens=out.cached_prompt_tokens,
            drafts=out.drafts, accepted_drafts=out.accepted_drafts,
            error=getattr(out, "error", None))
        return CompletionDelta(out.rid, out.index, text, new_ids, result)


def _cut_rounds(accept_lens: list[int], n_tokens: int) -> list[int]:
    """Rounds that produced the kept tokens (a stop string can end a round early). The first
    token comes from the prefill, not from a verify round."""
    budget = max(0, n_tokens - 1)
    kept = []
    for n in accept_lens:
        if budget <= 0:
            break
        kept.append(min(n, budget))
        budget -= kept[-1]
    return kept
