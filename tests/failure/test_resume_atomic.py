"""--resume never loses a finished line: the output file is only ever replaced by a rename, so a
process killed (SIGKILL, nothing runs after it) at any point of a rewrite leaves the old file or
the new one, whole. A second signal never tears a line."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest

from dspark_launch.engine.output import OutputWriter
from dspark_launch.failure import FAULT_ENV, install_signal_handlers, progress

POINTS = ["rewrite-partial", "rewrite-written", "rewrite-replaced"]


def _record(index: int) -> dict:
    return {"index": index, "id": str(index), "output_ids": [index, index + 1],
            "finish_reason": "length"}


def _old_file(path: Path, n: int) -> list[str]:
    """n finished lines, out of order as a run appends them, then a line torn by a crash."""
    lines = [json.dumps(_record(i)) for i in reversed(range(n))]
    path.write_text("\n".join(lines) + "\n" + '{"index": 99, "id": "9')
    return lines


def _in_child(fn, *args) -> int:
    """Run fn in a forked process; its exit code (-9: it was SIGKILLed)."""
    proc = mp.get_context("fork").Process(target=fn, args=args)
    proc.start()
    proc.join(30)
    assert proc.exitcode is not None, "the child hung"
    return proc.exitcode


def _resume(path: str, point: str) -> None:
    os.environ[FAULT_ENV] = f"0:{point}:kill"
    OutputWriter(path, overwrite=False, resume=True)


def _resume_add_close(path: str, point: str) -> None:
    writer = OutputWriter(path, overwrite=False, resume=True)
    for i in (7, 5, 6):
        writer.add(_record(i))
    os.environ[FAULT_ENV] = f"0:{point}:kill"
    writer.close()


def _indices(path: Path) -> list[int]:
    """Indices of the file's lines; every line must be whole except possibly a torn last one."""
    out = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines):
        try:
            out.append(json.loads(line)["index"])
        except ValueError:
            assert n == len(lines) - 1, f"line {n + 1} of {len(lines)} is torn"
    return out


@pytest.mark.parametrize("point", POINTS)
def test_kill_during_the_resume_rewrite_keeps_every_finished_line(tmp_path, point) -> None:
    out = tmp_path / "out.jsonl"
    old = _old_file(out, 5)
    before = out.read_text()
    assert _in_child(_resume, str(out), point) == -signal.SIGKILL
    after = out.read_text()
    if point == "rewrite-replaced":  # the new file: the finished lines, the torn one dropped
        assert after == "\n".join(old) + "\n"
    else:  # the old file, untouched
        assert after == before
    # The next resume carries every finished line over and appends after them.
    writer = OutputWriter(str(out), overwrite=False, resume=True)
    assert writer.resumed == 5
    writer.add(_record(5))
    writer.close()
    assert _indices(out) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("point", POINTS)
def test_kill_during_the_final_rewrite_keeps_every_finished_line(tmp_path, point) -> None:
    out = tmp_path / "out.jsonl"
    _old_file(out, 5)
    assert _in_child(_resume_add_close, str(out), point) == -signal.SIGKILL
    kept = _indices(out)
    assert sorted(kept) == list(range(8))  # the 5 carried over and the 3 this run finished
    if point == "rewrite-replaced":
        assert kept == list(range(8))  # the rewrite in input order is in place
    assert not (tmp_path / "out.jsonl.tmp").exists() or point != "rewrite-replaced"


class _SignalMidWrite:
    """A file whose write() is hit by a signal halfway through the line (the second one)."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, text: str) -> None:
        self.f.write(text[: len(text) // 2])
        os.kill(os.getpid(), signal.SIGINT)
        self.f.write(text[len(text) // 2:])

    def __getattr__(self, name: str):
        return getattr(self.f, name)


def test_second_signal_waits_for_the_line_to_be_whole(tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    writer = OutputWriter(str(out), overwrite=False, resume=False)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    before = vars(progress).copy()
    try:
        install_signal_handlers()
        progress.begin(0)  # a step under way (its stop grace is seconds away)
        os.kill(os.getpid(), signal.SIGTERM)  # the first signal: a flag, the run goes on
        writer.add(_record(0))
        writer._file = _SignalMidWrite(writer._file)
        with pytest.raises(KeyboardInterrupt):  # the second: raised once the line is whole
            writer.add(_record(1))
    finally:
        vars(progress).update(before)
        for s, handler in previous.items():
            signal.signal(s, handler)
    writer._file = writer._file.f
    writer._file.close()
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]
