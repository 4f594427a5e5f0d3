"""Bad input: one clear line, exit code 2 for configuration errors, no traceback, no hang, and
per-request refusals that leave every other request's output intact."""

from __future__ import annotations

import pytest
from jobs import (
    AMPLE,
    QUIET,
    model_args,
    read_jsonl,
    run_job,
    topology,
    with_tokenizer,
    write_prompts,
)


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    from dspark_launch.__main__ import main

    rc = main([*argv, *QUIET])
    err = capsys.readouterr().err
    return rc, err


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = [x for x in err.splitlines() if x.startswith("dspark_launch: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unreadable_prompts_file(tiny, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    rc, err = run_main([*model_args(tiny, "NONE"), "--prompts", str(missing), *AMPLE], capsys)
    assert rc == 2
    assert_one_line_error(err, f"--prompts={missing}", "cannot read")
    rc, err = run_main([*model_args(tiny, "NONE"), "--prompts", str(tmp_path), *AMPLE], capsys)
    assert rc == 2
    assert_one_line_error(err, "cannot read")


def test_malformed_jsonl_line_is_named(tiny, tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text('{"input_ids": [3, 4]}\n\n{"input_ids": [5, 6]}\n{"input_ids": [7,\n')
    out = tmp_path / "out.jsonl"
    rc, err = run_main([*model_args(tiny, "NONE"), "--prompts", str(p), "--output", str(out),
                        *AMPLE], capsys)
    assert rc == 2
    assert_one_line_error(err, "line 4", "not valid JSON")
    assert not out.exists()
    p.write_text('{"input_ids": [3, 4]}\n{"text": "no prompt key"}\n')
    rc, err = run_main([*model_args(tiny, "NONE"), "--prompts", str(p), *AMPLE], capsys)
    assert rc == 2
    assert_one_line_error(err, "line 2", "'prompt'", "'input_ids'")


def test_jsonl_name_means_jsonl(tiny, tmp_path, capsys):
    """A *.jsonl file whose first line is not JSON is refused by line number, never read as
    plain text; the same lines in a file of another name are plain-text prompts."""
    from dspark_launch.engine.inputs import read_prompt_file

    lines = "def f(x):\n{\"prompt\": \"a\"}\n"
    p = tmp_path / "p.jsonl"
    p.write_text(lines)
    rc, err = run_main([*model_args(tiny, "NONE"), "--prompts", str(p), *AMPLE], capsys)
    assert rc == 2
    assert_one_line_error(err, f"--prompts={p} line 1", "not valid JSON")
    txt = tmp_path / "p.txt"
    txt.write_text(lines)
    assert [r["prompt"] for r in read_prompt_file(str(txt))] == ["def f(x):", '{"prompt": "a"}']
    # A plain-text file whose first line only starts with "{" (code) is plain text too: it
    # was refused as invalid JSON on line 1
    txt.write_text("{x: 1 for x in y}\ndef g():\n")
    assert [r["prompt"] for r in read_prompt_file(str(txt))] == ["{x: 1 for x in y}",
                                                                  "def g():"]
    p.write_text('\n{"prompt": "a"}\nnot json\n')  # blank lines keep their numbers
    with pytest.raises(Exception, match="line 3: not valid JSON"):
        read_prompt_file(str(p))


def test_block_larger_than_the_context_is_refused(tiny, tmp_path, capsys):
    """Refused at load, naming the block and the context limit (the tiny target has 512
    positions), instead of drafting 100k mask tokens per step."""
    p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 4]}])
    argv = [*model_args(tiny, "DFLASH", 100000, tiny.dflash(4)), "--prompts", str(p), *AMPLE]
    rc, err = run_main(argv, capsys)
    assert rc == 2
    assert_one_line_error(err, "--block-size=100000", "context limit of 512 tokens",
                          "max_position_embeddings")
    rc, err = run_main([*argv[:-len(AMPLE)], "--block-size", "65", "--context-length", "64",
                        *AMPLE], capsys)
    assert rc == 2
    assert_one_line_error(err, "--block-size=65", "context limit of 64 tokens (--context-length)")
    # Without --block-size the block is the draft's, or NGRAM's default: named as such
    for algorithm, named in (("DFLASH", "the draft's block size 4"),
                             ("NGRAM", "the default block size")):
        draft = tiny.dflash(4) if algorithm == "DFLASH" else None
        rc, err = run_main([*model_args(tiny, algorithm, None, draft), "--prompts", str(p),
                            "--context-length", "3", *AMPLE], capsys)
        assert rc == 2
        assert_one_line_error(err, named, "context limit of 3 tokens", "--block-size N")


