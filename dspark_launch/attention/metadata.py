"""Per-forward attention metadata, built once and shared by every layer."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

MASK_MODES = ("causal", "none", "custom")


@dataclass
class ForwardMetadata:
    q_lens: list[int]  # new tokens per request (each >= 1)
    kv_lens: list[int]  # prefix + q_len per request
    positions: torch.Tensor  # [T] int64 absolute positions of the new tokens (RoPE)
    q_indptr: torch.Tensor  # [B+1] int64
    kv_indptr: torch.Tensor  # [B+1] int64
    # [sum kv_lens] int64 pool rows of positions 0..kv_len-1 (less any skipped: build_metadata)
    kv_indices: torch.Tensor
    out_rows: torch.Tensor  # [T] int64 rows where the new tokens' K/V are stored
    mask_mode: str = "causal"  # "causal" | "none" | "custom"
    custom_mask: torch.Tensor | None = None  # [sum q_len*kv_len] bool, row-major per request
    mask_indptr: torch.Tensor | None = None  # [B+1] int64 offsets into custom_mask
    backend_state: dict = field(default_factory=dict)  # filled by AttentionBackend.prepare()

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def num_requests(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        # An empty batch is not a decode batch: backends short-circuit T == 0 anyway.
        return (
            len(self.q_lens) > 0
            and self.mask_mode == "causal"
            and all(q == 1 for q in self.q_lens)
        )


def upload(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host values -> a tensor on `device` without making the host wait: on CUDA through
    pinned memory and a non-blocking copy (a pageable copy synchronises the stream, which
    would stall the step once per call); elsewhere a plain tensor."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _indptr(lens: list[int], device: torch.device) -> torch.Tensor:
    # Prefix sums in Python: one small tensor instead of zeros + cumsum + copy.
    return upload([0, *itertools.accumulate(lens)], torch.int64, device)


Gaps = Sequence[tuple[int, int]]  # one request's skipped positions: sorted disjoint [a, b)


def _runs(kv_len: int, gaps: Gaps) -> list[tuple[int, int]]:
    """The runs [lo, hi) of positions 0..kv_len-1 outside `gaps`."""
    runs, lo = [], 0
    for a, b in gaps:
        if a > lo:
            runs.append((lo, a))
        lo = b
    if kv_len > lo:
        runs.append((lo, kv_len))
    return runs


def _kept_lens(kv_lens: list[int], skipped: Sequence[Gaps]) -> list[int]:
    return [k - sum(b - a for a, b in gaps) for k, gaps in zip(kv_lens, skipped)]


def _host_rows(table: torch.Tensor, slots: list[int], prefix_lens: list[int],
               q_lens: list[int], kv_lens: list[int], skipped: Sequence[Gaps] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A host table's gathers (kv_indices, positions, out_rows) as numpy slices, one per
    request (and per run between its skipped ranges): every row a request reads or writes is
    a contiguous run of its table row. The device path's ~15 tensor operations took 90-120
    us at batch 1 and 300 us at batch 64 on one Xeon thread; these take 25-30 and 130 (a
    greedy DSpark round builds two)."""
    t = table.numpy()
    skipped = skipped or [()] * len(slots)
    kv = np.concatenate([t[s, lo:hi] for s, k, gaps in zip(slots, kv_lens, skipped)
                         for lo, hi in (_runs(k, gaps) if gaps else ((0, k),))])
    out = np.concatenate([t[s, p:p + q] for s, p, q in zip(slots, prefix_lens, q_lens)])
    pos = np.concatenate([np.arange(p, p + q, dtype=np.int64)
                          for p, q in zip(prefix_lens, q_lens)])
    return (torch.from_numpy(kv).to(torch.int64), torch.from_numpy(pos),
            torch.from_numpy(out).to(torch.int64))


def _skipped_before(kept_lens: list[int], skipped: Sequence[Gaps], device: torch.device
                    ) -> torch.Tensor:
    """[sum kept_lens] int64: per kept kv entry, how many positions its request skipped
    before it (kept entry j of a request is position j + this). A cumulative sum of a few
    host-known steps: + a gap's length at the entry after it, and - all its request's gaps
    where the next request starts (one small upload, however long the contexts)."""
    at, by, start = [], [], 0
    for n, gaps in zip(kept_lens, skipped):
        gone = 0
        for a, b in gaps:
            at.append(start + a - gone)
            by.append(b - a)
            gone += b - a
        if gone:
            at.append(start + n)
            by.append(-gone)
        start += n
    steps = upload([at, by], torch.int64, device)
    return torch.zeros(start + 1, dtype=torch.int64, device=device).index_add_(
        0, steps[0], steps[1]).cumsum(0)[:start]


