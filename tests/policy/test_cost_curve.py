"""Cost curve: profiling runs the given forward at each point, interpolation and extrapolation
are closed-form, online refinement moves towards measurements, the disk cache round-trips."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from dspark_launch.disk_cache import MAX_AGE_S, WRITTEN_AT, cache_key
from dspark_launch.errors import ConfigError
from dspark_launch.spec.cost_curve import (
    OUTLIER_AFTER,
    OUTLIER_RATIO,
    CostCurve,
    load_cached,
    profile,
    profile_points,
    profiled_curve,
)


def test_profile_points_ladder():
    assert profile_points(1) == [1]
    assert profile_points(8) == [1, 2, 4, 8]
    pts = profile_points(300, count=6)
    assert pts[0] == 1 and pts[-1] == 300 and len(pts) == 6 and pts == sorted(set(pts))


def test_interpolation_closed_form():
    c = CostCurve([1, 5, 9], [1.0, 1.0, 3.0])
    assert c.step_seconds(3) == pytest.approx(1.0)
    assert c.step_seconds(7) == pytest.approx(2.0)
    assert c.step_seconds(13) == pytest.approx(5.0)  # last slope extends
    down = CostCurve([1, 2], [2.0, 1.0])
    assert down.step_seconds(10) >= 1.0  # extrapolation never gets faster than the last point


class FakeClock:
    """A clock the fake forward advances by a known cost per token (the thing under test is
    the profiler's bookkeeping, so the forward's cost is the oracle)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.calls: list[int] = []

    def __call__(self) -> float:
        return self.t

    def forward(self, n: int) -> None:
        self.calls.append(n)
        self.t += 0.01 + 0.002 * n


def test_profile_times_every_point_with_warmup():
    clock = FakeClock()
    curve = profile(clock.forward, [1, 4, 16], repeats=3, clock=clock)
    # One warm-up each, then 3 timed rounds over all the points.
    assert clock.calls == [1, 4, 16] * 4
    assert curve.seconds == pytest.approx([0.012, 0.018, 0.042])


@pytest.mark.parametrize("start", range(9))
def test_a_slow_spell_of_consecutive_forwards_leaves_the_curve_as_timed(start):
    """A slow spell (4x every forward's cost) over any 3 consecutive timed forwards, as long
    as one point's 3 timed runs: taking turns, every point keeps a clean run, so the curve is
    the forward's own cost at every point (timed point by point, the spell took all the runs
    of one point wherever it began at that point's first)."""
    clock = FakeClock()
    forward = clock.forward
    calls = 0

    def spell(n: int) -> None:
        nonlocal calls
        calls += 1
        forward(n)
        timed = calls - 3  # the 3 warm-ups come first (timed <= 0)
        if start < timed <= start + 3:
            clock.t += 3 * (0.01 + 0.002 * n)

    curve = profile(spell, [1, 4, 16], repeats=3, clock=clock)
    assert curve.seconds == pytest.approx([0.012, 0.018, 0.042])


def test_a_point_timed_in_a_slow_spell_takes_the_next_points_time():
    """Every timed run of the first point lands in a slow spell (4x its cost): the curve
    lowers it to the next point's time and leaves the others as timed, instead of raising
    every later point to it (a cached curve read one slow time at every point)."""
    clock = FakeClock()
    forward = clock.forward

    def slow_first(n: int) -> None:
        forward(n)
        if n == 1:
            clock.t += 3 * (0.01 + 0.002 * n)

    curve = profile(slow_first, [1, 4, 16], repeats=3, clock=clock)
    assert curve.seconds == pytest.approx([0.018, 0.018, 0.042])


def test_online_refinement_converges():
    c = CostCurve([1, 8, 64], [1.0, 1.0, 1.0], ema=0.2)
    for _ in range(300):
        c.observe(8, 3.0)
    assert c.step_seconds(8) == pytest.approx(3.0, rel=1e-3)
    assert c.seconds[0] == 1.0  # an observation at a point moves only that point's shape
    assert c.step_seconds(1) == pytest.approx(c.overhead + 1.0)  # ... and the overhead
    assert c.overhead > 1.0
    for _ in range(600):
        c.observe(36, 4.0)  # halfway between 8 and 64 moves both
    assert c.step_seconds(36) == pytest.approx(4.0, rel=1e-2)


