"""The SPMD engine: requests arrive over time; every rank calls step() in lockstep.

One step: exchange -> schedule -> propose -> verify -> accept -> commit (then the step's
outputs). The exchange comes first so that a request added between two steps is scheduled in
the next one (its prefill, or its replacement of a finished request, loses no step).

Inside an attn_dp group every rank holds the same requests and sees the same tokens, so the
group's schedulers agree without messages. Across groups the only couplings are the per-step
exchange (engine/exchange.py) and the target forward, whose MLP gathers every group's tokens:
the groups swap their token counts once the drafts are sized, and every rank joins the
forward whenever any group has tokens, idle ones with none. The host learns a step's results
in one device->host copy (spec/transfer.py; a DSpark confidence cut adds one read to size the
verify), and sends it host values without waiting (attention.upload).

Client calls (add_request, abort) are honoured on rank 0 and are no-ops elsewhere; they reach
every rank through the next step's exchange and join that step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from dspark_launch.attention import build_metadata, upload
from dspark_launch.comm import all_gather_object
from dspark_launch.engine.accept import LogitRows, accept
from dspark_launch.engine.divergence import (
    check_commits,
    commits_digest,
    committed_tokens,
    inject_divergence,
)
from dspark_launch.engine.exchange import IDLE_WAIT_S, Flags, Inbox, exchange, token_counts
from dspark_launch.engine.heap import thaw_heap
from dspark_launch.engine.params import SamplingParams, refusal
from dspark_launch.engine.placement import CacheAwarePlacer
from dspark_launch.engine.request import (
    Request,
    RequestOutput,
    RequestSpec,
    Status,
    refused_output,
)
from dspark_launch.engine.scheduler import Scheduler, StepPlan
from dspark_launch.engine.verify_policy import micros, request_class, spread
from dspark_launch.failure import Interrupted, inject_fault, progress
from dspark_launch.models.layers.gemm import NEVER, steady_clock
from dspark_launch.parallel import get_parallel
from dspark_launch.spec import transfer
from dspark_launch.spec.keyed import request_key
from dspark_launch.spec.proposer import Proposal, Proposer
from dspark_launch.spec.sampling import SamplingRows


@dataclass(frozen=True)
class EngineLimits:
    max_running: int
    chunk_size: int
    context_limit: int  # prompt + output tokens per request
    eos_ids: tuple[int, ...]
    seed: int = 0
    mixed_chunk: bool = True  # prefill chunks may share a step with decodes


@dataclass(frozen=True)
class StepStats:
    """What this rank's group did in the last step (benchmarks split prefill from decode)."""

    prefill_tokens: int = 0
    decode_requests: int = 0
    forward_tokens: int = 0
    drafted: int = 0  # requests that drafted (the policy may keep any from drafting)


