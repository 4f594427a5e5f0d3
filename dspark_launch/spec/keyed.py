"""Keyed randomness: a uniform is a pure function of (request key, output position, purpose).

No generator state is carried between steps, so a request draws the same numbers whatever the
topology, the batch it shares, or how its rounds were cut by rejections and preemptions. The
hash is murmur3's 32-bit finaliser written with int64 tensor ops, so CPU and CUDA give
bit-identical draws.

A position's accept and sample draws are reused in a later round only where no decision read
them: the accept tests past a round's first rejection are computed and discarded, and the
sample draw is read at the committed position only. A draft's draw is keyed by its slot in
the block too, i.e. by the round's anchor, so a position drafted again after a rejection
before it draws afresh. Reused, it would have been read already: DSpark's confidence for a
slot reads the draft before it, a verify length cut by confidences (the cost model's arms, the
threshold) depends on drafts past the rejection, and that length feeds the verify policy's
records (rounds scored, step times), from which the next round's admission of the position's
redrawn draft is decided: that decision must not depend on the draft's own draw.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Purposes: each position has one accept and one sample draw; drafts have one per slot of the
# block (purpose DRAFT + slot: draft_purposes).
ACCEPT, SAMPLE = 2, 3
DRAFT = 16


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser, in place on h (int64 holding values in [0, 2^32)). A 32-bit
    product may pass 2^63: int64 multiplication wraps modulo 2^64 on CPU and CUDA alike,
    which leaves its low 32 bits exact (a test holds this to Python integers)."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h &= MASK32
    h ^= h >> 13
    h *= 0xC2B2AE35
    h &= MASK32
    h ^= h >> 16
    return h


SALT = 0x632BE5AB  # odd: distinct purposes mix in distinct salts


def salt(purpose: int) -> int:
    """What a purpose mixes into the hash."""
    return (purpose * SALT) & MASK32


def draft_purposes(n: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Salts of n draft blocks of k slots, row i*k + j: purpose DRAFT + j. -> [n*k] int64"""
    slots = torch.arange(k, device=device, dtype=torch.int64).repeat(n)
    return (slots + DRAFT) * SALT & MASK32  # salt(DRAFT + j), on the device


def uniforms(
    keys: torch.Tensor,  # [N] int64 in [0, 2^32): one per request (request_key)
    positions: torch.Tensor,  # [N] int64 output positions in [0, 2^32) (0 = first token)
    purpose: int | torch.Tensor,  # one purpose, or [N] int64 salt(purpose) per element
) -> torch.Tensor:  # [N] float32, strictly inside (0, 1)
    """In place on one fresh tensor, ~20 small operations: at a few elements every operation
    costs its dispatch alone, and a sampled step draws here once or twice (one thread:
    82 us a call with out-of-place operations and overflow-free split products, 41 us now;
    the same bits)."""
    # int64 whatever the caller's dtype (an int32 product would wrap at 32 bits), broadcast
    # like the operands; the in-place steps below work on this fresh tensor only.
    h = positions.to(torch.int64) * 0x9E3779B1 + keys
    h &= MASK32
    h = _fmix32(h)
    h ^= salt(purpose) if isinstance(purpose, int) else purpose
    h = _fmix32(h)
    # 23 bits: (2k + 1) / 2^24, i.e. (h >> 8) | 1, is exact in float32 and never 0 or 1.
    h >>= 8
    h |= 1
    return h.to(torch.float32).mul_(1.0 / (1 << 24))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


def request_key(engine_seed: int, index: int, seed: int | None) -> int:
    """A request's 32-bit key: from its own seed when it has one (then the same seed gives the
    same tokens alone or in any batch), else from the engine's seed and the request index."""
    if seed is not None:
        return _splitmix64(_splitmix64(seed) ^ 0x5EED) & MASK32
    return _splitmix64(_splitmix64(engine_seed) ^ index) & MASK32
