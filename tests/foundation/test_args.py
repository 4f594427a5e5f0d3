"""RunConfig resolution: defaults, the deprecated DP-attention spelling, and every refusal."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dspark_launch.__main__ import main
from dspark_launch.args import parse_bytes, resolve_config
from dspark_launch.errors import ConfigError


def test_defaults_follow_the_world_size() -> None:
    cfg = resolve_config([], world_size=8)
    assert (cfg.tp_size, cfg.attn_dp_size, cfg.attn_tp_size) == (8, 1, 8)
    assert cfg.warnings == ()


def test_attn_dp_size_sets_the_attention_widths() -> None:
    cfg = resolve_config(["--attn-dp-size", "4"], world_size=8)
    assert (cfg.tp_size, cfg.attn_dp_size, cfg.attn_tp_size) == (8, 4, 2)


def test_deprecated_spelling_maps_to_attn_dp_size_with_one_warning() -> None:
    cfg = resolve_config(["--dp-size", "4", "--enable-dp-attention"], world_size=8)
    assert cfg.attn_dp_size == 4
    assert cfg == resolve_config(["--attn-dp-size", "4"], world_size=8)  # same resolved config
    assert cfg.warnings == (
        "--dp-size 4 --enable-dp-attention is deprecated; use --attn-dp-size 4",
    )


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (["--attn-dp-size", "3"], 8, "tp_size=8 is not divisible by attn_dp_size=3"),
        (["--tp-size", "4"], 8, "world_size=8 != tp_size=4"),
        (["--attn-dp-size", "2", "--dp-size", "2", "--enable-dp-attention"], 8,
         "--attn-dp-size=2 and the deprecated --dp-size=2 --enable-dp-attention=True were both"),
        (["--dp-size", "2"], 8, "--dp-size=2 without --enable-dp-attention"),
        (["--enable-dp-attention"], 8, "--enable-dp-attention needs --dp-size N"),
        (["--dp-size", "3", "--enable-dp-attention"], 8,
         "tp_size=8 is not divisible by attn_dp_size=3"),
        (["--page-size", "0"], 1, "--page-size=0 must be >= 1"),
        (["--max-new-tokens", "-1"], 1, "--max-new-tokens=-1 must be >= 1"),
        (["--top-p", "1.5"], 1, "--top-p=1.5 must be in (0, 1]"),
        (["--kv-cache-memory", "lots"], 1, "--kv-cache-memory='lots' is not a size"),
        (["--prompt", "a", "--prompts", "f"], 1, "--prompt and --prompts were both given"),
        (["--draft", "d"], 1, "--draft=d needs --model"),
    ],
)
def test_refusals_name_every_factor(argv: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_config(argv, world_size=world)
    assert message in str(err.value)


def test_plan_accepts_topologies_larger_than_the_world() -> None:
    cfg = resolve_config(["--plan", "--tp-size", "16", "--attn-dp-size", "16"], world_size=1)
    assert (cfg.tp_size, cfg.attn_tp_size) == (16, 1)


@pytest.mark.parametrize(
    "text,value",
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("4096", 4096)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_a_size_under_one_byte_says_so() -> None:
    with pytest.raises(ConfigError, match=r"--kv-cache-memory='0.5' is 0 bytes; give one byte"):
        parse_bytes("0.5", "--kv-cache-memory")


def test_entry_returns_2_with_one_line_and_no_traceback(capsys: pytest.CaptureFixture) -> None:
    assert main(["--attn-dp-size", "3", "--tp-size", "8", "--plan"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "dspark_launch: error: tp_size=8 is not divisible by attn_dp_size=3 "
        "(attn_tp_size = tp_size / attn_dp_size must be a whole number)"
    )


def test_a_flag_error_is_said_by_rank_0_alone(capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank parses the same flags to the same verdict: under torchrun each printed it
    (8 lines at tp8); now rank 0 does, and every rank exits 2."""
    monkeypatch.setenv("RANK", "1")
    assert main(["--attn-dp-size", "3", "--tp-size", "8"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["--attn-dp-size", "3", "--tp-size", "8"]) == 2
    assert capsys.readouterr().err.startswith("dspark_launch: error: tp_size=8 is not divisible")


def test_real_process_exit_code_2_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_launch", "--tp-size", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "world_size=1 != tp_size=3" in proc.stderr


def test_help_documents_every_flag() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_launch", "--help"], capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    for flag in ("--tp-size", "--attn-dp-size", "--dp-size", "--enable-dp-attention",
                 "--kv-cache-memory", "--plan", "--speculative-algorithm", "--dist-timeout"):
        assert flag in proc.stdout