def test_block_larger_than_trained_warns_once_and_runs(tiny, tmp_path, capsys):
    p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 4]}, {"input_ids": [5, 6]}])
    rc, err = run_main([*model_args(tiny, "DFLASH", 8, tiny.dflash(4)), "--prompts", str(p),
                        "--max-new-tokens", "4", *AMPLE], capsys)
    assert rc == 0, err
    warnings = [x for x in err.splitlines() if "trained block size" in x]
    assert warnings == ["WARNING --block-size=8 is larger than the draft's trained block size "
                        "4: slots past 4 were never trained and will rarely be accepted"]


@pytest.mark.parametrize("where", ["flag", "line"])
def test_max_new_tokens_not_positive(tiny, tmp_path, capsys, where):
    p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 4]},
                                             {"input_ids": [5], "max_new_tokens": 0}])
    if where == "flag":
        p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 4]}])
        argv = ["--max-new-tokens", "0"]
    else:
        argv = []
    rc, err = run_main([*model_args(tiny, "NONE"), "--prompts", str(p), *argv, *AMPLE], capsys)
    assert rc == 2
    assert_one_line_error(err, "max_new_tokens" if where == "line" else "--max-new-tokens")
    if where == "line":
        assert "line 2" in err


def test_empty_and_too_long_prompts_refused_per_request(tiny, tmp_path):
    """--context-length 16: a 16-token prompt cannot fit one new token; a 15-token one can."""
    rows = [{"input_ids": [3, 4, 5]}, {"input_ids": []}, {"input_ids": list(range(2, 18))},
            {"input_ids": list(range(2, 17))}, {"input_ids": [9, 8]}, {"prompt": ""}]
    p = write_prompts(tmp_path / "p.jsonl", rows)
    argv = ["--model", str(with_tokenizer(tiny)), "--prompts", str(p), "--max-new-tokens", "4",
            "--context-length", "16", *AMPLE]
    job = run_job(tmp_path, "refuse", argv)
    assert job.rcs == [0]
    recs = job.records
    assert [r["index"] for r in recs] == list(range(6))
    assert [r["finish_reason"] for r in recs] == ["length", "refused", "refused",
                                                  "context_length", "length", "refused"]
    assert "empty" in recs[1]["error"] and "empty" in recs[5]["error"]
    assert "16 tokens" in recs[2]["error"] and "context" in recs[2]["error"]
    assert recs[2]["output_ids"] == [] and recs[2]["completion_tokens"] == 0
    assert len(recs[3]["output_ids"]) == 1  # 15 + 1 == the context limit
    # The requests that ran are exactly what they give when run on their own.
    ok = [rows[i] for i in (0, 3, 4)]
    alone = run_job(tmp_path, "alone", [*model_args(tiny, "NONE"), "--prompts",
                                        str(write_prompts(tmp_path / "ok.jsonl", ok)),
                                        "--max-new-tokens", "4", "--context-length", "16",
                                        *AMPLE])
    assert [recs[i]["output_ids"] for i in (0, 3, 4)] == alone.outputs
    assert job.metrics["refused"] == 3 and job.metrics["requests"] == 6


def test_existing_output_needs_overwrite(tiny, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 4]}])
    rc, err = run_main([*model_args(tiny, "NONE"), "--prompts", str(p), "--output", str(out),
                        *AMPLE], capsys)
    assert rc == 2
    assert_one_line_error(err, str(out), "--overwrite")
    assert out.read_text() == "precious\n"


