"""How fast the target forward runs at n tokens: profiled at start-up, refined online.

The verify-length policy trades expected committed tokens against the price of every verify
row, so it needs SPS(n) = target-forward steps per second with n tokens in the forward
(reference/dspark-scheduler.md). The curve is a small table of (tokens, seconds per forward),
measured at start-up over a handful of token counts by running the REAL forward (under DP
attention every rank joins, idle groups with zero tokens, so the collectives are timed too),
interpolated linearly between points, cached on disk per machine and topology, and refined
online from the step times the engine measures anyway (observe(): an overhead every point
shares, and the neighbouring points, by what is left of the error).

Every rank of an attention-TP group must choose the same verify lengths, so the engine feeds
this object only values every rank agrees on (rank 0's profile, gathered step times); given
the same inputs the curve is deterministic.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_launch import disk_cache

CURVE_VERSION = 3  # 2: a slow point is lowered to the next one's time (profile()); curves
# cached before, which raised later points to a slow one, are profiled again. 3: the points
# are timed in turns (profile()); curves timed point by point are profiled again
MIN_SECONDS = 1e-6  # a forward never takes less; keeps 1/seconds finite
OUTLIER_RATIO = 2.0  # an observation counts as at most this factor off the prediction ...
OUTLIER_AFTER = 8  # ... once the curve has observed this many steps


def profile_points(max_tokens: int, count: int = 6) -> list[int]:
    """Token counts to profile: 1 plus a geometric ladder up to max_tokens (at most `count`)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    points = {1, max_tokens}
    n = 2
    while n < max_tokens:
        points.add(n)
        n *= 2
    ladder = sorted(points)
    if len(ladder) <= count:
        return ladder
    # Keep both ends and spread the rest evenly over the ladder (geometric spacing).
    step = (len(ladder) - 1) / (count - 1)
    return sorted({ladder[round(i * step)] for i in range(count)})