def test_overhead_is_learned_without_bending_the_shape():
    """Profiled forward 1 + n/8 s; real steps pay 2 s more at every n: after steps at 8 and
    16 tokens only, the prediction at the unvisited 64 includes the overhead too."""
    c = CostCurve([1, 8, 16, 64], [1 + 1 / 8, 2.0, 3.0, 9.0])
    for i in range(400):
        n = 8 if i % 2 else 16
        c.observe(n, 2.0 + 1 + n / 8)
    assert c.step_seconds(64) == pytest.approx(2.0 + 9.0, rel=0.02)
    assert c.step_seconds(8) == pytest.approx(4.0, rel=0.02)


def test_cache_round_trip(tmp_path):
    machine = {"device": "cpu", "world": 2, "threads": 1}
    clock_calls: list[int] = []

    def forward(n: int) -> None:
        clock_calls.append(n)

    curve, src = profiled_curve("auto", machine, forward, [1, 2], directory=tmp_path)
    assert src == "profiled" and clock_calls
    clock_calls.clear()
    again, src = profiled_curve("auto", machine, forward, [1, 2], directory=tmp_path)
    assert src == "cache" and not clock_calls and again.tokens == [1, 2]
    assert again.seconds == pytest.approx(curve.seconds)
    other = profiled_curve("auto", {**machine, "world": 4}, forward, [1, 2],
                           directory=tmp_path)[1]
    assert other == "profiled"  # another topology is another key
    assert load_cached(cache_key({"x": 1}), tmp_path) is None
    off, src = profiled_curve("off", machine, forward, [1, 2], directory=tmp_path)
    assert src == "off" and off.step_seconds(1) == off.step_seconds(2)


def test_a_cached_curve_expires_and_is_profiled_again(tmp_path, monkeypatch):
    """A stored measurement is read for disk_cache.MAX_AGE_S (or DSPARK_CACHE_MAX_AGE_S) after
    it was written, then measured and stored again; one from the clock's future, or with no
    time, is measured again too."""
    machine, calls = {"device": "cpu", "world": 1}, []
    forward = calls.append
    assert profiled_curve("auto", machine, forward, [1, 2], directory=tmp_path)[1] == "profiled"
    path = next(tmp_path.glob("*.json"))
    now = time.time()
    for offset, source in ((-MAX_AGE_S + 60, "cache"), (-MAX_AGE_S - 60, "profiled"),
                           (3600, "profiled")):
        stored = json.loads(path.read_text())
        path.write_text(json.dumps({**stored, WRITTEN_AT: now + offset}))
        assert profiled_curve("auto", machine, forward, [1, 2], directory=tmp_path)[1] == source
    assert profiled_curve("auto", machine, forward, [1, 2], directory=tmp_path)[1] == "cache"
    stored = json.loads(path.read_text())
    del stored[WRITTEN_AT]
    path.write_text(json.dumps(stored))  # a file of an older version: no time
    assert profiled_curve("auto", machine, forward, [1, 2], directory=tmp_path)[1] == "profiled"
    monkeypatch.setenv("DSPARK_CACHE_MAX_AGE_S", "0")
    assert profiled_curve("auto", machine, forward, [1, 2], directory=tmp_path)[1] == "profiled"
    for bad in ("a week", "-1", "nan"):
        monkeypatch.setenv("DSPARK_CACHE_MAX_AGE_S", bad)
        with pytest.raises(ConfigError, match=f"DSPARK_CACHE_MAX_AGE_S='{bad}': expected a "
                                              f"number of seconds, 0 or more"):
            profiled_curve("auto", machine, forward, [1, 2], directory=tmp_path)


def test_one_stall_moves_the_curve_a_bounded_step():
    c = CostCurve([1, 8], [1.0, 2.0])
    for _ in range(20):
        c.observe(8, 2.0)
    before = c.step_seconds(8)
    c.observe(8, 1000.0)  # a stall: counted as at most OUTLIER_RATIO x the prediction
    # overhead moves by ema x the clipped error, the point by shape_rate x what is left
    assert c.step_seconds(8) <= before * (1 + (OUTLIER_RATIO - 1) * (c.ema + c.shape_rate))


