"""DraftConfig: a DFlash (z-lab) or DSpark (DeepSpec) draft `config.json`, parsed and checked.

Both formats are a Qwen3 config plus drafting keys; they differ in where those keys live
(z-lab nests them under `dflash_config`, DeepSpec keeps them top level). The Qwen3 layer
geometry is parsed by the target's ModelConfig so both models agree on every default
(head_dim, rope_theta in either spelling, dtype names) and on what is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark_launch.errors import ConfigError
from dspark_launch.models.config import ModelConfig

DFLASH, DSPARK = "DFLASH", "DSPARK"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
_ARCH_KIND = {"DFlashDraftModel": DFLASH, "Qwen3DSparkModel": DSPARK}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference default: spread k ids over [1, n-3]; one layer takes the middle.

    Python's round() (halves to even) is part of the rule: (7, 3) -> [1, 2, 4].
    """
    n, k = num_target_layers, num_draft_layers
    if k == 1:
        return [n // 2]
    start, end = 1, n - 3
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


def detect_draft_kind(config: Mapping[str, Any], source: str = "draft config.json") -> str:
    """"DFLASH" (z-lab) or "DSPARK" (DeepSpec), from `architectures`, else from the keys."""
    for arch in config.get("architectures") or []:
        if arch in _ARCH_KIND:
            return _ARCH_KIND[arch]
    # No known architecture name: the layout still tells the formats apart.
    if isinstance(config.get("dflash_config"), Mapping):
        return DFLASH
    if "markov_rank" in config or "enable_confidence_head" in config:
        return DSPARK
    raise ConfigError(
        f"{source}: cannot tell the draft format from architectures="
        f"{config.get('architectures')!r}; expected DFlashDraftModel (z-lab DFlash) or "
        f"Qwen3DSparkModel (DeepSpec DSpark)")


@dataclass(frozen=True)
class DraftConfig:
    kind: str  # DFLASH | DSPARK
    block_size: int
    target_layer_ids: tuple[int, ...]  # target layer outputs fed to fc; -1 = embeddings
    mask_token_id: int
    num_target_layers: int | None  # the target depth the draft was trained against
    markov_rank: int  # 0 = no Markov head (DFlash, DeepSpec's DFlash baselines)
    markov_head_type: str
    has_confidence_head: bool
    confidence_with_markov: bool  # confidence input is [h; W1[prev]] (else just h)
    # Qwen3 layer geometry of the draft's own layers.
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    dtype: torch.dtype

    @property
    def num_features(self) -> int:  # m: fc reads [N, m*d]
        return len(self.target_layer_ids)

    def layer_config(self) -> ModelConfig:
        """The draft layers as a Qwen3 ModelConfig, so the target's Attention can be reused."""
        return ModelConfig(
            architecture="Qwen3ForCausalLM", vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False, attention_bias=False, dtype=self.dtype)

    def check_topology(self, attn_tp_size: int) -> None:
        """The whole draft (attention AND MLP) is sharded over attn_tp: refuse what won't split."""
        where = f"attn_tp_size={attn_tp_size}"
        problems = []
        if self.num_attention_heads % attn_tp_size:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible "
                            f"by {where}")
        kv = self.num_key_value_heads
        if kv % attn_tp_size and attn_tp_size % kv:
            problems.append(f"num_key_value_heads={kv} and {where} must divide one another")
        if self.intermediate_size % attn_tp_size:
            problems.append(f"intermediate_size={self.intermediate_size} is not divisible by "
                            f"{where} (the draft MLP is sharded over attn_tp)")
        if problems:
            raise ConfigError(f"{self.kind} draft cannot be sharded: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "draft config.json"
                  ) -> DraftConfig:
        kind = detect_draft_kind(raw, source)
        # The draft layers are plain Qwen3 layers: let the target's parser read them.
        layer = ModelConfig.from_dict({**raw, "architectures": ["Qwen3ForCausalLM"]},
                                      source=source)
        if layer.attention_bias:
            raise ConfigError(f"{source}: attention_bias=true is not supported for drafts")
        try:
            extra = (raw.get("dflash_config") or {}) if kind == DFLASH else raw
            n_layers = layer.num_hidden_layers
            n_target = raw.get("num_target_layers")
            ids = extra.get("target_layer_ids")
            if ids is None:
                if n_target is None:
                    raise ConfigError(f"{source}: neither target_layer_ids nor num_target_layers "
                                      f"is set, so the target features cannot be chosen")
                ids = build_target_layer_ids(int(n_target), n_layers)
            ids = tuple(int(i) for i in ids)
            mask_id = extra.get("mask_token_id", raw.get("mask_token_id"))
            if mask_id is None:
                raise ConfigError(f"{source}: no mask_token_id")
            if kind == DSPARK:
                rank = int(raw.get("markov_rank", 0))
                head_type = str(raw.get("markov_head_type", "vanilla"))
                confidence = bool(raw.get("enable_confidence_head", False))
                conf_markov = bool(raw.get("confidence_head_with_markov", True)) and rank > 0
            else:
                rank, head_type, confidence, conf_markov = 0, "vanilla", False, False
            cfg = cls(
                kind=kind, block_size=int(raw.get("block_size", 0)), target_layer_ids=ids,
                mask_token_id=int(mask_id), num_target_layers=None if n_target is None
                else int(n_target), markov_rank=rank, markov_head_type=head_type,
                has_confidence_head=confidence, confidence_with_markov=conf_markov,
                vocab_size=layer.vocab_size, hidden_size=layer.hidden_size,
                intermediate_size=layer.intermediate_size, num_hidden_layers=n_layers,
                num_attention_heads=layer.num_attention_heads,
                num_key_value_heads=layer.num_key_value_heads, head_dim=layer.head_dim,
                rms_norm_eps=layer.rms_norm_eps, rope_theta=layer.rope_theta,
                max_position_embeddings=layer.max_position_embeddings, dtype=layer.dtype)
        except (TypeError, ValueError, AttributeError) as err:
            # target_layer_ids: 3, mask_token_id: "x", block_size: null were tracebacks
            raise ConfigError(f"{source}: a value of the wrong kind ({err})") from None
        cfg._check(source)
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DraftConfig:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{path}: no config.json (is this a draft checkpoint directory?)")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"{cfg_file}: unreadable JSON ({err})") from None
        return cls.from_dict(raw, source=str(cfg_file))

    def _check(self, source: str) -> None:
        if self.block_size < 1:
            raise ConfigError(f"{source}: block_size={self.block_size} must be >= 1")
        if not self.target_layer_ids:
            raise ConfigError(f"{source}: target_layer_ids is empty")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"{source}: markov_head_type={self.markov_head_type!r}; "
                              f"expected one of {MARKOV_HEAD_TYPES}")
        if self.markov_rank < 0:
            raise ConfigError(f"{source}: markov_rank={self.markov_rank} must be >= 0")
        lowest = -1 if self.kind == DSPARK else 0  # only DeepSpec can read the embeddings
        if min(self.target_layer_ids) < lowest:
            raise ConfigError(f"{source}: target_layer_ids={list(self.target_layer_ids)} "
                              f"has an id below {lowest}")


