"""Keyed randomness: a uniform is a pure function of (request key, output position, purpose).

No generator state is carried between steps, so a request draws the same numbers whatever the
topology, the batch it shares, or how its rounds were cut by rejections and preemptions. The
hash is murmur3's 32-bit finaliser written with int64 tensor ops that never overflow (32-bit
products are split into 16-bit halves), so CPU and CUDA give bit-identical draws.

Reusing a (key, position, purpose) draw in a later round is lossless: a draw is reused only
for a position that no earlier decision committed, and the event that discarded it (a
rejection at an earlier position) did not depend on it.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Purposes: each position has one draw of each kind.
DRAFT, ACCEPT, SAMPLE = 1, 2, 3


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32): products stay below 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms(
    keys: torch.Tensor,  # [N] int64 in [0, 2^32): one per request (request_key)
    positions: torch.Tensor,  # [N] int64 output positions (0 = first generated token)
    purpose: int,
) -> torch.Tensor:  # [N] float32, strictly inside (0, 1)
    h = _fmix32((keys + _mul32(positions & MASK32, 0x9E3779B1)) & MASK32)
    h = _fmix32(h ^ ((purpose * 0x632BE5AB) & MASK32))
    # 23 bits: (2k + 1) / 2^24 is exact in float32 and never 0 or 1.
    return ((h >> 9).to(torch.float32) * 2 + 1) / float(1 << 24)


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
