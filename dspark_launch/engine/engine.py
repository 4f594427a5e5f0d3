"""The SPMD step loop: schedule -> draft -> one target forward -> accept -> commit.

Every rank runs this loop. Requests are placed on attn_dp groups up front; inside a group
every rank holds the same requests and sees the same (all-gathered) tokens, so the group's
schedulers agree without messages. Across groups the only coupling is the target forward
(its MLP gathers every group's tokens), which every rank joins every step, with zero tokens
when its group is idle, until no group has work left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dspark_launch.attention import build_metadata
from dspark_launch.comm import all_gather_ints
from dspark_launch.engine.divergence import (
    Commits,
    check_commits,
    commits_digest,
    committed_tokens,
    inject_divergence,
)
from dspark_launch.engine.output import request_record
from dspark_launch.engine.request import Request, RequestSpec, Status
from dspark_launch.engine.scheduler import Scheduler, StepPlan
from dspark_launch.failure import Interrupted, inject_fault, progress, received_signal
from dspark_launch.parallel import get_parallel
from dspark_launch.spec.proposer import Proposer
from dspark_launch.spec.sampling import GREEDY_EPS, probs_from_logits, request_generator, sample
from dspark_launch.spec.verify import greedy_accept, rejection_accept


@dataclass(frozen=True)
class EngineLimits:
    max_running: int
    chunk_size: int
    context_limit: int  # prompt + output tokens per request
    eos_ids: tuple[int, ...]
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0


def assign_groups(specs: list[RequestSpec], groups: int) -> list[list[RequestSpec]]:
    """Least-loaded placement by prompt + output tokens, computed identically on every rank."""
    load = [0] * groups
    out: list[list[RequestSpec]] = [[] for _ in range(groups)]
    for spec in specs:
        g = min(range(groups), key=lambda i: (load[i], i))
        out[g].append(spec)
        load[g] += len(spec.prompt_ids) + spec.max_new_tokens
    return out


class Engine:
    def __init__(self, target, proposer: Proposer, memory, backend, limits: EngineLimits) -> None:
        self.target = target
        self.proposer = proposer
        self.memory = memory
        self.space = memory.space
        self.backend = backend
        self.limits = limits
        self.device = target.device
        self.steps = 0

    # ------------------------------------------------------------------ public

    def run(
        self,
        specs: list[RequestSpec],
        on_finish: Callable[[list[dict]], None] | None = None,
    ) -> list[Request]:
        """Decode every spec; returns this group's requests. `on_finish` runs on every rank
        with the requests that finished anywhere (gathered), as soon as they finish."""
        state = get_parallel()
        mine = [Request(s) for s in assign_groups(specs, state.attn_dp_size)[state.attn_dp_rank]]
        for req in mine:
            req.generator = request_generator(self.limits.seed, req.index)
        sched = Scheduler(mine, self.space, self.limits.max_running, self.limits.chunk_size,
                          self._round_rows)
        pending: list[Request] = []  # finished here, not yet reported
        commits: Commits = {}  # tokens committed in the last step, by request id
        progress.phase = "decode"
        while True:
            progress.step = self.steps
            plan = sched.schedule()
            pending.extend(sched.take_ended())  # ended by the scheduler (round past the context)
            if plan.empty and sched.has_work and (stuck := self._unstick(sched)) is not None:
                pending.append(stuck)
            # One small all-gather per step: who has tokens, who has work, who finished
            # something, whether any rank was asked to stop (so all stop after this step),
            # and what each rank committed in the last step (its group must agree).
            flags = all_gather_ints([int(not plan.empty), int(sched.has_work), len(pending),
                                     received_signal(), commits_digest(commits)])
            check_commits([f[4] for f in flags], self.steps - 1, commits)
            if any(f[2] for f in flags):
                gathered = self._gather_finished(pending)
                if on_finish is not None:
                    on_finish(gathered)
                pending = []
            stop = max(f[3] for f in flags)
            if stop:
                raise Interrupted(stop)
            if not any(f[0] for f in flags):
                if not any(f[1] for f in flags):
                    break
                continue
            inject_fault(get_parallel().rank, self.steps)
            # Some group has tokens: every rank joins the target forward, idle ones with none.
            reqs = [r for r, _ in plan.prefill] + plan.decode
            before = [len(r.output_ids) for r in reqs]
            pending = self._step(plan, sched) if not plan.empty else self._idle_forward()
            inject_divergence(get_parallel().rank, self.steps, reqs, before)
            commits = committed_tokens(reqs, before)
            self.steps += 1
        return mine

    # ------------------------------------------------------------------ one step

    def _round_rows(self, req: Request) -> int:
        return max(1 + self._draft_limit(req), self.proposer.block_rows)

    def _draft_limit(self, req: Request) -> int:
        """Drafts worth verifying: never past max_new_tokens or the context limit."""
        room = min(req.remaining, self.limits.context_limit - req.num_ids)
        return max(0, min(self.proposer.max_drafts, room - 1))

    def _step(self, plan: StepPlan, sched: Scheduler) -> list[Request]:
        t0 = time.perf_counter()
        limits = [self._draft_limit(r) for r in plan.decode]
        drafts: list[list[int]] = [[] for _ in plan.decode]
        q: list[torch.Tensor | None] = [None for _ in plan.decode]
        if plan.decode and self.proposer.max_drafts:
            proposal = self.proposer.propose(plan.decode, limits,
                                             [r.spec.temperature for r in plan.decode])
            drafts = [toks[:k] for toks, k in zip(proposal.tokens, limits)]
            q = [None if qq is None else qq[:len(d)] for qq, d in zip(proposal.q, drafts)]
        t1 = time.perf_counter()

        reqs = [r for r, _ in plan.prefill] + plan.decode
        blocks = [[r.anchor] + d for r, d in zip(plan.decode, drafts)]
        token_lists = [r.fill_ids[r.kv_len:r.kv_len + n] for r, n in plan.prefill] + blocks
        meta = build_metadata(
            self.space.req_to_token, [r.slot for r in reqs], [r.kv_len for r in reqs],
            [len(t) for t in token_lists], "causal", device=self.device)
        ids = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.int64,
                           device=self.device)
        hidden, captured = self.target.forward(ids, meta, self.backend, self.memory.target,
                                               self.proposer.capture_layer_ids)
        starts = meta.q_indptr.tolist()

        # Rows whose next-token distribution matters: a prefill's last row when it completes
        # a fresh prompt, and every row of a verify block.
        n_pre = len(plan.prefill)
        first = [r.kv_len + n == r.fill_len and not r.output_ids for r, n in plan.prefill]
        rows = [starts[i + 1] - 1 for i, f in enumerate(first) if f]
        temps = [r.spec.temperature for (r, _), f in zip(plan.prefill, first) if f]
        for j, (req, block) in enumerate(zip(plan.decode, blocks)):
            rows.extend(range(starts[n_pre + j], starts[n_pre + j] + len(block)))
            temps.extend([req.spec.temperature] * len(block))
        greedy, probs = self._next_token_dists(hidden, rows, temps)
        t2 = time.perf_counter()

        finished: list[Request] = []
        mat_rows: list[int] = []  # forward rows whose K/V the draft context must now hold
        mat_pos: list[int] = []
        cursor = 0
        for i, (req, n) in enumerate(plan.prefill):
            mat_rows.extend(range(starts[i], starts[i] + n))
            mat_pos.extend(range(req.kv_len, req.kv_len + n))
            req.kv_len += n
            if first[i]:
                req.first_token_at = time.perf_counter()
                tok = greedy[cursor] if greedy is not None else sample(
                    probs[cursor], req.generator)
                cursor += 1
                if self._append(req, [tok]):
                    finished.append(req)
        if greedy is not None and blocks:
            accepted = self._greedy_accept_all(blocks, greedy[cursor:])
        for j, (req, block) in enumerate(zip(plan.decode, blocks)):
            width = len(block)
            if greedy is not None:
                accept_len, nxt = accepted[j]
            else:
                accept_len, nxt = rejection_accept(
                    block[1:], q[j], probs[cursor:cursor + width], req.generator)
            cursor += width
            row0 = starts[n_pre + j]
            mat_rows.extend(range(row0, row0 + accept_len + 1))
            mat_pos.extend(range(req.kv_len, req.kv_len + accept_len + 1))
            req.kv_len += accept_len + 1  # the anchor and the accepted drafts are now cached
            req.draft_time += t1 - t0
            req.verify_time += t2 - t1
            before = len(req.output_ids)
            done = self._append(req, block[1:1 + accept_len] + [nxt])
            req.accept_lens.append(len(req.output_ids) - before)
            if done:
                finished.append(req)
            else:
                self.space.truncate(req.slot, req.kv_len)  # roll back rejected rows by length
        if self.proposer.capture_layer_ids and mat_rows:
            sel = torch.tensor(mat_rows, dtype=torch.int64, device=self.device)
            positions = torch.tensor(mat_pos, dtype=torch.int64, device=self.device)
            self.proposer.materialize(captured[sel], positions, meta.out_rows[sel])
        for req in finished:
            sched.finish(req)
        return finished

    @staticmethod
    def _greedy_accept_all(blocks: list[list[int]], greedy: list[int]
                           ) -> list[tuple[int, int]]:
        """(accept_len, bonus) per verify block [anchor, drafts...], all in one tensor op.

        greedy holds the target's argmax for every block row, blocks back to back. Rows are
        padded with -1 (never a token id) to the widest block.
        """
        width = max(len(b) for b in blocks)
        drafts, targets, start = [], [], 0
        for b in blocks:
            drafts.append(b[1:] + [-1] * (width - len(b)))
            targets.append(greedy[start:start + len(b)] + [-1] * (width - len(b)))
            start += len(b)
        acc, bonus = greedy_accept(
            torch.tensor(drafts, dtype=torch.int64).view(len(blocks), width - 1),
            torch.tensor([len(b) - 1 for b in blocks], dtype=torch.int64),
            torch.tensor(targets, dtype=torch.int64))
        return list(zip(acc.tolist(), bonus.tolist()))

    def _next_token_dists(
        self, hidden: torch.Tensor, rows: list[int], temps: list[float]
    ) -> tuple[list[int] | None, torch.Tensor | None]:
        """Greedy argmax over the vocab shards when every row is greedy (no full-vocab gather),
        else the target distributions [len(rows), V] for sampling."""
        if all(t < GREEDY_EPS for t in temps):
            if not rows:
                return [], None
            # A pure decode step wants every row: skip the gather.
            picked = hidden if rows == list(range(hidden.shape[0])) else hidden[rows]
            return self.target.greedy(picked).tolist(), None
        logits = self.target.logits(hidden[rows]).float().cpu()
        probs = torch.cat([
            probs_from_logits(logits[i:i + 1], t, self.limits.top_k, self.limits.top_p)
            for i, t in enumerate(temps)])
        return None, probs

    def _append(self, req: Request, tokens: list[int]) -> bool:
        """Append committed tokens until a stop rule fires; True when the request finished.
        Nothing after a stop token is emitted."""
        for tok in tokens:
            req.output_ids.append(tok)
            if tok in self.limits.eos_ids:
                return self._finish(req, "stop")
            if len(req.output_ids) >= req.spec.max_new_tokens:
                return self._finish(req, "length")
            if req.num_ids >= self.limits.context_limit:
                return self._finish(req, "context_length")
        return False

    def _finish(self, req: Request, reason: str) -> bool:
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        return True

    def _unstick(self, sched: Scheduler) -> Request | None:
        """Nothing could be scheduled although work remains. Several running requests that
        hold each other's pages: the youngest yields (recomputed later). A lone request that
        still cannot fit ends with finish_reason "kv_capacity" instead of hanging the job
        (context_limit is sized so that this should not happen)."""
        if len(sched.running) > 1:
            sched.preempt(max(sched.running, key=lambda r: r.admitted_seq))
            return None
        req = sched.running[0] if sched.running else sched.waiting[0]
        self._finish(req, "kv_capacity")
        if req.status is Status.WAITING:
            sched.waiting.remove(req)
            req.status = Status.FINISHED
        else:
            sched.finish(req)
        return req

    def _idle_forward(self) -> list[Request]:
        """Join the TP-wide collectives of the target forward with zero tokens."""
        meta = build_metadata(self.space.req_to_token, [], [], [], device=self.device)
        ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.target.forward(ids, meta, self.backend, self.memory.target,
                            self.proposer.capture_layer_ids)
        return []

    def _gather_finished(self, finished: list[Request]) -> list[dict]:
        """Every group's finished requests as records, on every rank (one copy per group)."""
        state = get_parallel()
        mine = [request_record(r) for r in finished] if state.attn_tp_rank == 0 else []
        if state.world_size == 1:
            return mine
        everyone: list[list[dict]] = [[] for _ in range(state.world_size)]
        dist.all_gather_object(everyone, mine, group=state.cpu_group)
        return [r for part in everyone for r in part]
