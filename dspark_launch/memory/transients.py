"""What one step allocates besides the pools, priced at the largest batch the scheduler forms.

The pools are not the only memory a step needs: at a real vocabulary (152k) the logits of a
verify batch are hundreds of MB. The budget reserves `price_step(shape).total` per rank before
it sizes the pools, so "nothing OOMs" holds for the whole step. One formula, here; `--plan`
prints its terms, and on CUDA a warm-up step at this batch measures the real peak
(engine side, `check_measured`).

Largest batch (scheduler.py): every running request decodes a verify round of `verify_rows`
rows, except that one of them may instead be a prefill chunk of `chunk_rows` rows:
    forward_rows = max(R * verify_rows, (R - 1) * verify_rows + chunk_rows)
    logit_rows   = R * verify_rows   (every verify row; a prefill contributes one row)

Peak: propose needs the draft's logits over the vocabulary, and hands only its distributions
(q) on to accept; the captured features live from the target forward until materialize; the
forward's activations are gone before the logits exist, so
    peak = max(propose: draft,
               verify: draft_q + features + max(attention + mlp + split-K,
                                                verify_logits + sampler)).
The sampled terms are always priced: any request may ask for temperature > 0. A block
drafter's deferred context (features of up to DEFERRED_CONTEXT_ROWS + R committed rows, and
their concatenation when written) outlives steps: it is added to the peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from dspark_launch.errors import LaunchError
from dspark_launch.parallel import get_parallel

FP32 = 4
# Rows whose distributions spec/sampling.py makes at once (like DEFERRED_CONTEXT_ROWS, a
# bound the price holds the code to). Their filters' temporaries were made for every row of
# the step at once: 41 bytes a token of the vocabulary per logit row, where 16 were priced.
SAMPLING_CHUNK_ROWS = 64
# What making one row's distribution needs at most on top of its fp32 logits, per token of
# the vocabulary, while its chunk is made:
# top_p's full sort measured 33 bytes (values, int64 order, cumsum, masks, the scattered
# result), a half-precision model's fp32 copy of its logits 4 more.
SAMPLING_WORKSPACE_BYTES = 40
# Context rows a block drafter may let wait for the draft pool (spec/block_drafter.py): they
# live across steps, so they are priced on top of every step's peak.
DEFERRED_CONTEXT_ROWS = 256
SPLITK_MAX_SPLITS = 8  # kernels/decode_attention.py MAX_SPLITS (a test keeps them equal)

# algorithm -> (drafts per round, draft block rows) as a function of the block size B,
# mirroring the proposers (spec/); used by --plan, which has no proposer. A test checks
# the table against the real proposers.
_ROUNDS = {
    "NONE": lambda b: (0, 0),
    "NGRAM": lambda b: (b - 1, 0),
    "DFLASH": lambda b: (b - 1, b),
    "DSPARK": lambda b: (b, b),
}


def round_shape(algorithm: str, block_size: int) -> tuple[int, int]:
    """(max_drafts, block_rows) for an algorithm at block size B."""
    return _ROUNDS[algorithm](block_size)


@dataclass(frozen=True)
class StepShape:
    """The largest step of one rank: sizes and widths, nothing allocated."""

    max_running: int  # R: requests decoding at once in one attn_dp group
    verify_rows: int  # rows per request per round: max(1 + max_drafts, block_rows)
    chunk_rows: int  # --chunked-prefill-size
    draft_rows: int  # block rows per request in the draft forward (0: no block drafter)
    draft_slots: int  # draft slots whose distribution over V is kept (q), per request
    captured_layers: int  # len(target_layer_ids): target features the draft reads
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the target MLP's (sharded over tp)
    q_heads: int  # total query heads (sharded over attn_tp)
    kv_heads: int  # total KV heads (sharded over attn_tp, replicated when fewer)
    head_dim: int
    v_head_dim: int
    itemsize: int  # activation dtype bytes
    tp_size: int
    attn_tp_size: int
    attn_dp_size: int

    @property
    def forward_rows(self) -> int:
        r, v = self.max_running, self.verify_rows
        return max(r * v, (r - 1) * v + self.chunk_rows)

    @property
    def logit_rows(self) -> int:
        return self.max_running * self.verify_rows

    @property
    def vocab_shard(self) -> int:
        return -(-self.vocab_size // self.attn_tp_size)  # ceil, as the LM head pads

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Transients:
    """Bytes per rank, term by term (see the module docstring for the peak rule)."""

    verify_logits: int  # every logit row's local vocab shard, dtype + the argmax's fp32
    sampler: int  # what sampling adds: the full-vocab gather, fp32 logits, probabilities
    draft: int  # propose: the draft's logits over the full vocabulary, per draft slot
    draft_q: int  # what propose hands to accept: one fp32 distribution per draft slot
    features: int  # captured target layer outputs [forward_rows, m * d]
    attention: int  # one layer's q|k|v and their temporaries, and the residual stream
    mlp: int  # DP gather buffer + the MLP's intermediates over every group's rows
    split_k: int  # decode attention partial outputs and LSEs
    deferred: int = 0  # a block drafter's context rows waiting for the draft pool

    @property
    def total(self) -> int:
        forward = self.attention + self.mlp + self.split_k
        logits = self.verify_logits + self.sampler
        return self.deferred + max(self.draft,
                                   self.draft_q + self.features + max(forward, logits))

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def price_step(s: StepShape) -> Transients:
    """Per-rank transients of the largest step: the one formula the budget reserves."""
    v, d, it = s.vocab_size, s.hidden_size, s.itemsize
    shard = s.vocab_shard * it  # this rank's logits of one row
    greedy_row = shard + s.vocab_shard * FP32  # + the fp32 copy its argmax reads
    # A sampled row's shards meet: the gathered pieces (the local one itself when attn_tp
    # is 1), their concatenation, then fp32 logits over the real vocabulary and the probs.
    pieces = s.attn_tp_size * shard if s.attn_tp_size > 1 else 0
    sampled_row = shard + pieces + s.attn_tp_size * shard + 2 * v * FP32
    row = max(greedy_row, sampled_row)  # a step's rows take one path or the other
    q_rows = s.max_running * s.draft_slots

    def workspace(rows: int) -> int:  # the filters' chunk (spec/sampling.py)
        return min(rows, SAMPLING_CHUNK_ROWS) * v * SAMPLING_WORKSPACE_BYTES

    all_groups = s.attn_dp_size * s.forward_rows  # the MLP multiplies every group's rows
    gather = d if s.attn_dp_size > 1 else 0
    mlp_width = gather + 3 * (s.intermediate_size // s.tp_size) + d  # gate|up, act, out
    q_local = max(1, s.q_heads // s.attn_tp_size)
    kv_local = max(1, s.kv_heads // s.attn_tp_size)
    # qkv, the normed and the rotated q|k, the attention output (4 head-sized tensors), plus
    # the torch backend's per-group copy of q and the output it assembles (2 q-sized ones);
    # the residual stream x, h and their normed copies (4 hidden-sized ones).
    attn_width = (4 * (q_local + 2 * kv_local) + 2 * q_local) * s.head_dim + 4 * d
    return Transients(
        verify_logits=s.logit_rows * greedy_row,
        sampler=s.logit_rows * (row - greedy_row) + workspace(s.logit_rows),
        draft=q_rows * row + workspace(q_rows),
        draft_q=q_rows * v * FP32,
        features=s.forward_rows * s.captured_layers * d * it,
        attention=s.forward_rows * attn_width * it,
        mlp=all_groups * mlp_width * it,
        # The split-K decode kernel runs only when every request has one row: R of them.
        split_k=s.max_running * q_local * SPLITK_MAX_SPLITS * (s.v_head_dim + 1) * FP32,
        # features (m * d) plus position and row (int64) per row, twice while concatenated
        deferred=(2 * (DEFERRED_CONTEXT_ROWS + s.max_running)
                  * (s.captured_layers * d * it + 16) if s.draft_rows else 0),
    )


def check_measured(priced: int, measured: int, shape: StepShape) -> None:
    """A warm-up step's measured peak above the priced transients is a start-up error."""
    if measured > priced:
        raise LaunchError(
            f"a warm-up step at the largest batch (R={shape.max_running} x "
            f"{shape.verify_rows} rows, {shape.forward_rows} forward rows) allocated "
            f"{measured} bytes beyond the pools, but the budget priced {priced} bytes of "
            f"transients (memory/transients.py); lower --max-running-requests or "
            f"--chunked-prefill-size"
        )