def _device_rows(table: torch.Tensor, slots: list[int], prefix_lens: list[int],
                 q_lens: list[int], kv_lens: list[int], skipped: Sequence[Gaps] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_host_rows on the table's device: one host->device copy of the lengths, then gathers
    sized by host-known totals (no boolean masks, no device reads)."""
    gone = skipped is not None and any(skipped)
    kv_lens = _kept_lens(kv_lens, skipped) if gone else kv_lens
    b, total_q, total_kv = len(slots), sum(q_lens), sum(kv_lens)
    lens = upload([slots, prefix_lens, q_lens, kv_lens], torch.int64, table.device)
    slot_t, pre_t, q_t, kv_t = lens.unbind(0)  # [B] each
    req = torch.arange(b, device=slot_t.device)
    # kv entry -> (its request, its position): positions 0..kv_len-1 of each request.
    kv_req = torch.repeat_interleave(req, kv_t, output_size=total_kv)  # [sum kv]
    kv_start = torch.cumsum(kv_t, 0) - kv_t  # [B]
    kv_pos = torch.arange(total_kv, device=slot_t.device) - kv_start[kv_req]
    if gone:
        kv_pos += _skipped_before(kv_lens, skipped, slot_t.device)
    kv_indices = table[slot_t[kv_req], kv_pos].to(torch.int64)
    # new token -> (its request, its absolute position prefix_len + i).
    q_req = torch.repeat_interleave(req, q_t, output_size=total_q)  # [T]
    q_start = torch.cumsum(q_t, 0) - q_t
    positions = pre_t[q_req] + torch.arange(total_q, device=slot_t.device) - q_start[q_req]
    return kv_indices, positions, table[slot_t[q_req], positions].to(torch.int64)


def build_metadata(
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int, row per (slot, position)
    slots: list[int],
    prefix_lens: list[int],
    q_lens: list[int],
    mask_mode: str = "causal",
    custom_masks: list[torch.Tensor] | None = None,  # per request [q_len, kv_len] bool
    device: torch.device | str | None = None,
    skipped: Sequence[Gaps] | None = None,
) -> ForwardMetadata:
    """Build the CSR view of a batch from the request->token table.

    `skipped` (mask_mode "none" only): per request, sorted disjoint position ranges [a, b)
    below its prefix whose rows its queries do not see; kv_lens count the rest. A draft block
    skips the positions whose context a dormant step never wrote (Request.draft_gaps): their
    rows hold whatever a page's last owner left there. The queries keep their absolute
    positions (RoPE), so the keys that remain are at their true distances.

    Works on an empty batch (idle DP rank): every tensor is empty and indptrs are [0].
    """
    assert len(slots) == len(prefix_lens) == len(q_lens), "slots/prefix_lens/q_lens differ"
    assert mask_mode in MASK_MODES, f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}"
    assert all(q >= 1 for q in q_lens), "requests with no new tokens must not be in the batch"
    device = torch.device(device) if device is not None else req_to_token.device
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    max_ctx = req_to_token.shape[1] if req_to_token.dim() == 2 else 0
    assert all(k <= max_ctx for k in kv_lens), "kv_len exceeds req_to_token width"
    if skipped is not None and not any(skipped):
        skipped = None
    if skipped is not None:
        assert mask_mode == "none" and len(skipped) == len(slots), (
            "skipped positions need mask_mode 'none' and one list per request")
        assert all(0 <= a < b <= p for gaps, p in zip(skipped, prefix_lens) for a, b in gaps), (
            "a skipped range must lie within its request's prefix")
        assert all(x[1] <= y[0] for gaps in skipped for x, y in zip(gaps, gaps[1:])), (
            "a request's skipped ranges must be sorted and disjoint")

    if slots and req_to_token.device.type == "cpu":
        kv_indices, positions, out_rows = _host_rows(req_to_token, slots, prefix_lens, q_lens,
                                                     kv_lens, skipped)
    elif slots:
        kv_indices, positions, out_rows = _device_rows(req_to_token, slots, prefix_lens, q_lens,
                                                       kv_lens, skipped)
    else:
        kv_indices = torch.zeros(0, dtype=torch.int64)
        out_rows = torch.zeros(0, dtype=torch.int64)
        positions = torch.zeros(0, dtype=torch.int64)
    if skipped is not None:
        kv_lens = _kept_lens(kv_lens, skipped)

    custom_mask = mask_indptr = None
    if mask_mode == "custom":
        assert custom_masks is not None and len(custom_masks) == len(q_lens), (
            "mask_mode='custom' needs one [q_len, kv_len] mask per request"
        )
        flat = []
        for m, q, k in zip(custom_masks, q_lens, kv_lens):
            assert tuple(m.shape) == (q, k), f"custom mask shape {tuple(m.shape)} != {(q, k)}"
            flat.append(m.to(torch.bool).reshape(-1).cpu())
        custom_mask = (torch.cat(flat) if flat else torch.zeros(0, dtype=torch.bool)).to(device)
        mask_indptr = _indptr([q * k for q, k in zip(q_lens, kv_lens)], device)

    return ForwardMetadata(
        q_lens=list(q_lens),
        kv_lens=kv_lens,
        positions=positions.to(device),
        q_indptr=_indptr(list(q_lens), device),
        kv_indptr=_indptr(kv_lens, device),
        kv_indices=kv_indices.to(device),
        out_rows=out_rows.to(device),
        mask_mode=mask_mode,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
    )
