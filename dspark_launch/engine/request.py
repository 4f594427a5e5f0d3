"""One request's state through the engine: waiting -> prefill -> decode -> finished."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"  # holds a slot; prefilling until kv_len == len(fill_ids)
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestSpec:
    """What rank 0 read and broadcast: identical on every rank."""

    index: int  # position in the input: output order
    rid: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    prompt_text: str | None = None
    refused: str | None = None  # a reason when the request is refused before it runs


@dataclass
class Request:
    spec: RequestSpec
    status: Status = Status.WAITING
    slot: int | None = None
    kv_len: int = 0  # positions whose target (and draft) K/V are in the pools
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    accept_lens: list[int] = field(default_factory=list)  # tokens committed per round
    admitted_seq: int = -1  # admission order: the youngest running request is preempted first
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    draft_time: float = 0.0
    verify_time: float = 0.0
    generator: torch.Generator | None = None  # this request's sampling stream


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

    @property
    def all_ids(self) -> list[int]:
        return list(self.spec.prompt_ids) + self.output_ids

    @property
    def remaining(self) -> int:
        return self.spec.max_new_tokens - len(self.output_ids)
