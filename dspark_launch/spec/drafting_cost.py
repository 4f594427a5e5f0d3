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

The fit is a least-squares line through recent drafting steps (exponentially weighted: the
machine drifts). Its slope is kept where those steps' prices barely spread (the policy settled
on one length): one point fixes the level, not the slope, so the overhead follows the level and
the slope stays the last one the data could tell."""

from __future__ import annotations

from dataclasses import dataclass

RATE = 0.05  # weight of one drafting step in the fit (a window of ~20 drafting steps)
FACTOR_RANGE = (0.5, 3.0)  # the slope is kept within this
SPREAD = 0.05  # the prices must spread by this share of their mean to move the slope


@dataclass
class DraftingCost:
    factor: float = 1.0  # seconds a verify row costs per second the profile prices it
    overhead: float = 0.0  # seconds a step adds for verifying any draft at all
    observed: int = 0  # drafting steps fitted
    # Exponentially weighted means of the profile's price x and the measured extra y, the
    # variance of x and the covariance (centred updates: no cancellation)
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def seconds(self, priced):
        """Extra seconds of verifying rows the profile prices at `priced` seconds (a number or
        an array)."""
        return self.overhead + self.factor * priced

    def observe(self, priced: float, measured: float) -> None:
        """One drafting step: its verify rows priced at `priced` seconds by the profile, and
        `measured` seconds over a plain step of its base."""
        if not priced > 0:
            return
        rate = max(RATE, 1.0 / (self.observed + 1))  # a plain mean at first
        self.observed += 1
        dx, dy = priced - self._x, measured - self._y
        self._x += rate * dx
        self._y += rate * dy
        self._xx = (1 - rate) * (self._xx + rate * dx * dx)
        self._xy = (1 - rate) * (self._xy + rate * dx * dy)
        if self._xx > (SPREAD * self._x) ** 2:
            self.factor = self._clip(self._xy / self._xx)
        self.overhead = self._y - self.factor * self._x
        if self.overhead < 0:  # rows cheaper than the line says: a line through the origin
            self.factor, self.overhead = self._clip(self._y / self._x), 0.0

    @staticmethod
    def _clip(factor: float) -> float:
        return min(max(factor, FACTOR_RANGE[0]), FACTOR_RANGE[1])

    def to_dict(self) -> dict:
        return {"factor": round(self.factor, 4), "overhead_s": round(self.overhead, 9),
                "steps": self.observed}
