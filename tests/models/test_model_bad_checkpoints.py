"""Every broken checkpoint ends in one ConfigError naming what is wrong (exit code 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from safetensors.torch import load_file, save_file

from dspark_launch.errors import ConfigError
from dspark_launch.models.loader import load_model
from dspark_launch.parallel import override_parallel


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pristine")
    return {
        "single": write_checkpoint(base / "single", "qwen3", num_kv_heads=2),
        "sharded": write_checkpoint(base / "sharded", "qwen3", max_shard_size="40KB"),
    }


@pytest.fixture
def ckpt(pristine, tmp_path, request) -> Path:
    kind = getattr(request, "param", "single")
    dst = tmp_path / kind
    shutil.copytree(pristine[kind], dst)
    return dst


def _load_error(path: Path, tp: int = 1, attn_dp: int = 1) -> str:
    with override_parallel(tp, attn_dp), pytest.raises(ConfigError) as info:
        load_model(path, "float32")
    assert info.value.exit_code == 2
    return str(info.value)


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    assert "no config.json" in _load_error(ckpt)


def test_unsupported_architecture(ckpt):
    _edit_config(ckpt, architectures=["MistralForCausalLM"])
    msg = _load_error(ckpt)
    assert "MistralForCausalLM" in msg
    assert "Qwen3ForCausalLM" in msg and "LlamaForCausalLM" in msg


def test_rope_scaling_refused(ckpt):
    _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4})
    assert "rope scaling type 'yarn'" in _load_error(ckpt)


def test_no_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    assert "no *.safetensors" in _load_error(ckpt)


@pytest.mark.parametrize("ckpt", ["sharded"], indirect=True)
def test_missing_shard_named(ckpt):
    victim = sorted(ckpt.glob("model-*.safetensors"))[1]
    victim.unlink()
    msg = _load_error(ckpt)
    assert victim.name in msg and "missing" in msg


@pytest.mark.parametrize("ckpt", ["single", "sharded"], indirect=True)
def test_truncated_file_named(ckpt):
    victim = max(ckpt.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    msg = _load_error(ckpt)
    assert victim.name in msg and "truncated" in msg


def test_truncated_header(ckpt):
    victim = ckpt / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:20])
    assert "model.safetensors" in _load_error(ckpt)


def _rewrite(ckpt: Path, edit) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def test_wrong_shape_names_tensor_and_both_shapes(ckpt):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    msg = _load_error(ckpt)
    assert name in msg and "[16, 64]" in msg and "[32, 64]" in msg


def test_wrong_shape_of_a_replicated_tensor(ckpt):
    name = "model.norm.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, torch.ones(65)))
    msg = _load_error(ckpt)
    assert name in msg and "[65]" in msg and "[64]" in msg


def test_missing_tensor_named(ckpt):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(ckpt, lambda t: t.pop(name))
    msg = _load_error(ckpt)
    assert "missing" in msg and name in msg


def test_missing_lm_head_when_untied(ckpt):
    _rewrite(ckpt, lambda t: t.pop("lm_head.weight"))
    assert "'lm_head.weight'" in _load_error(ckpt)


def test_heads_not_divisible_names_every_factor(ckpt):
    # 8 q heads / 2 KV heads / I=128 over tp 3: all three factors fail
    msg = _load_error(ckpt, tp=3)
    assert "num_attention_heads=8" in msg and "attn_tp_size=3" in msg
    assert "num_key_value_heads=2" in msg and "intermediate_size=128" in msg
    assert "tp_size=3" in msg


def test_kv_heads_neither_split_nor_replicated(pristine, tmp_path):
    path = write_checkpoint(tmp_path / "kv3", "llama", num_heads=12, num_kv_heads=3,
                            hidden_size=48, head_dim=4, intermediate_size=96)
    msg = _load_error(path, tp=4)
    assert "num_key_value_heads=3" in msg and "attn_tp_size=4" in msg
    assert "num_attention_heads" not in msg  # 12 % 4 == 0: only the failing factor is named


def test_dp_attention_topology_checks_attn_tp_not_tp(ckpt):
    # tp 16 / attn-dp 2 -> attn_tp 8: heads 8 fine, 2 KV heads replicated; I=128 % 16 fine
    with override_parallel(16, 2):
        model = load_model(ckpt, "float32")
    assert model.model.layers[0].self_attn.qkv_proj.kv_heads == 1