def validate_against_target(draft: DraftConfig, target: ModelConfig) -> None:
    """Refuse a draft that cannot read this target's features or tokens, naming both values."""
    problems = []
    if draft.hidden_size != target.hidden_size:
        problems.append(f"draft hidden_size={draft.hidden_size} != target hidden_size="
                        f"{target.hidden_size}")
    if draft.vocab_size != target.vocab_size:
        problems.append(f"draft vocab_size={draft.vocab_size} != target vocab_size="
                        f"{target.vocab_size}")
    n = target.num_hidden_layers
    if draft.num_target_layers is not None and draft.num_target_layers != n:
        problems.append(f"draft num_target_layers={draft.num_target_layers} != target "
                        f"num_hidden_layers={n}")
    # HF's last hidden state is the post-norm output, not layer n-1's raw output, so the
    # reference never trains on it: the highest usable id is n-2.
    bad = _out_of_range(draft.target_layer_ids, n)
    if bad:
        problems.append(f"draft target_layer_ids={list(draft.target_layer_ids)} has {bad} "
                        f"outside [{-1 if draft.kind == DSPARK else 0}, {n - 2}] for a target "
                        f"with num_hidden_layers={n} (the last layer is not a usable feature)")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        problems.append(f"draft mask_token_id={draft.mask_token_id} is outside the target "
                        f"vocab_size={target.vocab_size}")
    if problems:
        raise ConfigError(f"{draft.kind} draft does not fit the {target.architecture} target: "
                          + "; ".join(problems))


def _out_of_range(ids: Sequence[int], num_target_layers: int) -> list[int]:
    return [i for i in ids if i < -1 or i > num_target_layers - 2]
