"""A DSpark checkpoint's own embed_tokens / lm_head copies must equal the target's (the engine
uses the target's): a draft paired with another target of the same shape is refused by name,
per rank on the rank's own vocab shard, and the whole job stops with exit 2 on every rank."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from checkpoints import write_checkpoint
from draft_checkpoints import target_copies, tiny_target_config, write_draft
from jobs import _model_config, model_args
from multirank import run_world

from dspark_launch.__main__ import main
from dspark_launch.errors import ConfigError
from dspark_launch.models.draft_loader import load_draft
from dspark_launch.models.loader import load_model
from dspark_launch.parallel import override_parallel

TARGET = tiny_target_config(num_hidden_layers=2)  # vocab 256, hidden 64


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    untied = write_checkpoint(root / "untied", "qwen3", num_layers=2, seed=0)
    other = write_checkpoint(root / "other", "qwen3", num_layers=2, seed=1)  # same shape
    tied = write_checkpoint(root / "tied", "qwen3", num_layers=2, tied=True, seed=2)
    return {"untied": untied, "other": other, "tied": tied}


def _load(tmp_path, target_dir, copies_from, replace=None):
    draft = write_draft(tmp_path / "draft", TARGET, "DSPARK", num_layers=1,
                        target_layer_ids=[0], target_weights=copies_from, replace=replace)
    with override_parallel(1):
        return load_draft(draft, TARGET, target_model=load_model(target_dir))


def _refusal(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        _load(*args, **kwargs)
    return str(err.value)


@pytest.mark.parametrize("target", ["untied", "tied"])
def test_copies_of_the_target_load(tmp_path, targets, target):
    draft = _load(tmp_path, targets[target], targets[target])
    assert draft.config.markov_rank > 0


def test_draft_trained_against_another_target_is_refused_by_name(tmp_path, targets):
    msg = _refusal(tmp_path, targets["untied"], targets["other"])
    assert "'embed_tokens.weight'" in msg and "model.embed_tokens.weight" in msg
    assert str(tmp_path / "draft") in msg and "different target" in msg


@pytest.mark.parametrize("target,target_name", [
    ("untied", "lm_head.weight"), ("tied", "model.embed_tokens.weight (tied lm_head)")])
def test_only_the_head_copy_differs(tmp_path, targets, target, target_name):
    """The embedding copy matches but one value of the head copy is off by 1e-3."""
    head = target_copies(targets[target])["lm_head.weight"].clone()
    head[200, 7] += 1e-3
    msg = _refusal(tmp_path, targets[target], targets[target], {"lm_head.weight": head})
    assert "'lm_head.weight'" in msg and target_name in msg
    assert "in 1 of 16384 values" in msg  # 256 x 64, one rank holds the whole vocabulary


def test_bf16_copies_of_an_fp32_target_are_equal_up_to_the_cast(tmp_path, targets):
    """A trainer that saved its frozen copies in bf16: equal within one bf16 ulp, accepted;
    the same bf16 copies with one value moved by a single bf16 ulp beyond are refused."""
    copies = {k: t.to(torch.bfloat16) for k, t in target_copies(targets["untied"]).items()}
    _load(tmp_path / "ok", targets["untied"], targets["untied"], copies)
    embed = copies["embed_tokens.weight"].clone()
    x = embed[3, 3].float()
    embed[3, 3] = (x * (1 + 2 * torch.finfo(torch.bfloat16).eps)).to(torch.bfloat16)
    msg = _refusal(tmp_path / "bad", targets["untied"], targets["untied"],
                   {**copies, "embed_tokens.weight": embed})
    assert "'embed_tokens.weight'" in msg and "in 1 of" in msg


# ----------------------------------------------------------------------------- whole jobs


def _job(rank: int, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main([*argv, "--dist-timeout", "120", "--log-level", "WARNING", "--device", "cpu"])
    return rc, "\n".join(line for line in err.getvalue().splitlines()
                         if line.startswith("dspark_launch:"))


def _bad_draft(tiny, path, rows: slice):
    """A DSpark draft for the jobs' target whose embedding copy differs on `rows` only."""
    embed = target_copies(tiny.target)["embed_tokens.weight"].clone()  # [128, 32]
    embed[rows] += 0.05
    write_draft(path, _model_config(tiny.target), "DSPARK", num_layers=1,
                target_layer_ids=[0, 1], target_weights=tiny.target,
                replace={"embed_tokens.weight": embed})
    return [*model_args(tiny, "DSPARK", draft=path), "--prompts", str(tiny.prompts12),
            "--max-new-tokens", "4", "--kv-cache-memory", "16MiB",
            "--output", str(path / "out.jsonl")]


def test_cli_exits_2_naming_both_tensors(tiny, tmp_path):
    rc, said = _job(0, _bad_draft(tiny, tmp_path / "d", slice(None)))
    assert rc == 2
    assert said.startswith("dspark_launch: error: ") and "'embed_tokens.weight'" in said
    assert "model.embed_tokens.weight" in said and "\n" not in said  # one line, no traceback
    assert not (tmp_path / "d" / "out.jsonl").exists()


def test_mismatch_in_one_ranks_vocab_shard_stops_every_rank(tiny, tmp_path):
    """tp2: rank 1 owns ids [64, 128); only its rows differ, so only rank 1 sees it, and the
    startup agreement turns that into exit 2 on both ranks, rank 0 naming rank 1."""
    argv = [*_bad_draft(tiny, tmp_path / "d", slice(100, 101)), "--tp-size", "2"]
    results = run_world(2, _job, argv, timeout=90)
    assert [rc for rc, _ in results] == [2, 2]
    said = results[0][1]
    assert results[1][1] == ""  # rank 0 speaks, once
    assert said.startswith("dspark_launch: error: on rank(s) [1]: ")
    assert "'embed_tokens.weight'" in said and "vocab rows [64, 128)" in said