def measure_step_peak(run: Callable[[], bool], device) -> int | None:
    """Bytes `run` allocates beyond what was live before it, on CUDA; None on other devices
    (the CPU allocator keeps no peak statistics) or when `run` reports it did not run."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ran = run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base if ran else None


def check_step_peak(priced: int, shape: StepShape, run: Callable[[], bool], device
                    ) -> int | None:
    """Start-up check on CUDA: one warm-up step at `shape` must stay within its price."""
    measured = measure_step_peak(run, device)
    if measured is not None:
        check_measured(priced, measured, shape)
    return measured


def step_shape(cfg, target_config, dtype: torch.dtype, max_drafts: int, block_rows: int,
               draft=None) -> StepShape:
    """The largest step of this run at the LIVE widths.

    target_config: the target's ModelConfig; max_drafts/block_rows: the proposer's (see
    round_shape); draft: the draft model or config (None without one), whose
    target_layer_ids are the features the target captures for it.
    """
    state = get_parallel()
    c = target_config
    draft_config = getattr(draft, "config", draft)
    captured = len(draft_config.target_layer_ids) if draft_config is not None else 0
    return StepShape(
        max_running=cfg.max_running_requests,
        verify_rows=max(1 + max_drafts, block_rows),
        chunk_rows=cfg.chunked_prefill_size,
        draft_rows=block_rows,
        # A block drafter keeps a distribution per draft; NGRAM's is a point mass (none).
        draft_slots=max_drafts if block_rows else 0,
        captured_layers=captured,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        q_heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        v_head_dim=c.head_dim,
        itemsize=torch.empty((), dtype=dtype).element_size(),
        tp_size=state.tp_size,
        attn_tp_size=state.attn_tp_size,
        attn_dp_size=state.attn_dp_size,
    )
