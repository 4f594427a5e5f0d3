"""accept: a verify forward's next-token rows -> first tokens, accept lengths and committed
tokens, all on the device (read back once by the step).

`LogitRows` is the host-side layout: which forward rows become logit rows (a completed fresh
prompt's last row, then every row of each [anchor, drafts] block), whose they are and which
output position each predicts. Blocks are padded to the widest by repeating their last row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark_launch.attention import upload
from dspark_launch.spec.keyed import ACCEPT, SAMPLE, salt, uniforms
from dspark_launch.spec.proposer import Proposal
from dspark_launch.spec.sampling import SamplingRows, draw, target_probs
from dspark_launch.spec.verify import committed_tokens, greedy_accept, rejection_accept


@dataclass
class Verified:
    """A verify forward's results, still on the device."""

    first: torch.Tensor  # [P] int64 first tokens of prompts that completed their prefill
    accept_len: torch.Tensor  # [R] int64 accepted drafts per decode request
    committed: torch.Tensor  # [R, W] int64 committed tokens, -1 padded


@dataclass
class LogitRows:
    forward_rows: list[int]  # the forward row behind each logit row
    owners: list  # the Request of each logit row
    positions: list[int]  # the output position each logit row predicts
    n_first: int  # logit rows [0, n_first) give completed prompts their first token
    widths: list[int]  # drafts verified per decode request

    @classmethod
    def of(cls, prefill: list[tuple], firsts: list[bool], decode: list, widths: list[int]
           ) -> LogitRows:
        starts = [0]
        for n in [n for _, n in prefill] + [1 + w for w in widths]:
            starts.append(starts[-1] + n)
        rows = [starts[i + 1] - 1 for i, f in enumerate(firsts) if f]
        owners = [r for (r, _), f in zip(prefill, firsts) if f]
        positions = [0] * len(rows)
        n_first = len(rows)
        for j, (req, w) in enumerate(zip(decode, widths)):
            start = starts[len(prefill) + j]
            rows += range(start, start + 1 + w)
            owners += [req] * (1 + w)
            positions += range(len(req.output_ids), len(req.output_ids) + 1 + w)
        return cls(rows, owners, positions, n_first, widths)

    @property
    def width(self) -> int:
        """W: the widest block (anchor + drafts)."""
        return 1 + max(self.widths, default=0)

    def block_rows(self, device) -> torch.Tensor:  # [R, W] logit row per block position
        w, offsets = self.width, [self.n_first]
        for x in self.widths:
            offsets.append(offsets[-1] + 1 + x)
        return upload([[offsets[i] + min(j, x) for j in range(w)]
                       for i, x in enumerate(self.widths)], torch.int64,
                      device).reshape(len(self.widths), w)

    def bans(self, stop_ids: Callable, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logit rows, token ids) masked out because the row predicts a position below its
        request's min_tokens: stop_ids(request) (EOS unless ignore_eos, stop_token_ids)."""
        rows, ids = [], []
        for i, (req, pos) in enumerate(zip(self.owners, self.positions)):
            if pos < req.params.min_tokens:
                for tok in stop_ids(req):
                    rows.append(i)
                    ids.append(tok)
        if not rows:
            return None
        both = upload([rows, ids], torch.int64, device)
        return both[0], both[1]


def accept(target, layout: LogitRows, proposal: Proposal | None, hidden: torch.Tensor,
           stop_ids: Callable) -> Verified:
    """hidden [T, d] of the verify forward -> Verified (device tensors only)."""
    device = hidden.device
    w, n_first = layout.width, layout.n_first
    owners = layout.owners
    rows = SamplingRows.build([r.params for r in owners], [r.key for r in owners],
                              layout.positions, device)
    bans = layout.bans(stop_ids, device)
    picked = hidden if len(layout.forward_rows) == hidden.shape[0] else \
        hidden[upload(layout.forward_rows, torch.int64, device)]
    greedy = rows.all_greedy and bans is None
    if w == 1:
        # No draft to test (plain decoding, prefill): each row's token is its own argmax or
        # draw, what acceptance over empty blocks reduces to, without its ~20 operations.
        if greedy:
            return _untested(target.greedy(picked), n_first)
        p = _probs(target, picked, rows, bans)
        return _untested(draw(p, uniforms(rows.keys, rows.positions, SAMPLE)), n_first)
    block_rows = layout.block_rows(device)  # [R, W]
    drafts = proposal.tokens[:, :w - 1]  # [R, W-1]
    draft_lens = upload(layout.widths, torch.int64, device)
    if greedy:
        # Greedy fast path: argmax over the vocab shards, no softmax, no gathered row.
        best = target.greedy(picked)  # [N]
        accept_len, committed = greedy_accept(drafts, draft_lens, best[block_rows])
        return Verified(best[:n_first], accept_len, committed)
    p = _probs(target, picked, rows, bans)  # [N, V]
    u_sample, u_accept = _step_uniforms(rows, block_rows[:, :w - 1])
    q = proposal.q[:, :w - 1] if proposal.q is not None else None
    accept_len, nxt = rejection_accept(drafts, draft_lens, q, p[block_rows], u_accept,
                                       u_sample[block_rows])
    return Verified(draw(p[:n_first], u_sample[:n_first]), accept_len,
                    committed_tokens(drafts, accept_len, nxt))


def _untested(tokens: torch.Tensor, n_first: int) -> Verified:
    """tokens [N], one per logit row, none of them after a draft -> Verified."""
    return Verified(tokens[:n_first], torch.zeros_like(tokens[n_first:]), tokens[n_first:, None])


def _probs(target, picked: torch.Tensor, rows: SamplingRows,
           bans: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # [N, V]
    logits = target.logits(picked).float()  # [N, V]
    if bans is not None:
        logits[bans] = float("-inf")
    return target_probs(logits, rows)


def _step_uniforms(rows: SamplingRows, tested: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One hash call for a verify's draws: SAMPLE at every logit row [N], ACCEPT at the logit
    rows whose drafts are tested ([R, K], indices into the rows). A call is ~20 small
    operations whatever its size, so two purposes share it."""
    n, (r, k) = rows.n, tested.shape
    keys = torch.cat([rows.keys, rows.keys[tested].reshape(-1)])
    positions = torch.cat([rows.positions, rows.positions[tested].reshape(-1)])
    salts = upload([salt(SAMPLE)] * n + [salt(ACCEPT)] * (r * k), torch.int64, keys.device)
    u = uniforms(keys, positions, salts)
    return u[:n], u[n:].reshape(r, k)
