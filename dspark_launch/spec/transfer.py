"""Device->host reads: the only place a step reads the device.

Everything the host must learn from a step (first tokens, accept lengths, committed tokens)
is packed into one int64 tensor and read here once. The one other caller is DSpark's
confidence cut when its threshold is > 0: the host must know the cut lengths to size the
verify forward (what makes the cut save work), so such a step reads twice.
`copies` counts calls so tests can hold a step to its count.
"""

from __future__ import annotations

import torch

copies = 0


def to_host(*parts: torch.Tensor) -> list[list[int]]:
    """Each part (any shape, integer) flattened -> its values on the host, in one copy."""
    global copies
    copies += 1
    sizes = [p.numel() for p in parts]
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts]).tolist()
    out, start = [], 0
    for n in sizes:
        out.append(flat[start:start + n])
        start += n
    return out
