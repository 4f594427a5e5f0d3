"""One request's state through the engine: waiting -> prefill -> decode -> finished, and what
the engine reports about it after each step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from dspark_launch.engine.params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "context_length", "kv_capacity", "refused")


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"  # holds a request slot; prefilling until kv_len == fill_len
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestSpec:
    """What a client hands the engine (rank 0 broadcasts it): identical on every rank."""

    index: int  # unique per engine: output order of the offline job, and the default seed key
    rid: str  # the client's id; Engine.abort(rid) names it
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_text: str | None = None
    refused: str | None = None  # a reason when the request is refused before it runs


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one step; Engine.step() returns the same list on every rank.

    Times are wall-clock seconds (time.time()): arrival from rank 0's clock, the others from
    the clock of the rank that ran the request (under attn_dp > 1 one rank's readings reach
    every rank; inside one attention group each rank reads its own clock for the same event,
    so only these readings may differ between ranks)."""

    rid: str
    index: int
    new_token_ids: tuple[int, ...]  # committed in this step
    output_ids: tuple[int, ...]  # all committed so far
    finished: bool
    finish_reason: str | None  # one of FINISH_REASONS once finished
    prompt_tokens: int
    accept_lens: tuple[int, ...]  # tokens committed per draft/verify round
    arrival: float
    first_token_at: float | None
    finished_at: float | None
    preemptions: int
    cached_tokens: int = 0  # prefill positions taken from the prefix cache (all admissions)
    prefill_tokens: int = 0  # prefill positions computed (recomputation after preemption too)
    # Prompt positions the first admission took from the prefix cache: OpenAI's
    # usage.prompt_tokens_details.cached_tokens (a readmission's hits are recomputation saved).
    cached_prompt_tokens: int = 0
    drafts: int = 0  # drafts verified, over every round
    accepted_drafts: int = 0  # ... of which the verification accepted
    draft_s: float = 0.0
    verify_s: float = 0.0
    error: str | None = None  # the refusal reason when finish_reason == "refused"


@dataclass
class Request:
    spec: RequestSpec
    arrival: float
    key: int  # keyed randomness (spec.keyed.request_key)
    status: Status = Status.WAITING
    slot: int | None = None  # request slot in the request->token table
    kv_len: int = 0  # positions whose target (and draft) K/V are in the pools
    # Position ranges [a, b), sorted, whose draft context dormant steps left out (their rows
    # in the draft pool hold whatever a page's last owner left): the draft block skips them,
    # and the prefix cache takes only pages below the first (a cached page holds both pools').
    draft_gaps: list[tuple[int, int]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    reported: int = 0  # output_ids already returned by step()
    finish_reason: str | None = None
    accept_lens: list[int] = field(default_factory=list)  # tokens committed per round
    admitted_seq: int = -1  # admission order: the youngest running request is preempted first
    preemptions: int = 0
    cached_tokens: int = 0  # prefill positions taken from the prefix cache (all admissions)
    prefill_tokens: int = 0  # prefill positions computed (recomputation after preemption too)
    cached_prompt_tokens: int = 0  # those of the first admission (RequestOutput)
    drafts: int = 0  # drafts verified, over every round
    accepted_drafts: int = 0  # ... of which the verification accepted (a stop may cut some)
    first_token_at: float | None = None
    finished_at: float | None = None
    draft_time: float = 0.0
    verify_time: float = 0.0

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose K/V must be in the pool before decoding: everything but the anchor."""
        ids = list(self.spec.prompt_ids)
        return ids + self.output_ids[:-1] if self.output_ids else ids

    @property
    def fill_len(self) -> int:
        return len(self.spec.prompt_ids) + max(0, len(self.output_ids) - 1)

    @property
    def num_ids(self) -> int:
        return len(self.spec.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.status is Status.RUNNING and self.kv_len < self.fill_len

    @property
    def decoding(self) -> bool:
        return self.status is Status.RUNNING and not self.prefilling and bool(self.output_ids)

    @property
    def anchor(self) -> int:
        """The last committed token: generated, not yet in the KV cache."""
        return self.output_ids[-1]

    def leave_out_context(self) -> None:
        """A dormant step writes no draft context for this request's anchor (at kv_len)."""
        at = self.kv_len
        if self.draft_gaps and self.draft_gaps[-1][1] == at:
            self.draft_gaps[-1] = (self.draft_gaps[-1][0], at + 1)
        else:
            self.draft_gaps.append((at, at + 1))

    @property
    def cacheable_ids(self) -> list[int]:
        """The ids at the positions whose K/V both pools hold: what the prefix cache may take."""
        hole = min(self.kv_len, self.draft_gaps[0][0]) if self.draft_gaps else self.kv_len
        return self.all_ids[:hole]

    @property
    def all_ids(self) -> list[int]:
        return list(self.spec.prompt_ids) + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.finished_at = time.time()

    def output(self) -> RequestOutput:
        """What step() reports now; advances the reported mark."""
        new = tuple(self.output_ids[self.reported:])
        self.reported = len(self.output_ids)
        return RequestOutput(
            rid=self.spec.rid, index=self.index, new_token_ids=new,
            output_ids=tuple(self.output_ids), finished=self.finish_reason is not None,
            finish_reason=self.finish_reason, prompt_tokens=len(self.spec.prompt_ids),
            accept_lens=tuple(self.accept_lens), arrival=self.arrival,
            first_token_at=self.first_token_at, finished_at=self.finished_at,
            preemptions=self.preemptions, cached_tokens=self.cached_tokens,
            prefill_tokens=self.prefill_tokens, cached_prompt_tokens=self.cached_prompt_tokens,
            drafts=self.drafts, accepted_drafts=self.accepted_drafts, draft_s=self.draft_time,
            verify_s=self.verify_time)


def refused_output(spec: RequestSpec, arrival: float) -> RequestOutput:
    return RequestOutput(
        rid=spec.rid, index=spec.index, new_token_ids=(), output_ids=(), finished=True,
        finish_reason="refused", prompt_tokens=len(spec.prompt_ids), accept_lens=(),
        arrival=arrival, first_token_at=None, finished_at=arrival, preemptions=0,
        error=spec.refused)