class Engine:
    def __init__(self, target, proposer: Proposer, memory, backend, limits: EngineLimits,
                 tokenizer=None) -> None:
        self.target = target
        self.proposer = proposer
        self.memory = memory
        self.space = memory.space
        self.backend = backend
        self.limits = limits
        self.tokenizer = tokenizer
        self.device = target.device
        self.steps = 0
        self.last_step = StepStats()
        state = get_parallel()
        self.sched = Scheduler([], self.space, limits.max_running, limits.chunk_size,
                               self._round_rows, limits.mixed_chunk)
        self.inbox = Inbox()
        # Replicated on every rank: where each unfinished request runs, and each group's load.
        self.live: dict[int, tuple[int, int]] = {}  # index -> (attn_dp group, load)
        self.load = [0] * state.attn_dp_size
        self.commits: dict[str, list[int]] = {}  # what this rank committed last step
        self.placer = None
        if self.space.cache is not None and state.attn_dp_size > 1:
            self.placer = CacheAwarePlacer(
                state.attn_dp_size, self.space.allocator.num_pages * self.space.page_size)
        # Filled by build_engine: what was loaded, the memory plan, generation_config.json.
        self.checkpoints = None
        self.plan = None
        self.generation_defaults: dict = {}
        # CPU projections on a copy of the weights for this kernel from these rows
        # (gemm_choice.py; "torch", NEVER: no copy)
        self.gemm_kernel, self.gemm_from_rows = "torch", NEVER
        # The verify-length policy (engine/verify_policy.py; None: verify every draft), and
        # what it learns from: the last step's tokens and its (forward, draft, deferred
        # context writes) microseconds.
        self.policy = None
        self._draft_s = 0.0  # this step's draft seconds (deferred context rows: not in it)
        self._draft_rows = 0  # what this step drafted, in the policy's unit (draft_rows)
        self._dormant = False  # the policy left this step's decode rows out of the context
        self._timing = (0, 0, 0)
        # decode tokens, forward tokens, draft rows, base tokens
        self._last_tokens: tuple[int, int, int, int] | None = None

    # ------------------------------------------------------------------ client API

    @property
    def context_limit(self) -> int:
        return self.limits.context_limit

    def refusal(self, prompt_ids, params: SamplingParams | None = None) -> str | None:
        """Why a request cannot run here (None: it can): engine/params.py refusal."""
        return refusal(prompt_ids, params, self.context_limit, self.target.config.vocab_size)

    def add_request(self, spec: RequestSpec) -> None:
        """Queue a request (rank 0 only; a no-op on other ranks). Thread-safe. It joins the
        engine at the next step(); a prompt that cannot run finishes there as "refused"."""
        if get_parallel().rank != 0:
            return
        if spec.refused is None and \
                (why := self.refusal(spec.prompt_ids, spec.params)) is not None:
            spec = replace(spec, refused=why)
        self.inbox.put(("add", spec, time.time()))

    def abort(self, rid: str) -> None:
        """Finish every unfinished request with this rid as "abort" at the next step, freeing
        its pages (rank 0 only; a no-op elsewhere). Thread-safe."""
        if get_parallel().rank == 0:
            self.inbox.put(("abort", rid))

    @property
    def has_work(self) -> bool:
        """Some request is unfinished, as every rank agreed at the end of the last step.
        Requests added since then count only after the next step() has carried them."""
        return bool(self.live)

    def flush_prefix_cache(self) -> None:
        """Give every cached page back to the allocator (only while no request runs)."""
        if self.space.cache is not None:
            self.space.cache.flush()

    def shutdown(self) -> None:
        """Drop the models, pools and table; the engine cannot step afterwards."""
        self.target = self.proposer = self.memory = self.space = self.sched = None
        thaw_heap()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ the step

    # Inference mode, not just no_grad: a step is ~1,000 small eager ops, and inference mode
    # skips their autograd and version-counter bookkeeping (the embedded model on one CPU
    # thread, greedy: NONE +11.6% decode tokens/s and DSpark +8.2% at batch 1, +6.0% and
    # +3.0% at batch 16; scripts/bench_grad_mode.py). Tensors a step creates are inference
    # tensors: only later steps, also in this mode, update them in place.
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One lockstep step on every rank -> the same outputs on every rank: one per request
        (any group) that committed tokens or finished. Idle: returns [] after at most
        IDLE_WAIT_S. Raises Interrupted on every rank when any rank received a signal."""
        progress.begin(self.steps)
        try:
            return self._step()
        finally:
            progress.in_step = False  # returned or raised: no longer stuck in it (failure.py)

    def _step(self) -> list[RequestOutput]:
        flags, events = self._exchange()
        report: list[Request] = []
        refused: list[RequestOutput] = []
        for event in events:  # before the schedule: a request added between steps runs now
            if event[0] == "add":
                refused += self._place(event[1], event[2])
            else:
                report += self._abort_here(event[1])
        plan = self.sched.schedule()
        report += self.sched.take_ended()  # ended by the scheduler (round past the context)
        if plan.empty and self.sched.has_work and (stuck := self._unstick()) is not None:
            report.append(stuck)
        # The step's clock leaves out oneDNN's compiles of new shapes (gemm.py: FirstShapes):
        # the policy learns what its choices cost from then on, not once.
        t0 = steady_clock()
        self.proposer.flushed_s = 0.0
        proposal, drafted = self._propose(plan)
        widths = self._widths(plan, proposal)
        prefill_tokens = sum(n for _, n in plan.prefill)
        tokens = prefill_tokens + sum(1 + w for w in widths)
        self.last_step = StepStats(prefill_tokens, len(plan.decode), tokens, drafted)
        counts = token_counts(tokens)
        if any(counts):
            rank = get_parallel().rank
            inject_fault(rank, self.steps)
            if tokens:
                reqs = [r for r, _ in plan.prefill] + plan.decode
                before = [len(r.output_ids) for r in reqs]
                report += self._verify_and_commit(plan, proposal, widths, counts, t0)
                inject_divergence(rank, self.steps, reqs, before)
                self.commits = committed_tokens(reqs, before)
                # Deferred context rows written in this step (before the draft, or when
                # rows change hands) are the price of no step: plain steps owe them only if
                # a later step drafts, and a ladder settled at plain decoding goes dormant
                # and never writes them. Counted, they made plain steps of a drafter 3.7%
                # dearer than NONE's at batch 64 (every step releases a finished request's
                # rows, so every step flushed), and tries of drafting arms from plain
                # decoding that much cheaper: DFlash moved to cap 2, 0.95x plain decoding.
                forward_s = steady_clock() - t0 - self._draft_s - self.proposer.flushed_s
                self._timing = (micros(forward_s), micros(self._draft_s),
                                micros(self.proposer.flushed_s))
                self._last_tokens = (sum(1 + w for w in widths), tokens, self._draft_rows,
                                     self._base_tokens(plan))
            else:
                self._idle_forward(counts)
            self.steps += 1
        outputs = self._gather(report, gather=any(counts) or bool(events) or flags.work)
        outputs += refused
        for out in outputs:
            if out.finished and out.index in self.live:
                group, load = self.live.pop(out.index)
                self.load[group] -= load
                if self.policy is not None:
                    self.policy.forget(out.index)
        return outputs

    def settle(self) -> None:
        """Collective, once a caller's step loop has ended on every rank: the ranks of each
        group must have ended with the same commits. A step's commits are compared by the
        next step's exchange; after the last there was none: a divergence there went
        unnoticed, and a request that ended on one rank only sent that rank out of its loop
        into the next collective alone (a gloo mismatch named as a dead peer). This exchange
        meets such a peer's next step: both raise the divergence, named."""
        flags, _ = exchange([], self.sched.has_work, commits_digest(self.commits),
                            self._timing)
        check_commits(flags.digests, self.steps - 1, self.commits)
        self.commits = {}

    def _exchange(self) -> tuple[Flags, list[tuple]]:
        """The step's first collective: rank 0's client events (waiting up to IDLE_WAIT_S for
        one when nothing runs anywhere), every rank's signal, digest of last step's commits
        and last step's times. Raises Interrupted before any work of this step."""
        events: list[tuple] = []
        if get_parallel().rank == 0:
            events = self.inbox.take(0.0 if self.live else IDLE_WAIT_S)
        flags, events = exchange(events, self.sched.has_work, commits_digest(self.commits),
                                 self._timing)
        # The ranks of a group must have committed the same tokens last step.
        check_commits(flags.digests, self.steps - 1, self.commits)
        if flags.signal:
            raise Interrupted(flags.signal)
        self.commits = {}
        self._learn_step(flags)
        return flags, events

    # -- schedule helpers

    def _round_rows(self, req: Request) -> int:
        """Rows the scheduler reserves (preempting if it must) for a decode round. Adaptive:
        the anchor's only; drafts are optional, their rows are reserved once the policy has
        chosen who drafts (_reserve_drafts), and a request that finds no room decodes plainly
        instead of preempting another. Fixed: the whole round, so every request drafts in
        every round whatever the memory pressure (its outputs depend on its seed alone)."""
        if self.policy is not None and self.policy.adaptive:
            return 1
        return max(1 + self._draft_limit(req), self.proposer.block_rows)

    def _draft_limit(self, req: Request) -> int:
        """Drafts worth verifying: never past max_tokens or the context limit."""
        room = min(req.remaining, self.limits.context_limit - req.num_ids)
        return max(0, min(self.proposer.max_drafts, room - 1))

    def _unstick(self) -> Request | None:
        """Nothing could be scheduled although work remains. Several running requests that
        hold each other's pages: the youngest yields (recomputed later). A lone request that
        still cannot fit ends with finish_reason "kv_capacity" instead of hanging."""
        sched = self.sched
        if len(sched.running) > 1:
            sched.preempt(max(sched.running, key=lambda r: r.admitted_seq))
            return None
        req = sched.running[0] if sched.running else sched.waiting[0]
        req.finish("kv_capacity")
        if req.status is Status.WAITING:
            sched.waiting.remove(req)
            req.status = Status.FINISHED
        else:
            sched.finish(req)
        return req

    # -- propose

    def _request_rows(self, reqs: list[Request], offset: int = 0) -> SamplingRows:
        """Per request: its sampling parameters, key, and its next output position."""
        return SamplingRows.build([r.params for r in reqs], [r.key for r in reqs],
                                  [len(r.output_ids) + offset for r in reqs], self.device)

    def _propose(self, plan: StepPlan) -> tuple[Proposal | None, int]:
        """Drafts for the decode requests, and how many requests drafted. The policy may keep
        some (or all) requests from drafting this step, from past rounds only."""
        self._draft_s = 0.0
        self._draft_rows = 0
        self._dormant = False
        decode = plan.decode
        if not decode or not self.proposer.max_drafts:
            return None, 0
        t0 = steady_clock()
        sub = list(range(len(decode)))
        if self.policy is not None and self.policy.adaptive:
            classes = [request_class(r) for r in decode]
            # A plain step (the ladder's arm, from past steps) needs no request's limit.
            limits = ([self._draft_limit(r) for r in decode] if self.policy.pick(classes)
                      else [0] * len(decode))
            limits = self.policy.plan([r.index for r in decode], classes, limits,
                                      self._base_tokens(plan))
            self._dormant = self.policy.dormant
            sub = [i for i, n in enumerate(limits) if n > 0]
            if not sub:
                return None, 0
        else:
            limits = [self._draft_limit(r) for r in decode]
        sub = self._reserve_drafts(decode, limits, sub)
        if not sub:
            return None, 0
        # Context rows deferred by plain steps are owed whether or not anyone drafts: they
        # are no price of this draft (nor of this step's forward), so no step's time holds
        # them (each plain step would otherwise look cheap and each drafting one dear); the
        # policy is told them apart (flushed_s, below).
        self.proposer.flush()
        reqs = [decode[i] for i in sub]
        mine = [limits[i] for i in sub]
        proposal = self.proposer.propose(reqs, mine, self._request_rows(reqs))
        self._draft_rows = int(self.proposer.draft_rows(len(sub), max(mine)))
        if len(sub) < len(decode):
            proposal = spread(proposal, sub, len(decode))
        self._draft_s = steady_clock() - t0 - self.proposer.flushed_s
        return proposal, len(sub)

    def _reserve_drafts(self, decode: list[Request], limits: list[int], sub: list[int]
                        ) -> list[int]:
        """Rows for the drafts of the requests at `sub` (the draft block and the verify);
        those that find none (pages, context) draft nothing this step. Which ones may draft
        is decided before any draft exists, so this is lossless like the policy itself."""
        rows = self.proposer.block_rows
        kept = []
        for i in sub:
            req = decode[i]
            if limits[i] > 0 and self.space.reserve(req.slot,
                                                    req.kv_len + max(1 + limits[i], rows)):
                kept.append(i)
        return kept

    @staticmethod
    def _base_tokens(plan: StepPlan) -> int:
        """Tokens a step forwards before any draft: prefill chunks and one anchor each."""
        return sum(n for _, n in plan.prefill) + len(plan.decode)

    def _widths(self, plan: StepPlan, proposal: Proposal | None) -> list[int]:
        decode = plan.decode
        if proposal is None:
            return [0] * len(decode)
        widths = [min(w, self._draft_limit(r)) for r, w in zip(decode, proposal.widths)]
        if self.policy is not None:
            # DSpark: the confidences, where the policy reads them, come to the host (one
            # small read), since the verify's width must be host-known, as for the confidence
            # cut. "fixed" keeps every draft and only predicts (the summary's calibration
            # check).
            chosen = self.policy.choose([r.index for r in decode],
                                        [request_class(r) for r in decode], widths,
                                        self._base_tokens(plan), proposal.conf,
                                        self._draft_rows)
            widths = [min(w, c) for w, c in zip(widths, chosen)]
        return widths

    def _learn_step(self, flags: Flags) -> None:
        """Refine the policy's curves with the last step's agreed times (every rank alike)."""
        if self.policy is not None and self._last_tokens is not None and flags.forward_us:
            decode, forward, draft_rows, base = self._last_tokens
            self.policy.record_step(decode, forward, flags.forward_us * 1e-6, draft_rows,
                                    flags.draft_us * 1e-6, base, flags.context_us * 1e-6)
        self._last_tokens, self._timing = None, (0, 0, 0)

    # -- verify

    def _verify_and_commit(self, plan: StepPlan, proposal: Proposal | None, widths: list[int],
                           counts: list[int], t0: float) -> list[Request]:
        t1 = steady_clock()
        reqs = [r for r, _ in plan.prefill] + plan.decode
        q_lens = [n for _, n in plan.prefill] + [1 + w for w in widths]
        meta = build_metadata(self.space.req_to_token, [r.slot for r in reqs],
                              [r.kv_len for r in reqs], q_lens, "causal", device=self.device)
        ids = self._input_ids(plan, proposal, widths)
        prefill_rows = sum(q_lens[:len(plan.prefill)])
        capture = self.proposer.capture_layer_ids if prefill_rows or not self._dormant else ()
        hidden, captured = self.target.forward(ids, meta, self.backend, self.memory.target,
                                               capture, counts)
        if capture:
            # Every row's context K/V goes into the draft pool, rejected rows too: they sit
            # past the committed length, where the next block overwrites them. When nobody
            # drafted, the decode rows are all committed anchors: they may wait (lazily
            # written before the next draft), so a step that skips drafting costs nothing;
            # a dormant step leaves them out (spec/policy.py: WAKE_AHEAD).
            if self._dormant:
                self.proposer.materialize(captured[:prefill_rows], meta.positions[:prefill_rows],
                                          meta.out_rows[:prefill_rows])
            else:
                defer = prefill_rows if not any(widths) else None
                self.proposer.materialize(captured, meta.positions, meta.out_rows, defer)
        if self._dormant and self.proposer.capture_layer_ids:
            for req in plan.decode:  # its anchor's draft context is never written
                req.leave_out_context()
        firsts = [r.kv_len + n == r.fill_len and not r.output_ids for r, n in plan.prefill]
        layout = LogitRows.of(plan.prefill, firsts, plan.decode, widths)
        first, accept_len, committed = [], [], []
        if layout.forward_rows:
            done = accept(self.target, layout, proposal, hidden, self._stop_ids)
            first, accept_len, committed = transfer.to_host(done.first, done.accept_len,
                                                            done.committed)
        if self.policy is not None and proposal is None:
            self.policy.record_plain(len(plan.decode))
        elif self.policy is not None:
            for req, w, n_acc in zip(plan.decode, widths, accept_len):
                self.policy.record(req.index, request_class(req), w, n_acc)
        t2 = steady_clock()
        return self._commit(plan, firsts, first, widths, accept_len, committed, t1 - t0,
                            t2 - t1)

    def _input_ids(self, plan: StepPlan, proposal: Proposal | None, widths: list[int]
                   ) -> torch.Tensor:
        """Prefill chunks (host tokens) then each [anchor, drafts] block (device drafts)."""
        host = [t for r, n in plan.prefill for t in r.fill_ids[r.kv_len:r.kv_len + n]]
        anchors = [r.anchor for r in plan.decode]
        ids = upload(host + anchors, torch.int64, self.device)
        if not plan.decode or not any(widths):
            return ids
        w = 1 + max(widths)
        blocks = torch.cat([ids[len(host):, None], proposal.tokens[:, :w - 1]], dim=1)  # [R, W]
        flat = blocks.reshape(-1)
        if min(widths) < w - 1:  # blocks of unequal widths: each one's own rows
            flat = flat[upload([i * w + j for i, n in enumerate(widths) for j in range(1 + n)],
                               torch.int64, self.device)]
        return torch.cat([ids[:len(host)], flat])

    def _stop_ids(self, req: Request) -> tuple[int, ...]:
        eos = () if req.params.ignore_eos else self.limits.eos_ids
        return eos + req.params.stop_token_ids

    # -- commit

    def _commit(self, plan: StepPlan, firsts: list[bool], first: list[int], widths: list[int],
                accept_len: list[int], committed: list[int], draft_s: float, verify_s: float
                ) -> list[Request]:
        report: list[Request] = []
        finished: list[Request] = []
        now = time.time()
        cursor = 0
        for (req, n), is_first in zip(plan.prefill, firsts):
            req.kv_len += n
            if is_first:
                req.first_token_at = now
                report.append(req)
                if self._append(req, [first[cursor]]):
                    finished.append(req)
                cursor += 1
        w = len(committed) // len(plan.decode) if plan.decode else 0
        for j, req in enumerate(plan.decode):
            n_acc = accept_len[j]
            req.kv_len += n_acc + 1  # the anchor and the accepted drafts are now cached
            req.drafts += widths[j]
            req.accepted_drafts += n_acc
            req.draft_time += draft_s
            req.verify_time += verify_s
            before = len(req.output_ids)
            done = self._append(req, committed[j * w:j * w + n_acc + 1])
            req.accept_lens.append(len(req.output_ids) - before)
            report.append(req)
            if done:
                finished.append(req)
            else:
                self.space.roll_back(req.slot, req.kv_len)  # rejected rows: spare, kept
        for req in finished:
            self.sched.finish(req)
        return report

    def _append(self, req: Request, tokens: list[int]) -> bool:
        """Append committed tokens until a stop rule fires; True when the request finished.
        Nothing after a stop token is emitted; stop ids count from min_tokens on."""
        stops = self._stop_ids(req)
        for tok in tokens:
            req.output_ids.append(tok)
            n = len(req.output_ids)
            if tok in stops and n > req.params.min_tokens:
                req.finish("stop")
                return True
            if n >= req.params.max_tokens:
                req.finish("length")
                return True
            if req.num_ids >= self.limits.context_limit:
                req.finish("context_length")
                return True
        return False

    def _idle_forward(self, counts: list[int]) -> None:
        """Join the TP-wide collectives of the target forward with zero tokens."""
        meta = build_metadata(self.space.req_to_token, [], [], [], device=self.device)
        ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.target.forward(ids, meta, self.backend, self.memory.target,
                            self.proposer.capture_layer_ids, counts)

    # -- events and outputs

    def _place(self, spec: RequestSpec, arrival: float) -> list[RequestOutput]:
        """Put a new request on an attn_dp group: the least-loaded one, or with the prefix
        cache the one caching its longest prefix unless overloaded (the same choice on every
        rank: the loads are replicated). A refused spec finishes at once, everywhere."""
        if spec.refused is not None:
            return [refused_output(spec, arrival)]
        state = get_parallel()
        load = len(spec.prompt_ids) + spec.params.max_tokens
        if self.placer is not None:  # the group caching the longest prefix, unless overloaded
            group = self.placer.place(spec.prompt_ids, self.load, load)
        else:
            group = min(range(len(self.load)), key=lambda g: (self.load[g], g))
        self.load[group] += load
        self.live[spec.index] = (group, load)
        if group == state.attn_dp_rank:
            self._admit(Request(spec, arrival, request_key(self.limits.seed, spec.index,
                                                           spec.params.seed)))
        return []

    def _admit(self, req: Request) -> None:
        self.sched.waiting.append(req)

    def _abort_here(self, rid: str) -> list[Request]:
        out = []
        for req in [*self.sched.running, *self.sched.waiting]:
            if req.spec.rid != rid or req.finish_reason is not None:
                continue
            req.finish("abort")
            if req.status is Status.WAITING:
                self.sched.waiting.remove(req)
                req.status = Status.FINISHED
            else:
                self.sched.finish(req)
            out.append(req)
        return out

    def _gather(self, report: list[Request], gather: bool) -> list[RequestOutput]:
        """This group's outputs -> every group's, on every rank (one copy per group)."""
        seen: set[int] = set()
        mine = []
        for req in report:
            if id(req) not in seen:
                seen.add(id(req))
                mine.append(req.output())
        state = get_parallel()
        if state.attn_dp_size == 1 or not gather:
            return mine
        send = mine if state.attn_tp_rank == 0 else []
        return [o for part in all_gather_object(send) for o in part]