@dataclass
class CostCurve:
    """Seconds of a step at n tokens = overhead + forward(n), where forward(n) is the table
    (piecewise-linear in between, linear beyond the ends with the last segment's slope, never
    decreasing) and `overhead` is what a real step costs besides the profiled forward
    (scheduling, sampling, bookkeeping), learned online like the table's shape."""

    tokens: list[int]  # strictly increasing
    seconds: list[float]  # same length, > 0: the forward alone
    overhead: float = 0.0  # seconds a step adds to the forward, at any n
    ema: float = 0.1  # weight of one online observation in the overhead
    shape_rate: float = 0.01  # ... and in the neighbouring points' residual
    outlier_ratio: float = OUTLIER_RATIO  # an observation is clipped to this factor off
    observations: list[int] = field(default_factory=list)  # per point, for reports
    observed: int = 0  # steps observe() took (one may count at two points: OUTLIER_AFTER)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("a cost curve needs one time per token count")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"token counts must increase: {self.tokens}")
        self.seconds = [max(MIN_SECONDS, float(s)) for s in self.seconds]
        if not self.observations:
            self.observations = [0] * len(self.tokens)
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # cached for step_seconds

    # ------------------------------------------------------------------ reading

    def _segment(self, n: float) -> tuple[int, float]:
        """(left point index i, weight w of point i+1) for n; a single point has i=0, w=0."""
        t = self.tokens
        if len(t) == 1 or n <= t[0]:
            return 0, 0.0 if len(t) == 1 else (n - t[0]) / (t[1] - t[0])
        lo = 0
        while lo + 2 < len(t) and n > t[lo + 1]:
            lo += 1
        return lo, (n - t[lo]) / (t[lo + 1] - t[lo])

    def step_seconds(self, n):
        """Predicted seconds of a step with n tokens (a number, or an array of them)."""
        if isinstance(n, (int, float)):  # the per-step scalar path, without numpy
            return max(self.overhead + self._forward_scalar(n), MIN_SECONDS)
        out = np.maximum(self.overhead + self.forward_seconds(n), MIN_SECONDS)
        return float(out) if out.ndim == 0 else out

    def _forward_scalar(self, n: float) -> float:
        """forward_seconds for one number (same interpolation and extrapolation)."""
        t, s = self.tokens, self.seconds
        if len(t) == 1:
            return s[0]
        if n < t[0]:
            return s[0] + (n - t[0]) * (s[1] - s[0]) / (t[1] - t[0])
        if n > t[-1]:
            return s[-1] + (n - t[-1]) * max(0.0, (s[-1] - s[-2]) / (t[-1] - t[-2]))
        i = min(bisect.bisect_right(t, n), len(t) - 1)  # t[i-1] <= n <= t[i]
        w = (n - t[i - 1]) / (t[i] - t[i - 1])
        return s[i - 1] + w * (s[i] - s[i - 1])

    def forward_seconds(self, n) -> np.ndarray:
        """The table alone at n (interpolated / extrapolated), as an array."""
        if self._arrays is None:
            self._arrays = (np.asarray(self.tokens, dtype=np.float64),
                            np.asarray(self.seconds, dtype=np.float64))
        t, s = self._arrays
        x = np.asarray(n, dtype=np.float64)
        if len(t) == 1:
            out = np.full_like(x, s[0])
        else:
            out = np.interp(x, t, s)
            low = (s[1] - s[0]) / (t[1] - t[0])
            high = max(0.0, (s[-1] - s[-2]) / (t[-1] - t[-2]))  # never faster beyond the end
            out = np.where(x < t[0], s[0] + (x - t[0]) * low, out)
            out = np.where(x > t[-1], s[-1] + (x - t[-1]) * high, out)
        return out

    # ------------------------------------------------------------------ refining

    def clipped(self, n: int, seconds: float) -> float:
        """A measured step of n tokens as the curve counts it: once it has observed
        OUTLIER_AFTER steps, at most outlier_ratio off its price. A shared machine stalls now
        and then, and one stall must not move what learns from it by more than a bounded step
        (a policy that stops drafting stops measuring the draft)."""
        if self.observed < OUTLIER_AFTER:
            return seconds
        predicted = self.step_seconds(n)
        return min(max(seconds, predicted / self.outlier_ratio), predicted * self.outlier_ratio)

    def observe(self, n: int, seconds: float) -> None:
        """One measured step of n tokens.

        The overhead moves towards (measured - table) at the EMA rate: a real step also pays
        for what the profile does not run, at every n alike. What is left of the error moves
        the two neighbouring points (by interpolation weight, at the slower shape rate), so
        the table's shape follows the machine too (an observation exactly at a point moves
        only that point)."""
        if n < 1 or seconds <= 0:
            return
        forward = self._forward_scalar(n)
        seconds = self.clipped(n, seconds)
        self.overhead += self.ema * ((seconds - forward) - self.overhead)
        err = seconds - (self.overhead + forward)
        i, w = self._segment(n)
        w = min(max(w, 0.0), 1.0)
        for j, weight in ((i, 1.0 - w), (i + 1, w)):
            if j < len(self.seconds) and weight > 0:
                self.seconds[j] = max(MIN_SECONDS,
                                      self.seconds[j] + self.shape_rate * weight * err)
                self.observations[j] += 1
        self.observed += 1
        self._arrays = None

    # ------------------------------------------------------------------ (de)serialising

    def to_dict(self) -> dict:
        return {"version": CURVE_VERSION, "tokens": list(self.tokens),
                "seconds": [round(s, 9) for s in self.seconds],
                "overhead_s": round(self.overhead, 9),
                "steps_per_second": [round(1.0 / max(MIN_SECONDS, self.overhead + s), 3)
                                     for s in self.seconds],
                "observations": list(self.observations)}

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        if data.get("version") != CURVE_VERSION:
            raise ValueError(f"cost curve version {data.get('version')} != {CURVE_VERSION}")
        seconds = [float(s) for s in data["seconds"]] + [float(data.get("overhead_s", 0.0))]
        if not all(math.isfinite(s) and s >= 0 for s in seconds):  # NaN priced every step NaN
            raise ValueError(f"cost curve seconds {seconds} are not all finite and >= 0")
        return cls([int(n) for n in data["tokens"]], seconds[:-1], seconds[-1])

    @classmethod
    def flat(cls, points: Sequence[int] = (1,)) -> CostCurve:
        """No profile (--profile-cost-curve off): every width costs the same until the online
        refinement has measured the steps the engine really runs."""
        return cls(list(points), [MIN_SECONDS] * len(points))


