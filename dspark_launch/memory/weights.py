"""Weight bytes per rank, summed over the model's own parameters, not re-derived by formula.

Each parameter already knows the width it is sharded by (embedding, LM head and attention
over attn_tp, the target MLP over tp, the drafts' MLP over attn_tp, norms and `fc`
replicated), so building the models on the meta device under the topology's override and
summing their parameters prices every rank exactly as a launch would allocate it, without
reading or allocating a byte of weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark_launch.parallel import override_parallel


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters; a tied parameter counts once."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass(frozen=True)
class WeightBytes:
    target: int
    draft: int  # 0 without a draft

    @property
    def total(self) -> int:
        return self.target + self.draft

    def to_dict(self) -> dict:
        return {"target": self.target, "draft": self.draft, "total": self.total}


def weights_per_rank(target_config, target_dtype: torch.dtype, draft_config,
                     draft_dtype: torch.dtype | None, tp_size: int, attn_dp_size: int,
                     tp_rank: int) -> WeightBytes:
    """Build target (+ draft) on the meta device as rank `tp_rank` of the topology; sum.

    target_config: a ModelConfig; draft_config: a DraftConfig or None. Models sit above
    memory/ in the import order, so only this --plan helper reaches up to them, lazily.
    """
    from dspark_launch.models.dflash import DFlashDraft
    from dspark_launch.models.draft_config import DSPARK
    from dspark_launch.models.dspark import DSparkDraft
    from dspark_launch.models.qwen3 import CausalLM

    meta = torch.device("meta")
    with override_parallel(tp_size, attn_dp_size, tp_rank=tp_rank):
        target = parameter_bytes(CausalLM(target_config, target_dtype, meta))
        draft = 0
        if draft_config is not None:
            cls = DSparkDraft if draft_config.kind == DSPARK else DFlashDraft
            draft = parameter_bytes(cls(draft_config, draft_dtype, meta))
    return WeightBytes(target, draft)
