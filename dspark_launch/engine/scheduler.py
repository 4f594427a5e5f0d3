"""Per-attn_dp-group scheduler: admission by KV capacity, chunked prefill, preemption.

Every rank of an attention-TP group runs the same scheduler on the same requests and the same
(all-gathered) tokens, so their plans agree without messages. A request that does not fit
waits; a running request that cannot grow preempts the youngest running one, whose K/V is
dropped and recomputed later — nothing over-allocates, nothing deadlocks. A request whose
next round is longer than the context can never be scheduled: it ends with finish_reason
"context_length" (collected by the engine through take_ended()) instead of preempting others.

With a prefix cache on the request space, admission takes the longest cached prefix and
reserves only the rest; computed prefixes go into the cache after each prefill chunk, at
preemption (so the recomputation is a cache hit) and at the end of a request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark_launch.engine.request import Request, Status
from dspark_launch.memory.allocator import KVSpace, Reserve

# A waiting request whose prompt shares at least this many more tokens with a prompt still in
# prefill than the cache holds waits for that prefill to be cached instead of recomputing it
# alongside (SGLang's in-batch prefix check uses the same 32).
SHARED_PREFILL_WAIT = 32


@dataclass
class StepPlan:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(
        self,
        requests: list[Request],
        space: KVSpace,
        max_running: int,
        chunk_size: int,
        round_rows: Callable[[Request], int],  # KV positions a decode round writes past kv_len
        mixed: bool = True,  # a step may prefill and decode together (else: prefill first)
    ) -> None:
        self.mixed = mixed
        self.space = space
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.round_rows = round_rows
        self.waiting: deque[Request] = deque(requests)
        self.running: list[Request] = []
        self._admitted = 0
        self._preempted_now = False
        self._ended: list[Request] = []  # ended by the scheduler, not yet taken by the engine
        self._prefilled: list[Request] = []  # last step's prefill chunks, cached at this one

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._preempted_now = False
        # Last step's prefill chunks are in both pools now: cache them for later admissions.
        for req in self._prefilled:
            if req.status is Status.RUNNING:
                self.space.cache_prefix(req.slot, req.fill_ids[:req.kv_len])
        if self.mixed:
            self._schedule_decode(plan)
            self._schedule_prefill(plan)
        else:  # prefill first, alone; decode when nothing can prefill (SGLang's default)
            self._schedule_prefill(plan)
            if not plan.prefill:
                self._schedule_decode(plan)
        self._prefilled = [r for r, _ in plan.prefill]
        return plan

    def _schedule_decode(self, plan: StepPlan) -> None:
        for req in sorted((r for r in self.running if r.decoding), key=lambda r: r.admitted_seq):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            if self._reserve(req, req.kv_len + self.round_rows(req), plan):
                plan.decode.append(req)

    def _schedule_prefill(self, plan: StepPlan) -> None:
        budget = self.chunk_size
        for req in sorted((r for r in self.running if r.prefilling), key=lambda r: r.admitted_seq):
            if budget == 0:
                break
            n = min(budget, req.fill_len - req.kv_len)
            if self.space.reserve(req.slot, req.kv_len + n):
                plan.prefill.append((req, n))
                req.prefill_tokens += n
                budget -= n
        # No admissions in a step that preempted: the victim would be re-admitted into the
        # pages it just gave up and preempted again next step, wasting its prefill each time.
        while (budget > 0 and self.waiting and len(self.running) < self.max_running
               and not self._preempted_now):
            req = self.waiting[0]
            slot = self.space.new_slot()
            if slot is None:
                break
            # The last prompt token is always computed: its logits give the first token.
            fill = req.fill_ids
            cached = self.space.match_prefix(slot, fill[:-1])
            if self._shares_prefill(fill, cached):
                self.space.free_slot(slot)
                break  # the head of the queue waits for the shared prefix to be cached
            n = min(budget, req.fill_len - cached)
            answer = self.space.reserve(slot, cached + n)
            if not answer:
                self.space.free_slot(slot)
                if answer is Reserve.TOO_LONG:
                    self.end(req, "context_length")
                    continue
                break  # first come, first served: the head of the queue waits for rows
            self.waiting.popleft()
            req.slot, req.status, req.kv_len = slot, Status.RUNNING, cached
            req.cached_tokens += cached
            if req.admitted_seq < 0:  # its first admission: the fill is the prompt
                req.cached_prompt_tokens = cached
            req.prefill_tokens += n
            req.admitted_seq, self._admitted = self._admitted, self._admitted + 1
            self.running.append(req)
            plan.prefill.append((req, n))
            budget -= n

    def _shares_prefill(self, fill: list[int], cached: int) -> bool:
        """Whether fill shares SHARED_PREFILL_WAIT tokens beyond its cached part (whole pages)
        with a running request's prompt that is not cached yet."""
        if self.space.cache is None:
            return False
        ps = self.space.page_size
        for other in self.running:
            if not other.prefilling:
                continue
            theirs = other.fill_ids
            if theirs[:cached] != fill[:cached]:
                continue
            limit = min(len(fill) - 1, len(theirs))
            n = limit if fill[:limit] == theirs[:limit] else cached
            while n < limit and fill[n] == theirs[n]:
                n += 1
            if n // ps * ps - cached >= max(SHARED_PREFILL_WAIT, ps):
                return True
        return False

    def _reserve(self, req: Request, length: int, plan: StepPlan) -> bool:
        """Reserve rows for a decode round, preempting younger requests while pages run out;
        a round longer than the context ends the request (preempting would not help)."""
        while not (answer := self.space.reserve(req.slot, length)):
            if answer is Reserve.TOO_LONG:
                self.end(req, "context_length")
                return False
            victims = [r for r in self.running if r is not req]
            if not victims:
                return False  # cannot happen while context_limit fits the pool; caller skips
            victim = max(victims, key=lambda r: r.admitted_seq)
            if victim.admitted_seq < req.admitted_seq:
                self.preempt(req)
                return False  # req itself is the youngest: it yields instead
            self.preempt(victim)
            if victim in plan.decode:
                plan.decode.remove(victim)
        return True

    def preempt(self, req: Request) -> None:
        self._preempted_now = True
        # Its computed prefix stays in the cache: re-admission finds it (unless evicted).
        self.space.cache_prefix(req.slot, req.cacheable_ids)
        self.space.free_slot(req.slot)
        self.running.remove(req)
        # Recomputed from the cached prefix on: its prefill writes the draft context anew.
        req.slot, req.status, req.kv_len, req.draft_gaps = None, Status.WAITING, 0, []
        req.preemptions += 1
        self.waiting.appendleft(req)

    def end(self, req: Request, reason: str) -> None:
        """End a request the scheduler can never run (the engine reports it as finished)."""
        req.finish(reason)
        if req.status is Status.RUNNING:
            self.finish(req)
        else:
            self.waiting.remove(req)
            req.status = Status.FINISHED
        self._ended.append(req)

    def take_ended(self) -> list[Request]:
        ended, self._ended = self._ended, []
        return ended

    def finish(self, req: Request) -> None:
        if req.slot is not None:
            self.space.cache_prefix(req.slot, req.cacheable_ids)
            self.space.free_slot(req.slot)
        self.running.remove(req)
        req.slot, req.status = None, Status.FINISHED