@pytest.mark.parametrize("at", [1, 5])  # on a point, and between two (it moves both)
def test_stalls_are_clipped_once_the_curve_observed_outlier_after_steps(at):
    """A stall counts in full before OUTLIER_AFTER steps were observed, clipped from then on,
    wherever the steps fell (an observation between two points was counted at both, so
    clipping began after half the steps there)."""
    for seen in (OUTLIER_AFTER - 1, OUTLIER_AFTER):
        c = CostCurve([1, 9], [1.0, 2.0])
        for _ in range(seen):
            c.observe(at, c.step_seconds(at))  # steady: exactly as predicted
        predicted = c.step_seconds(at)
        c.observe(at, 100.0)
        clipped = c.overhead == pytest.approx(c.ema * (OUTLIER_RATIO - 1) * predicted)
        full = c.overhead == pytest.approx(c.ema * (100.0 - predicted))
        assert (clipped, full) == ((False, True) if seen < OUTLIER_AFTER else (True, False))


@pytest.mark.parametrize("n", [0, 0.5, 1, 1.5, 2, 7, 8, 9, 100, 128, 511.5, 512, 513, 10**4])
def test_scalar_path_equals_the_array_path(n):
    """step_seconds(number) skips numpy (it runs several times a step); it must interpolate
    and extrapolate exactly like the array path, with and without an overhead."""
    for overhead in (0.0, 1e-3):
        c = CostCurve([1, 2, 8, 16, 64, 128, 512], [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 9e-3, 3e-2],
                      overhead=overhead)
        assert c.step_seconds(n) == pytest.approx(float(c.step_seconds(np.array(n))),
                                                  rel=1e-12, abs=1e-15)
    single = CostCurve([5], [2e-3])
    assert single.step_seconds(n) == float(single.step_seconds(np.array(n, dtype=float)))


def test_a_damaged_cached_curve_is_measured_again(tmp_path):
    """A token count of 1e400 (int() of JSON's infinity: an OverflowError, a traceback at
    start-up) or a NaN time (every step priced NaN) in a hand-edited cache file: profiled
    again instead."""
    from dspark_launch.spec.cost_curve import CURVE_VERSION, CostCurve, store_cached

    key = cache_key({"damaged": 1})
    good = CostCurve([1, 2], [0.01, 0.02]).to_dict()
    for damage in ({"tokens": [1, 1e400]}, {"seconds": [0.01, float("nan")]},
                   {"overhead_s": float("inf")}):
        store_cached(key, CostCurve([1, 2], [0.01, 0.02]), {}, tmp_path)
        path = tmp_path / f"{key}.json"
        raw = json.loads(path.read_text())
        path.write_text(json.dumps({**raw, **damage}).replace("Infinity", "1e400"))
        assert load_cached(key, tmp_path) is None, damage
    assert good["version"] == CURVE_VERSION


def _curve_files(rank: int, tiny_args: list, cache: str) -> list[tuple[int, int]]:
    """Engines built one after another over one cache directory: the cost-curve and GEMM
    choice files there after each."""
    import os
    from pathlib import Path

    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.parallel import init_parallel_runtime

    os.environ["DSPARK_CACHE_DIR"] = cache
    init_parallel_runtime(RunConfig(device="cpu"))
    files = []
    for args in tiny_args:
        build_engine(args).shutdown()
        files.append(tuple(len(list((Path(cache) / kind).glob("*.json")))
                           for kind in ("cost_curves", "gemm")))
    return files


def test_the_cost_curve_is_cached_per_page_size(tiny, tmp_path):
    """The kernels walk pages, so a curve profiled at one page size is not another's: each
    page size profiles its own, and the same conditions read it back. (Before, the key left
    the page size out and page size 4 read page size 1's curve.) The GEMM choice stays one
    for both: engines a benchmark compares at two page sizes run the same kernel."""
    from jobs import engine_args
    from multirank import run_world

    def args(page_size: int):
        return engine_args(tiny, "DFLASH", tiny.dflash(4), speculative_policy="adaptive",
                           page_size=page_size, cpu_gemm="auto")

    (files,) = run_world(1, _curve_files, [args(1), args(4), args(1)], str(tmp_path / "c"))
    assert files == [(1, 1), (2, 1), (2, 1)]