def test_resume_refuses_a_file_that_is_no_output_of_this_job(tiny, tmp_path, capsys):
    """--resume rewrites its --output. A file holding anything but this job's records was
    rewritten as if its lines were torn (a notes file, the --prompts file: one record left),
    a record without an index broke every later resume, and another job's output (other
    prompts, or other sampling settings) was continued as this one's. Each is now one line,
    exit 2, the file as it was."""
    p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 4]}, {"input_ids": [5, 6]}])
    base = [*model_args(tiny, "NONE"), "--max-new-tokens", "2", *AMPLE]
    out = tmp_path / "out.jsonl"
    assert run_main([*base, "--prompts", str(p), "--output", str(out)], capsys)[0] == 0
    other = write_prompts(tmp_path / "q.jsonl", [{"input_ids": [7, 8]}, {"input_ids": [5, 6]}])
    hot = write_prompts(tmp_path / "hot.jsonl", [{"input_ids": [3, 4], "temperature": 1.0},
                                                 {"input_ids": [5, 6]}])
    stops = write_prompts(tmp_path / "stops.jsonl", [{"input_ids": [3, 4],
                                                      "stop_token_ids": [9]},
                                                     {"input_ids": [5, 6]}])
    notes, noindex = tmp_path / "notes.txt", tmp_path / "noindex.jsonl"
    notes.write_text("my notes\nline two\n")
    noindex.write_text(out.read_text() + '{"note": "hand edit"}\n')
    # Another job's output with more requests: its records past this job's were kept
    three = write_prompts(tmp_path / "three.jsonl", [{"input_ids": [3, 4]},
                                                     {"input_ids": [5, 6]}, {"input_ids": [9]}])
    bigger = tmp_path / "bigger.jsonl"
    assert run_main([*base, "--prompts", str(three), "--output", str(bigger)], capsys)[0] == 0
    for prompts, output, needles in [
            (p, notes, ("line 1 is not JSON", "--overwrite")),
            (p, noindex, ("line 3 is no request record",)),
            (other, out, ("line 1: request 0", "another prompt")),
            (hot, out, ("line 1: request 0", "temperature=0.0 (now 1.0)")),
            (stops, out, ("line 1: request 0", "stop_token_ids=[] (now [9])")),
            (p, p, ("line 1 is no request record",)),  # the --prompts file
            (p, bigger, ("line 3: request 2 there is not one of this job's 2",))]:
        before = output.read_text()
        rc, err = run_main([*base, "--prompts", str(prompts), "--output", str(output),
                            "--resume"], capsys)
        assert rc == 2, err
        assert_one_line_error(err, *needles)
        assert output.read_text() == before
    # The job's own file, its last line torn by a crash, still resumes: that request runs
    # again, the finished one stays.
    # A record of round 40, whose "sampling" lacks the settings kept since, resumes too.
    import json

    lines = out.read_text().splitlines()
    first = json.loads(lines[0])
    for key in ("min_tokens", "stop_token_ids", "ignore_eos"):
        del first["sampling"][key]
    out.write_text(json.dumps(first) + "\n" + lines[1][:10])
    assert run_main([*base, "--prompts", str(p), "--output", str(out), "--resume"],
                    capsys)[0] == 0
    assert [r["index"] for r in read_jsonl(out)] == [0, 1]


@pytest.mark.parametrize("argv,needle", [
    (["--temperature", "nan"], "--temperature=nan must be a finite number"),
    (["--dist-timeout", "inf"], "--dist-timeout=inf must be a finite number"),
    (["--metrics-json", "/no/such/folder/m.json"], "folder /no/such/folder does not exist"),
    (["--output", "{tmp}"], "is a folder"),
    # A folder nobody may write in: a traceback after the weights loaded, and for the
    # metrics after the whole job ran
    (["--output", "/proc/x.jsonl"], "--output=/proc/x.jsonl: cannot write there"),
    (["--metrics-json", "/proc/m.json"], "--metrics-json=/proc/m.json: cannot write there"),
    (["--prompts", "{seed}"], "line 1: seed=1.5: must be an integer or null"),
])
def test_bad_values_that_were_tracebacks(tiny, tmp_path, capsys, argv, needle):
    """Each of these ended in a traceback, exit 1 (the folders after the whole job ran)."""
    seed = write_prompts(tmp_path / "s.jsonl", [{"input_ids": [3, 4], "seed": 1.5}])
    ok = write_prompts(tmp_path / "ok.jsonl", [{"input_ids": [3, 4]}])
    argv = [a.format(tmp=tmp_path, seed=seed) for a in argv]
    prompts = [] if "--prompts" in argv else ["--prompts", str(ok)]
    rc, err = run_main([*model_args(tiny, "NONE"), *prompts, "--max-new-tokens", "2", *AMPLE,
                        *argv], capsys)
    assert rc == 2, err
    assert_one_line_error(err, needle)


