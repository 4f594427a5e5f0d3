"""What verifying drafts adds to a step, over a plain step of the same requests.

The cost model (spec/policy.py) prices a step that verifies drafts as a plain step (what plain
steps measured) plus its verify rows past the base. The profile prices those rows as fresh,
uniform blocks, so what they really cost is learned from the drafting steps the engine runs:

    extra seconds = overhead + factor * (the profile's price of the rows)

Both terms are needed. DFlash at batch 16, greedy (AMD EPYC, one thread, a pinned arm,
scratch): a plain step took 8.60 ms, one verifying 2 rows 10.29 ms, 16 rows 11.44 ms, 30 rows
14.26 ms, 48 rows 15.25 ms: ~1.5 ms for verifying at all (the verify path's own work), then
~0.11 ms a row, about the profile's price. Before round 45 one factor scaled the rows alone:
it read 3 from a one-request probe's 2 rows and 1.1 from full blocks, so the fewer drafts the
model admitted, the dearer each looked, and it admitted fewer still. The model's arm, pinned
at 2 drafts, drafted in 2-69% of its decode time (it stopped, then ran on probes whose rows
priced drafting ever dearer) where every request verifying 2 ran 1.03-1.07x plain decoding;
in the ladder it scored above its neighbours in tries (from their state) and below them in
steady play (round 44's move logs).

The fit: the slope is a least-squares line through recent drafting steps (exponentially
weighted: the machine drifts), moved only where those steps fix it (their prices spread, and
the slope's standard error is small): one width's steps tell the level, not the slope, so once
the policy settles on one length the slope stays the last one the data could tell. The level
(the recent steps' mean price and measured extra) starts at the prior (the profile's price, no
overhead) and moves at RATE, so one slow first step moves it by RATE; once OUTLIER_AFTER steps
are fitted, a step counts as at most OUTLIER off the line (a stall of the shared machine). The
overhead is the level's intercept at the slope (a line through the origin where that would be
negative)."""

from __future__ import annotations

from dataclasses import dataclass

RATE = 0.05  # weight of one drafting step in the fit (a memory of ~40 drafting steps)
FACTOR_RANGE = (0.5, 3.0)  # the slope is kept within this
SPREAD = 0.05  # the prices must spread by this share of their mean to move the slope ...
SLOPE_ERROR = 0.2  # ... and fix it to within this share (one standard error)
OUTLIER = 2.0  # a step counts as at most this far off the line (a stall) ...
OUTLIER_AFTER = 8  # ... once this many steps are fitted (and the slope moves from then on)


@dataclass
class DraftingCost:
    slope: float = 1.0  # seconds a verify row costs per second the profile prices it
    observed: int = 0  # drafting steps fitted
    # The level: exponentially weighted means of the profile's price x and the measured
    # extra y, from the prior (x of the first step, slope * x)
    _x: float = 0.0
    _y: float = 0.0
    # The slope's: the steps' own weighted means, variances and covariance (a plain mean at
    # first, then at RATE; centred updates: no cancellation), and the sum of the squared
    # weights (the effective number of steps is its inverse)
    _mx: float = 0.0
    _my: float = 0.0
    _xx: float = 0.0
    _yy: float = 0.0
    _xy: float = 0.0
    _w2: float = 0.0

    @property
    def factor(self) -> float:
        """The rows' price over the profile's: the slope, or, where the line through the
        level at that slope would give verifying a negative overhead, the line through the
        origin (rows cheaper than the slope says at that level)."""
        if self._y - self.slope * self._x >= 0 or not self._x > 0:
            return self.slope
        return self._clip(self._y / self._x)

    @property
    def overhead(self) -> float:
        """Seconds a step adds for verifying any draft at all."""
        return max(0.0, self._y - self.factor * self._x)

    def seconds(self, priced):
        """Extra seconds of verifying rows the profile prices at `priced` seconds (a number or
        an array)."""
        return self.overhead + self.factor * priced

    def observe(self, priced: float, measured: float) -> None:
        """One drafting step: its verify rows priced at `priced` seconds by the profile, and
        `measured` seconds over a plain step of its base."""
        if not priced > 0:
            return
        if self.observed >= OUTLIER_AFTER:
            expected = self.seconds(priced)
            measured = min(max(measured, expected / OUTLIER), expected * OUTLIER)
        if not self.observed:
            self._x, self._y = priced, self.slope * priced
        self.observed += 1
        self._x += RATE * (priced - self._x)
        self._y += RATE * (measured - self._y)
        rate = max(RATE, 1.0 / self.observed)
        dx, dy = priced - self._mx, measured - self._my
        self._mx += rate * dx
        self._my += rate * dy
        self._xx = (1 - rate) * (self._xx + rate * dx * dx)
        self._yy = (1 - rate) * (self._yy + rate * dy * dy)
        self._xy = (1 - rate) * (self._xy + rate * dx * dy)
        self._w2 = (1 - rate) ** 2 * self._w2 + rate * rate
        steps = 1.0 / self._w2  # the effective number of steps behind the moments
        if self.observed < OUTLIER_AFTER or steps <= 2 or not self._xx > (SPREAD * self._mx) ** 2:
            return
        # The slope moves only where the steps fix it: a level that moved while the
        # widths' old spread lingers in the moments would tilt it.
        slope = self._xy / self._xx
        residual = max(0.0, self._yy - slope * self._xy) * steps / (steps - 2)  # per step
        if residual / (self._xx * steps) <= (SLOPE_ERROR * max(slope, FACTOR_RANGE[0])) ** 2:
            self.slope = self._clip(slope)

    @staticmethod
    def _clip(factor: float) -> float:
        return min(max(factor, FACTOR_RANGE[0]), FACTOR_RANGE[1])

    def to_dict(self) -> dict:
        return {"factor": round(self.factor, 4), "slope": round(self.slope, 4),
                "overhead_s": round(self.overhead, 9), "steps": self.observed}
