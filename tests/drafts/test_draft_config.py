"""DraftConfig parsing for both formats, default layer ids, and target compatibility checks."""

from __future__ import annotations

import pytest
from draft_checkpoints import draft_config_dict, tiny_target_config
from hypothesis import given
from hypothesis import strategies as st

from dspark_launch.errors import ConfigError
from dspark_launch.models.draft_config import (
    DraftConfig,
    build_target_layer_ids,
    detect_draft_kind,
    validate_against_target,
)


@pytest.mark.parametrize("n,k,expected", [
    (7, 3, [1, 2, 4]),  # round(2.5) -> 2: halves go to EVEN
    (9, 3, [1, 4, 6]),  # round(3.5) -> 4
    (36, 5, [1, 9, 17, 25, 33]),
    (40, 5, [1, 10, 19, 28, 37]),
    (28, 5, [1, 7, 13, 19, 25]),
    (36, 1, [18]),
])
def test_default_target_layer_ids(n, k, expected):
    assert build_target_layer_ids(n, k) == expected


@given(st.integers(5, 200), st.integers(2, 12))
def test_default_ids_span_one_to_n_minus_3(n, k):
    ids = build_target_layer_ids(n, k)
    assert len(ids) == k and ids[0] == 1 and ids[-1] == n - 3
    assert ids == sorted(ids)


def test_dflash_format_parses_nested_keys():
    target = tiny_target_config()
    raw = draft_config_dict(target, "DFLASH", block_size=16, num_layers=2,
                            target_layer_ids=[0, 2])
    cfg = DraftConfig.from_dict(raw)
    assert (cfg.kind, cfg.block_size, cfg.target_layer_ids) == ("DFLASH", 16, (0, 2))
    assert (cfg.mask_token_id, cfg.num_target_layers) == (255, 4)
    assert (cfg.markov_rank, cfg.has_confidence_head) == (0, False)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (64, 2, 16)
    validate_against_target(cfg, target)


def test_dspark_format_parses_flat_keys():
    target = tiny_target_config()
    raw = draft_config_dict(target, "DSPARK", block_size=7, num_layers=2,
                            target_layer_ids=[-1, 2], markov_rank=16, head_type="gated")
    cfg = DraftConfig.from_dict(raw)
    assert (cfg.kind, cfg.block_size, cfg.target_layer_ids) == ("DSPARK", 7, (-1, 2))
    assert (cfg.markov_rank, cfg.markov_head_type) == (16, "gated")
    assert cfg.has_confidence_head and cfg.confidence_with_markov
    validate_against_target(cfg, target)  # -1 (embedding output) is a valid DSpark feature


def test_missing_layer_ids_use_the_reference_default():
    target = tiny_target_config(num_hidden_layers=36)
    for kind in ("DFLASH", "DSPARK"):
        raw = draft_config_dict(target, kind, num_layers=5, write_layer_ids=False)
        raw.get("dflash_config", {}).pop("target_layer_ids", None)
        raw.pop("target_layer_ids", None)
        assert DraftConfig.from_dict(raw).target_layer_ids == (1, 9, 17, 25, 33)


def test_format_detection():
    target = tiny_target_config()
    assert detect_draft_kind(draft_config_dict(target, "DFLASH")) == "DFLASH"
    assert detect_draft_kind(draft_config_dict(target, "DSPARK")) == "DSPARK"
    assert detect_draft_kind({"dflash_config": {}}) == "DFLASH"
    assert detect_draft_kind({"markov_rank": 0}) == "DSPARK"
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM|cannot tell"):
        detect_draft_kind({"architectures": ["Qwen3ForCausalLM"]})
    # A target given as --draft: the message names the file it read
    with pytest.raises(ConfigError, match=r"^t/config.json: cannot tell the draft format"):
        DraftConfig.from_dict({"architectures": ["Qwen3ForCausalLM"]}, source="t/config.json")


@pytest.mark.parametrize("change,expected", [
    ({"hidden_size": 32}, ["hidden_size=32", "hidden_size=64"]),
    ({"vocab_size": 300}, ["vocab_size=300", "vocab_size=256"]),
    ({"num_target_layers": 36}, ["num_target_layers=36", "num_hidden_layers=4"]),
])
def test_target_mismatch_names_both_values(change, expected):
    target = tiny_target_config()
    raw = draft_config_dict(target, "DFLASH")
    raw.update(change)
    with pytest.raises(ConfigError) as err:
        validate_against_target(DraftConfig.from_dict(raw), target)
    for text in expected:
        assert text in str(err.value)


@pytest.mark.parametrize("kind,ids", [
    ("DFLASH", [0, 3]),  # 3 = the last layer: HF's last hidden state is post-norm
    ("DFLASH", [7]),
    ("DSPARK", [-1, 3]),
])
def test_layer_ids_out_of_range_are_refused(kind, ids):
    target = tiny_target_config()
    raw = draft_config_dict(target, kind, num_layers=len(ids), target_layer_ids=ids)
    with pytest.raises(ConfigError) as err:
        validate_against_target(DraftConfig.from_dict(raw), target)
    assert f"target_layer_ids={ids}" in str(err.value)
    assert "num_hidden_layers=4" in str(err.value)


def test_dflash_refuses_the_embedding_feature():
    raw = draft_config_dict(tiny_target_config(), "DFLASH", target_layer_ids=[-1, 1])
    with pytest.raises(ConfigError, match="below 0"):
        DraftConfig.from_dict(raw)


def test_bad_head_type_and_topology_are_refused():
    target = tiny_target_config()
    with pytest.raises(ConfigError, match="markov_head_type='lstm'"):
        DraftConfig.from_dict(draft_config_dict(target, "DSPARK", head_type="lstm"))
    cfg = DraftConfig.from_dict(draft_config_dict(target, "DFLASH", intermediate_size=100))
    with pytest.raises(ConfigError, match="intermediate_size=100.*attn_tp_size=8"):
        cfg.check_topology(8)
    cfg.check_topology(4)


@pytest.mark.parametrize("key,value", [("target_layer_ids", 3), ("mask_token_id", "x"),
                                       ("block_size", None), ("markov_rank", "32x")])
def test_values_of_the_wrong_kind_are_refused_naming_the_file(key, value):
    """Each of these was a traceback, exit 1."""
    raw = {**draft_config_dict(tiny_target_config(), "DSPARK"), key: value}
    with pytest.raises(ConfigError, match=r"draft.json: a value of the wrong kind"):
        DraftConfig.from_dict(raw, source="draft.json")
