"""Tiny random DFlash (z-lab) and DSpark (DeepSpec) draft checkpoints (test helper).

Written directly with safetensors (there is no transformers class for either format), in
fp32, for a tiny target. The default target geometry matches tests/checkpoints.py's
`write_checkpoint` defaults except for depth (4 layers, so several feature ids are usable).
Norm weights are perturbed away from 1 so a missed norm weight is caught.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dspark_launch.models.config import ModelConfig
from dspark_launch.models.draft_config import build_target_layer_ids


def tiny_target_config(**overrides: Any) -> ModelConfig:
    """A ModelConfig for a tiny Qwen3 target (no weights needed by draft-only tests)."""
    raw = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "dtype": "float32",
    }
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def draft_config_dict(target: ModelConfig, kind: str = "DFLASH", *, block_size: int = 4,
                      num_layers: int = 2, target_layer_ids: Sequence[int] | None = None,
                      write_layer_ids: bool = True, markov_rank: int = 8,
                      head_type: str = "vanilla", confidence: bool = True,
                      confidence_with_markov: bool = True, intermediate_size: int | None = None,
                      num_heads: int | None = None, num_kv_heads: int | None = None,
                      head_dim: int | None = None, mask_token_id: int | None = None,
                      **extra: Any) -> dict:
    if target_layer_ids is not None:
        ids = list(target_layer_ids)
    elif write_layer_ids:
        ids = list(range(min(num_layers, target.num_hidden_layers - 1)))
    else:  # what the parser will default to, so fc gets the right width
        ids = build_target_layer_ids(target.num_hidden_layers, num_layers)
    mask = target.vocab_size - 1 if mask_token_id is None else mask_token_id
    raw: dict[str, Any] = {
        "model_type": "qwen3", "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads or target.num_attention_heads,
        "num_key_value_heads": num_kv_heads or target.num_key_value_heads,
        "head_dim": head_dim or target.head_dim, "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False, "attention_bias": False, "dtype": "float32",
        "block_size": block_size, "num_target_layers": target.num_hidden_layers,
    }
    if kind == "DFLASH":
        raw["architectures"] = ["DFlashDraftModel"]
        raw["dflash_config"] = {"mask_token_id": mask, "target_layer_ids": ids}
    else:
        raw["architectures"] = ["Qwen3DSparkModel"]
        raw.update(mask_token_id=mask, num_anchors=512, markov_rank=markov_rank,
                   markov_head_type=head_type, enable_confidence_head=confidence,
                   confidence_head_with_markov=confidence_with_markov, target_layer_ids=ids)
    raw.update(extra)
    return raw


def random_draft_tensors(raw: Mapping[str, Any], *, scale: float = 1.0, std: float = 0.15,
                         seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint-named fp32 tensors for a draft config dict (DFlash or DSpark)."""
    gen = torch.Generator().manual_seed(seed)
    d, i_size, v = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    h, kv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    dspark = raw["architectures"] == ["Qwen3DSparkModel"]
    ids = raw["target_layer_ids"] if dspark else raw["dflash_config"]["target_layer_ids"]
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (d, len(ids) * d)}
    norms = ["hidden_norm.weight", "norm.weight"]
    for n in range(raw["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, h * hd),
            p + "mlp.gate_proj.weight": (i_size, d), p + "mlp.up_proj.weight": (i_size, d),
            p + "mlp.down_proj.weight": (d, i_size),
        })
        norms += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if dspark:
        r = raw["markov_rank"]
        shapes.update({"embed_tokens.weight": (v, d), "lm_head.weight": (v, d)})
        if r > 0:
            shapes.update({"markov_head.markov_w1.weight": (v, r),
                           "markov_head.markov_w2.weight": (v, r)})
            if raw["markov_head_type"] == "gated":  # DeepSpec: a default nn.Linear
                shapes.update({"markov_head.gate_proj.weight": (r, d + r),
                               "markov_head.gate_proj.bias": (r,)})
            if raw["markov_head_type"] == "rnn":
                shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d),
                               "markov_head.joint_proj.bias": (3 * r,)})
        if raw["enable_confidence_head"]:
            conf_in = d + (r if raw["confidence_head_with_markov"] and r > 0 else 0)
            shapes.update({"confidence_head.proj.weight": (1, conf_in),
                           "confidence_head.proj.bias": (1,)})
    out = {k: torch.randn(s, generator=gen) * std * scale for k, s in shapes.items()}
    for k in norms:
        width = hd if ("q_norm" in k or "k_norm" in k) else d
        out[k] = 1.0 + 0.2 * torch.randn(width, generator=gen)
    return out


def write_draft(path: str | Path, target: ModelConfig, kind: str = "DFLASH", *,
                scale: float = 1.0, seed: int = 0, drop: Iterable[str] = (),
                replace: Mapping[str, torch.Tensor] | None = None,
                config_overrides: Mapping[str, Any] | None = None, **options: Any) -> Path:
    """Write config.json + model.safetensors; returns the directory.

    options go to draft_config_dict (block_size, num_layers, target_layer_ids, markov_rank,
    head_type, confidence, ...); `drop` removes tensors and `replace` swaps them (for
    bad-checkpoint tests); config_overrides are applied to config.json AFTER the tensors
    are drawn (so a config can disagree with its weights).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = draft_config_dict(target, kind, **options)
    tensors = random_draft_tensors(raw, scale=scale, seed=seed)
    for name in drop:
        tensors.pop(name)
    tensors.update(replace or {})
    if not options.get("write_layer_ids", True):
        raw.get("dflash_config", {}).pop("target_layer_ids", None)
        raw.pop("target_layer_ids", None)
    raw.update(config_overrides or {})
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path / "model.safetensors"))
    return path
