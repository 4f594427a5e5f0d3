"""ModelConfig parsing: both rope spellings, eos sources, defaults, dtype override."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_launch.errors import ConfigError
from dspark_launch.models.config import ModelConfig, parse_dtype

BASE = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
}


def test_rope_spellings_and_defaults():
    old = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "eos_token_id": 7})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 5e5}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.eos_token_ids == (7,) and new.eos_token_ids == ()
    assert old.qk_norm and old.dtype == torch.float32


@pytest.mark.parametrize("arch,config_class", [("Qwen3ForCausalLM", "Qwen3Config"),
                                               ("LlamaForCausalLM", "LlamaConfig")])
def test_missing_fields_read_as_transformers_reads_them(arch, config_class):
    """A field config.json leaves out means what it means to transformers: Qwen3's head_dim
    is 128 and its KV heads 32 (not hidden / heads and heads, which made a checkpoint
    transformers loads a refused one and one it refuses a running one), Llama's context
    2048, and a rope_theta set nowhere is 10000."""
    import transformers

    raw = {k: v for k, v in BASE.items()
           if k not in ("max_position_embeddings", "head_dim", "num_key_value_heads")}
    raw.update(architectures=[arch], num_attention_heads=32)
    ours = ModelConfig.from_dict(raw)
    theirs = getattr(transformers, config_class)(**{k: v for k, v in raw.items()
                                                   if k != "architectures"})
    for name in ("head_dim", "num_key_value_heads", "max_position_embeddings"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 10000.0


def test_rope_theta_given_twice_must_agree():
    """transformers 5 takes rope_parameters' value and older versions the top-level one: two
    values that disagree ran RoPE frequencies of one while transformers ran the other's."""
    both = {**BASE, "rope_theta": 1e6, "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 100.0}}
    with pytest.raises(ConfigError, match=r"rope_theta=1000000.0 and "
                                          r"rope_parameters.rope_theta=100.0 disagree"):
        ModelConfig.from_dict(both)
    same = {**both, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert ModelConfig.from_dict(same).rope_theta == 1e6


def test_odd_head_dim_refused_before_the_weights_load():
    """It loaded, then the first forward failed with a shape error naming no config value."""
    with pytest.raises(ConfigError, match="head_dim=15 must be even"):
        ModelConfig.from_dict({**BASE, "rope_theta": 1e4, "head_dim": 15})


def test_explicit_head_dim_and_llama():
    cfg = ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                                 "head_dim": 32, "num_key_value_heads": 2,
                                 "rope_theta": 1e4, "dtype": "bfloat16"})
    assert cfg.head_dim == 32 and not cfg.qk_norm and cfg.dtype == torch.bfloat16


def test_generation_config_eos_wins():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 1e4, "eos_token_id": 3},
                                {"eos_token_id": [4, 5]})
    assert cfg.eos_token_ids == (4, 5)


def test_from_pretrained_reads_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "rope_theta": 1e4,
                                                      "torch_dtype": "float16"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.eos_token_ids == (9,) and cfg.dtype == torch.float16


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"vocab_size": None}, "vocab_size"),
    # An FP8 checkpoint loaded without its scales and wrote garbage
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized weights.*'fp8'"),
    ({"num_attention_heads": "eight"}, "wrong kind"),  # these were tracebacks
    ({"rope_parameters": [1e4]}, "wrong kind"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be >= 1"),
    ({"vocab_size": 0}, "vocab_size=0 must be >= 1"),
    ({"architectures": "Qwen3ForCausalLM", "vocab_size": 5}, None),  # a string: one name
])
def test_refusals(change, needle):
    raw = {**BASE, "rope_theta": 1e4, **change}
    if raw.get("vocab_size") is None:
        raw.pop("vocab_size")
    if needle is None:  # accepted
        assert ModelConfig.from_dict(raw).architecture == "Qwen3ForCausalLM"
        return
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        ModelConfig.from_dict([raw])


def test_parse_dtype():
    assert parse_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert parse_dtype("torch.float16") == torch.float16
    with pytest.raises(ConfigError, match="int8"):
        parse_dtype("int8")
