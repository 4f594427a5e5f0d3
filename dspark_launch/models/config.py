"""ModelConfig: the target architecture parsed from an HF `config.json`, plus topology checks.

Only what the engine needs is kept; anything we cannot run faithfully (rope scaling, sliding
windows, MLP biases, quantized weights, other architectures) is refused with a ConfigError
instead of silently producing different tokens than transformers would, and so is a value of
the wrong kind.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark_launch.errors import ConfigError
from dspark_launch.memory.geometry import dtype_from_name

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
# What transformers puts where config.json leaves a field out (Qwen3Config, LlamaConfig): the
# same checkpoint must mean the same model here. None: derived (hidden / heads; heads).
_MISSING = {
    "Qwen3ForCausalLM": {"head_dim": 128, "num_key_value_heads": 32,
                         "max_position_embeddings": 32768},
    "LlamaForCausalLM": {"head_dim": None, "num_key_value_heads": None,
                         "max_position_embeddings": 2048},
}
DEFAULT_ROPE_THETA = 10000.0  # transformers' default_theta where no config sets one


def run_dtype(dtype: str, on_cpu: bool) -> str:
    """The --dtype a run computes in: on CPU "auto" is fp32 (bf16 matmuls there are slow and
    flip near-ties between a batched verify and one-token decoding); elsewhere "auto" keeps
    the checkpoint's dtype. The launch and --plan --device cpu both read it."""
    return "float32" if dtype == "auto" and on_cpu else dtype


def parse_dtype(value: str | torch.dtype | None, default: torch.dtype = torch.float32
                ) -> torch.dtype:
    """'bfloat16' / 'torch.float16' / torch.dtype / None ('auto') -> torch.dtype."""
    if value is None or value == "auto":
        return default
    return dtype_from_name(value)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
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
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: torch.dtype  # the checkpoint's dtype (the --dtype override is applied by the loader)
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qk_norm(self) -> bool:
        # Qwen3 normalises q and k per head before RoPE; Llama does not.
        return self.architecture == "Qwen3ForCausalLM"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                  source: str = "config.json") -> ModelConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("quantization_config"):
            # Its scales would be loaded nowhere: an FP8 checkpoint ran, and wrote garbage
            method = raw["quantization_config"]
            method = method.get("quant_method") if isinstance(method, Mapping) else method
            raise ConfigError(f"{source}: quantized weights (quantization_config "
                              f"{method!r}) are not supported; use the unquantized checkpoint")
        archs = raw.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act={raw['hidden_act']!r}; only 'silu' is "
                              f"supported")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            missing = _MISSING[arch]
            head_dim = raw.get("head_dim", missing["head_dim"]) or hidden // heads
            kv_heads = raw.get("num_key_value_heads", missing["num_key_value_heads"]) or heads
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(kv_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw, source),
                max_position_embeddings=int(raw.get("max_position_embeddings",
                                                    missing["max_position_embeddings"])),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                dtype=parse_dtype(raw.get("dtype") or raw.get("torch_dtype")),
                eos_token_ids=_eos_ids(generation, raw),
            )
        except KeyError as err:
            raise ConfigError(f"{source}: missing key {err.args[0]!r}") from None
        except ZeroDivisionError:
            raise ConfigError(f"{source}: num_attention_heads=0 must be >= 1") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise ConfigError(f"{source}: a value of the wrong kind ({err})") from None
        sizes = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                 "num_hidden_layers", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim")}
        if bad := {k: v for k, v in sizes.items() if v < 1}:
            raise ConfigError(f"{source}: " + ", ".join(f"{k}={v}" for k, v in bad.items())
                              + " must be >= 1")
        if cfg.head_dim % 2:
            raise ConfigError(f"{source}: head_dim={cfg.head_dim} must be even (rotary "
                              f"embeddings turn pairs of dimensions)")
        if heads % cfg.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of "
                              f"num_key_value_heads={cfg.num_key_value_heads}")
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{path}: no config.json (is this an HF checkpoint directory?)")
        raw = _read_json(cfg_file)
        gen_file = path / "generation_config.json"
        generation = _read_json(gen_file) if gen_file.is_file() else None
        return cls.from_dict(raw, generation, source=str(cfg_file))

    def check_topology(self, tp_size: int, attn_tp_size: int) -> None:
        """Refuse head/width counts the live topology cannot shard, naming every factor."""
        attn_dp = tp_size // attn_tp_size
        where = f"attn_tp_size={attn_tp_size} (tp_size={tp_size} / attn_dp_size={attn_dp})"
        problems = []
        if self.num_attention_heads % attn_tp_size:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible "
                            f"by {where}")
        kv = self.num_key_value_heads
        if kv % attn_tp_size and attn_tp_size % kv:
            problems.append(f"num_key_value_heads={kv} and {where} must divide one another "
                            f"(KV heads are split when kv >= attn_tp, replicated when fewer)")
        if self.intermediate_size % tp_size:
            problems.append(f"intermediate_size={self.intermediate_size} is not divisible by "
                            f"tp_size={tp_size} (the MLP is sharded over the full TP group)")
        if problems:
            raise ConfigError(f"{self.architecture} cannot be sharded: " + "; ".join(problems))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: unreadable JSON ({err})") from None


def _rope_theta(raw: Mapping[str, Any], source: str) -> float:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    for block in (params, scaling):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind not in ("default", None):
            raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported "
                              f"(only 'default')")
    # Two values that disagree are refused: transformers' versions read them in other orders.
    given = {name: value for name, value in (
        ("rope_theta", raw.get("rope_theta")),
        ("rope_parameters.rope_theta", params.get("rope_theta")),
        ("rope_scaling.rope_theta", scaling.get("rope_theta"))) if value is not None}
    if len({float(v) for v in given.values()}) > 1:
        raise ConfigError(f"{source}: " + " and ".join(f"{k}={v}" for k, v in given.items())
                          + " disagree; keep one")
    return float(next(iter(given.values()), DEFAULT_ROPE_THETA))


def _eos_ids(generation: Mapping[str, Any] | None, raw: Mapping[str, Any]) -> tuple[int, ...]:
    value = (generation or {}).get("eos_token_id")
    if value is None:
        value = raw.get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
