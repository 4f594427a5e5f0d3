"""`serve` on the command line: its flags, and job-only flags refused by name."""

from __future__ import annotations

import pytest

from dspark_launch.args import resolve_config
from dspark_launch.errors import ConfigError


def test_serve_flags_are_parsed():
    cfg = resolve_config(["serve", "--port", "8123", "--max-queued-requests", "7",
                          "--shutdown-grace", "2.5", "--served-model-name", "m",
                          "--attn-dp-size", "1"], world_size=1)
    assert (cfg.serve, cfg.port, cfg.max_queued_requests, cfg.shutdown_grace,
            cfg.served_model_name, cfg.host) == (True, 8123, 7, 2.5, "m", "127.0.0.1")
    assert not resolve_config([], world_size=1).serve
    # Below plain torchrun's SIGKILL, 30 s after its SIGTERM: at 30 the requests still in
    # flight got a dropped connection, not their "abort" answer.
    assert resolve_config(["serve"], world_size=1).shutdown_grace < 30


@pytest.mark.parametrize("argv,named", [
    (["serve", "--prompts", "p.jsonl"], "--prompts"),
    (["serve", "--output", "o.jsonl"], "--output"),
    (["serve", "--port", "70000"], "--port=70000"),
    (["serve", "--max-queued-requests", "0"], "--max-queued-requests=0"),
    (["serve", "--shutdown-grace", "-1"], "--shutdown-grace=-1"),
    (["serve", "--shutdown-grace", "nan"], "--shutdown-grace=nan must be a finite number"),
    # Accepted and ignored before: the server answered greedily, 128 tokens, no metrics file
    (["serve", "--temperature", "0.7"], "--temperature does not apply to `serve`: each "
                                        "request sets its own"),
    (["serve", "--max-new-tokens", "3"], "--max-new-tokens does not apply"),
    (["serve", "--metrics-json", "m.json"], "--metrics-json does not apply.*GET /metrics"),
    (["serve", "--progress"], "--progress does not apply"),
    (["--resume", "--overwrite", "--output", "o.jsonl"], "--resume and --overwrite"),
])
def test_bad_serve_flags_are_refused_by_name(argv, named):
    with pytest.raises(ConfigError, match=named):
        resolve_config(argv, world_size=1)


def test_server_flags_only_exist_for_serve():
    with pytest.raises(SystemExit):
        resolve_config(["--port", "8000"], world_size=1)


def test_serve_help_lists_no_flag_serve_refuses(capsys):
    """`serve --help` listed the job's flags (--prompts, --output, --temperature, ...), each of
    which `serve` then refuses by name; the job's help keeps them."""
    from dspark_launch.args import build_parser

    job_only = ("--prompt", "--prompts", "--max-new-tokens", "--temperature", "--top-p",
                "--top-k", "--output", "--overwrite", "--resume", "--metrics-json",
                "--progress", "--plan", "--json")
    serve_help = build_parser(serve=True).format_help()
    job_help = build_parser().format_help()
    for flag in job_only:
        assert f"{flag} " not in serve_help and f"{flag}]" not in serve_help, flag
        assert f"{flag} " in job_help or f"{flag}]" in job_help, flag
    switches = ("--overwrite", "--resume", "--progress", "--plan")
    for flag in job_only[:-1]:  # --json alone is the plan's switch
        argv = ["serve", flag] + ([] if flag in switches else ["0.5" if flag == "--top-p" else "3"])
        with pytest.raises(ConfigError, match=f"{flag} does not apply to `serve`"):
            resolve_config(argv, world_size=1)
