"""Tiny random HF checkpoints written with transformers' save_pretrained (test helper).

The weights are drawn with a larger std than HF's default init (and the norm weights are
perturbed away from 1) so greedy decoding has clear margins and a layer that forgets to
apply a norm weight is caught.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("qwen3", "llama")


def write_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    tied: bool = False,
    attention_bias: bool = False,
    max_shard_size: str | int | None = None,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.15,
    seed: int = 0,
    generation_eos: list[int] | None = None,
    **extra,
) -> Path:
    """Write config.json + safetensors (sharded with an index when max_shard_size is set)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    assert arch in ARCHS, arch
    config_cls, model_cls = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tied,
        attention_bias=attention_bias,
        initializer_range=init_std,
        max_position_embeddings=512,
        rope_theta=10000.0,
        eos_token_id=1,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.mul_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, init_std)
    path = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def load_hf(path: str | Path):
    """The transformers reference model for a checkpoint (fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