def profile(
    run_forward: Callable[[int], None],  # runs ONE real target forward of n tokens
    points: Sequence[int],
    repeats: int = 4,
    clock: Callable[[], float] = time.perf_counter,
) -> CostCurve:
    """Time the forward at each token count: one warm-up each, then `repeats` rounds over
    all the points, the fastest of each point's runs (on a shared machine the noise only ever
    adds time).

    In rounds, not point by point: a slow spell of a shared machine then lands on every
    point alike, scaling the curve (which the online refinement corrects), where timed point
    by point it took all the runs of one point and bent the curve's shape, which nothing
    corrects for a width the policy then never runs (a cached batch-1 profile read 5.40 ms
    from 1 to 8 tokens and 8.14 ms at 9, where 9 tokens ran 4.3 ms: DSpark's cost model never
    verified 8 drafts, and the curve's point at 9 was never observed).

    The number of forwards is fixed (no time budget), so every rank of a world runs the same
    sequence of collectives; a handful of points x 5 forwards stays within a few seconds.
    Under DP attention `run_forward` must make every rank join, exactly like a real step."""
    if not points:
        raise ValueError("profile needs at least one token count")
    for n in points:
        run_forward(n)  # warm-up: first-touch allocations, lazy kernels
    times = [float("inf")] * len(points)
    for _ in range(repeats):
        for i, n in enumerate(points):
            t0 = clock()
            run_forward(n)
            times[i] = min(times[i], clock() - t0)
    # A larger forward is never cheaper in expectation, and a shared machine's noise only
    # ever adds time: a point slower than a larger forward was timed in a slow spell and takes
    # that forward's time. (Raising each point to the one before it instead spread one slow
    # first point over the curve: a cached profile read 13.16 ms from 1 to 32 tokens, and the
    # ladder's top cap and yardstick come from it.)
    for i in range(len(times) - 2, -1, -1):
        times[i] = min(times[i], times[i + 1])
    return CostCurve(list(points), times)


# ---------------------------------------------------------------------- the on-disk cache

def cache_dir() -> Path:
    return disk_cache.cache_dir("cost_curves")


def load_cached(key: str, directory: Path | None = None) -> CostCurve | None:
    data = disk_cache.read_json(directory or cache_dir(), key)
    try:
        return None if data is None else CostCurve.from_dict(data)
    except (ValueError, KeyError, TypeError, OverflowError):  # (int(1e400): a hand-edited file)
        return None  # stale or damaged: profile again


def store_cached(key: str, curve: CostCurve, machine: dict,
                 directory: Path | None = None) -> Path | None:
    return disk_cache.write_json(directory or cache_dir(), key,
                                 {**curve.to_dict(), "machine": machine})


def profiled_curve(
    mode: str,
    machine: dict,
    run_forward: Callable[[int], None],
    points: Sequence[int],
    agree: Callable[[object], object] = lambda x: x,
    writer: bool = True,
    directory: Path | None = None,
) -> tuple[CostCurve, str]:
    """The curve for --profile-cost-curve: (curve, source), source 'off', 'cache' or 'profiled'.

    `agree` makes every rank take one rank's value (the engine passes a broadcast from rank 0):
    first whether the cache holds a curve (then nobody profiles), else the profile itself, which
    every rank runs so that the forward's collectives match. Only the `writer` stores it."""
    if mode == "off":
        return CostCurve.flat(points), "off"
    if mode != "auto":
        raise ValueError(f"--profile-cost-curve={mode}: expected 'off' or 'auto'")
    key = disk_cache.cache_key({**machine, "points": list(points)})
    cached = agree(load_cached(key, directory))
    if cached is not None:
        return cached, "cache"
    curve = agree(profile(run_forward, points))
    if writer:
        store_cached(key, curve, machine, directory)
    return curve, "profiled"