@pytest.mark.parametrize("row,needle", [
    ({"stop": ["\n"]}, "line 1: 'stop' works on text"),
    ({"max_tokens": 3, "max_new_tokens": 3}, "line 1: give max_new_tokens or max_tokens"),
    ({"max_tokens": 0}, "line 1: max_tokens=0 must be >= 1"),
    ({"ignore_eos": "yes"}, "line 1: ignore_eos='yes': must be true or false"),
    ({"stop_token_ids": 5}, "line 1: stop_token_ids=5: must be a list"),
    ({"top_p": 0}, "line 1: top_p=0: must be in (0, 1]"),
    ({"top_k": 1.5}, "line 1: top_k=1.5: must be an integer >= 0"),
    ({"min_tokens": 9}, "line 1: min_tokens=9: must be an integer in [0, max_tokens=2]"),
])
def test_bad_per_line_fields(tiny, tmp_path, capsys, row, needle):
    """Each line field is checked as the server checks it; a text-level field is refused by
    name (a job writes tokens, not cut text), not ignored."""
    p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 4], **row}])
    out = tmp_path / "out.jsonl"
    rc, err = run_main([*model_args(tiny, "NONE"), "--prompts", str(p), "--output", str(out),
                        "--max-new-tokens", "2", *AMPLE], capsys)
    assert rc == 2, err
    assert_one_line_error(err, needle)
    assert not out.exists()


def _expect_exit_2(rank, argv):
    from dspark_launch.__main__ import main

    return main(argv)


def test_existing_output_refused_on_every_rank(tiny, tmp_path):
    """Under a world of 2 the refusal must reach every rank (not leave rank 1 in a collective)."""
    from multirank import run_world

    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 4]}, {"input_ids": [5]}])
    argv = [*model_args(tiny, "NONE"), *topology(2, 2), "--prompts", str(p), "--output",
            str(out), "--dist-timeout", "20", *AMPLE, *QUIET]
    import gc

    gc.collect()
    assert run_world(2, _expect_exit_2, argv, timeout=40) == [2, 2]
    assert out.read_text() == "precious\n"


def test_bad_prompts_refused_on_every_rank(tiny, tmp_path):
    from multirank import run_world

    p = tmp_path / "p.jsonl"
    p.write_text('{"input_ids": [3]}\nnot json\n')
    argv = [*model_args(tiny, "NONE"), *topology(2, 1), "--prompts", str(p), *AMPLE, *QUIET]
    import gc

    gc.collect()
    assert run_world(2, _expect_exit_2, argv, timeout=40) == [2, 2]


def test_read_back_refused_line_fields(tiny, tmp_path):
    p = write_prompts(tmp_path / "p.jsonl", [{"input_ids": []}, {"input_ids": [4]}])
    job = run_job(tmp_path, "r", [*model_args(tiny, "NONE"), "--prompts", str(p),
                                  "--max-new-tokens", "2", *AMPLE])
    rec = read_jsonl(tmp_path / "r.jsonl")[0]
    for key in ("id", "input_ids", "output_ids", "finish_reason", "prompt_tokens",
                "completion_tokens", "accept_lens", "ttft_s", "latency_s", "error"):
        assert key in rec
    assert job.records[1]["completion_tokens"] == 2 or job.records[1]["output_ids"][-1] == 1


def test_a_dangling_link_as_output_is_left_as_it_is(tmp_path):
    """The check that --output may be written made its file and removed it; given a link to
    a file not there yet, it created the target and removed the link."""
    from dspark_launch.engine.runner import JobArgs, writable

    link, target = tmp_path / "out.jsonl", tmp_path / "real" / "out.jsonl"
    target.parent.mkdir()
    link.symlink_to(target)
    assert writable(JobArgs(output=str(link))) is None
    assert link.is_symlink() and not target.exists()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if os.geteuid() != 0:  # root writes anywhere
            assert "cannot write there" in str(writable(JobArgs(output=str(ro / "o.jsonl"))))
    finally:
        ro.chmod(0o700)


def test_a_prompt_line_with_a_lone_surrogate_is_named():
    """JSON's "\\ud800" reads as a lone surrogate, which the tokenizer refused with a
    TypeError naming neither the line nor the character (a traceback, exit 1)."""
    from tokenizers import Tokenizer

    from dspark_launch.engine.build import ASSETS
    from dspark_launch.engine.inputs import build_specs
    from dspark_launch.errors import ConfigError

    tok = Tokenizer.from_file(str(ASSETS / "target" / "tokenizer.json"))
    rows = [{"prompt": "ok", "_line": 1}, {"prompt": "a\ud800", "_line": 2}]
    with pytest.raises(ConfigError, match=r"^--prompts line 2: prompt holds '\\ud800' at "
                                          r"character 1, a lone surrogate"):
        build_specs(rows, tok, 4, 0.0, 2048, 2048)
