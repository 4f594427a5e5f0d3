"""Checkpoint key set / shapes round-trip (models.md §5.2) and every bad-checkpoint refusal."""

from __future__ import annotations

import pytest
import torch
from draft_checkpoints import tiny_target_config, write_draft
from safetensors.torch import load_file

from dspark_launch.errors import ConfigError
from dspark_launch.models.dflash import DFlashDraft
from dspark_launch.models.draft_loader import load_draft
from dspark_launch.models.dspark import DSparkDraft
from dspark_launch.parallel import override_parallel

TARGET = tiny_target_config()
V, D = TARGET.vocab_size, TARGET.hidden_size


@pytest.fixture(autouse=True)
def single_rank():
    with override_parallel(1):
        yield


def _unfused(model) -> dict[str, torch.Tensor]:
    """Our parameters back under checkpoint names (one rank holds everything)."""
    out = {}
    for name, t in model.state_dict().items():
        if ".qkv_proj." in name:
            qkv = model.get_submodule(name.rsplit(".", 2)[0] + ".qkv_proj")
            parts = t.split([qkv.q_size, qkv.kv_size, qkv.kv_size])
            for sub, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[name.replace("qkv_proj", sub)] = part
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("kind,options", [
    ("DFLASH", {"num_layers": 2}),
    ("DSPARK", {"num_layers": 2, "markov_rank": 8}),
    ("DSPARK", {"num_layers": 1, "markov_rank": 4, "head_type": "gated"}),
    ("DSPARK", {"num_layers": 1, "markov_rank": 4, "head_type": "rnn"}),
    ("DSPARK", {"num_layers": 1, "markov_rank": 0, "confidence": False}),
])
def test_key_set_and_shapes_round_trip(tmp_path, kind, options):
    path = write_draft(tmp_path / "d", TARGET, kind, **options)
    on_disk = load_file(str(path / "model.safetensors"))
    model = load_draft(path, TARGET)
    assert isinstance(model, DSparkDraft if kind == "DSPARK" else DFlashDraft)
    ours = _unfused(model)
    copies = {"embed_tokens.weight", "lm_head.weight"}
    assert set(ours) == set(on_disk) - copies  # exactly the checkpoint's names
    for name, tensor in ours.items():
        assert torch.equal(tensor, on_disk[name]), name
    m = model.config.num_features
    assert tuple(on_disk["fc.weight"].shape) == (D, m * D)
    if kind == "DFLASH":
        assert not copies & set(on_disk)  # DFlash uses the target's embedding and head
    else:
        assert copies <= set(on_disk)
        r = model.config.markov_rank
        if r:
            assert tuple(on_disk["markov_head.markov_w1.weight"].shape) == (V, r)
            assert tuple(on_disk["markov_head.markov_w2.weight"].shape) == (V, r)
        if model.config.has_confidence_head:
            assert tuple(on_disk["confidence_head.proj.weight"].shape) == (1, D + r)


def test_dtype_override(tmp_path):
    model = load_draft(write_draft(tmp_path / "d", TARGET), TARGET, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _refused(tmp_path, kind="DSPARK", target=TARGET, **kwargs) -> str:
    path = write_draft(tmp_path / "bad", TARGET, kind, **kwargs)
    with pytest.raises(ConfigError) as err:
        load_draft(path, target)
    return str(err.value)


@pytest.mark.parametrize("tensor", ["markov_head.markov_w1.weight",
                                    "markov_head.markov_w2.weight"])
def test_missing_markov_weights(tmp_path, tensor):
    msg = _refused(tmp_path, drop=[tensor])
    assert tensor in msg and "markov_rank=8" in msg


def test_markov_rank_disagrees_with_weights(tmp_path):
    msg = _refused(tmp_path, markov_rank=8, config_overrides={"markov_rank": 4})
    assert "markov_head.markov_w1.weight" in msg
    assert "[256, 8]" in msg and "markov_rank=4" in msg


def test_markov_weights_under_rank_zero(tmp_path):
    msg = _refused(tmp_path, markov_rank=8, config_overrides={"markov_rank": 0})
    assert "markov_head.markov_w1.weight" in msg and "markov_rank=0" in msg


def test_wrong_shape_names_both_shapes(tmp_path):
    msg = _refused(tmp_path, "DFLASH",
                   replace={"layers.1.self_attn.k_proj.weight": torch.zeros(48, D)})
    assert "layers.1.self_attn.k_proj.weight" in msg
    assert "[48, 64]" in msg and "[32, 64]" in msg


def test_missing_tensor_is_named(tmp_path):
    msg = _refused(tmp_path, "DFLASH", drop=["layers.0.mlp.up_proj.weight"])
    assert "layers.0.mlp.up_proj.weight" in msg


def test_target_copy_with_wrong_shape(tmp_path):
    msg = _refused(tmp_path, replace={"lm_head.weight": torch.zeros(300, D)})
    assert "lm_head.weight" in msg and "[300, 64]" in msg and "[256, 64]" in msg


def test_unexpected_tensor_is_refused(tmp_path):
    # A gated head's gate_proj under a vanilla config: weights and config disagree.
    msg = _refused(tmp_path, replace={"markov_head.gate_proj.weight": torch.zeros(8, D + 8)})
    assert "markov_head.gate_proj.weight" in msg


@pytest.mark.parametrize("kind", ["DFLASH", "DSPARK"])
def test_target_mismatch_refused_at_load(tmp_path, kind):
    other = tiny_target_config(hidden_size=32, vocab_size=512)
    msg = _refused(tmp_path, kind, target=other)
    assert "hidden_size=64" in msg and "hidden_size=32" in msg
    assert "vocab_size=256" in msg and "vocab_size=512" in msg


def test_layer_ids_beyond_target_refused_at_load(tmp_path):
    msg = _refused(tmp_path, "DFLASH", num_layers=2, target_layer_ids=[1, 3])
    assert "target_layer_ids=[1, 3]" in msg and "num_hidden_layers=4" in msg


@pytest.mark.parametrize("head_type,bias", [("gated", "markov_head.gate_proj.bias"),
                                             ("rnn", "markov_head.joint_proj.bias")])
def test_checkpoint_without_projection_bias_loads_with_bias_zero(tmp_path, head_type, bias):
    path = write_draft(tmp_path / "d", TARGET, "DSPARK", head_type=head_type, drop=[bias])
    proj = load_draft(path, TARGET).get_submodule(bias.rsplit(".", 1)[0])
    assert proj.bias is None  # F.linear without a bias: exactly bias 0


def test_projection_bias_with_wrong_shape_is_named(tmp_path):
    msg = _refused(tmp_path, head_type="gated",
                   replace={"markov_head.gate_proj.bias": torch.zeros(5)})
    assert "markov_head.gate_proj.bias" in msg and "[5]" in msg and "[8]" in msg


def test_no_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_draft(tmp_path, TARGET)
