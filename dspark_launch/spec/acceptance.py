"""Acceptance estimates for the verify-length policy: survival probabilities per draft position.

Survival a_j = P(drafts 1..j all accepted) = prod_{i<=j} p_i, with p_i the conditional
acceptance of draft i given drafts < i accepted (reference/dspark-scheduler.md).

- DSpark: p_i is the confidence head's c_i, calibrated per position with Sequential Temperature
  Scaling (STS: c -> sigmoid(logit(c) / t_i), t fitted by scripts/calibrate_dspark.py on held-out
  rollouts and shipped as `calibration.json` beside the checkpoint; raw c without one), then
  scaled by an online per-position correction measured on this run's own rounds (the head is
  trained on greedy acceptance; sampled acceptance is lower).
- DFlash / NGRAM: p_i measured on this run's own past rounds, per request, shrunk towards the
  global rate (per greedy/sampled class) while a request is young.

Everything here depends on drafts already drawn (c_i reads x_{i-1}) or on past rounds only,
which is what keeps the policy lossless (see spec/policy.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dspark_launch.errors import ConfigError

CALIBRATION_FILE = "calibration.json"
_EPS = 1e-6


# ---------------------------------------------------------------------- STS calibration

def load_calibration(draft_dir: str | Path | None) -> list[float] | None:
    """Per-position STS temperatures from `calibration.json` beside the draft (None: absent)."""
    if draft_dir is None:
        return None
    path = Path(draft_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        temps = json.loads(path.read_text())["temperatures"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"{path}: expected JSON with a 'temperatures' list ({err})") from None
    if not isinstance(temps, list) or not temps or not all(
            isinstance(t, (int, float)) and t > 0 and math.isfinite(t) for t in temps):
        raise ConfigError(f"{path}: 'temperatures' must be a non-empty list of positive "
                          f"numbers, got {temps!r}")
    return [float(t) for t in temps]


def apply_temperatures(
    conf: torch.Tensor,  # [..., K] raw confidences in (0, 1)
    temperatures: list[float] | None,  # per position; the last one repeats past its end
) -> torch.Tensor:  # [..., K] calibrated conditional acceptance
    if not temperatures:
        return conf.float()
    k = conf.shape[-1]
    t = torch.tensor([temperatures[min(i, len(temperatures) - 1)] for i in range(k)],
                     dtype=torch.float32, device=conf.device)
    logit = torch.logit(conf.float().clamp(_EPS, 1 - _EPS))
    return torch.sigmoid(logit / t)


def survival(cond: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., K] prefix products
    return torch.cumprod(cond.float(), dim=-1)


def expected_calibration_error(
    pred: torch.Tensor,  # [N] predicted probabilities
    outcome: torch.Tensor,  # [N] 0/1
    bins: int = 10,
) -> float:
    """Equal-width-bin ECE: sum over bins of |mean pred - mean outcome| weighted by bin mass."""
    pred, outcome = pred.float().flatten(), outcome.float().flatten()
    if pred.numel() == 0:
        return 0.0
    idx = (pred * bins).long().clamp(0, bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += float(sel.sum()) * abs(float(pred[sel].mean()) - float(outcome[sel].mean()))
    return total / pred.numel()


def default_grid() -> list[float]:
    """Temperatures searched by STS: 0.25 .. 8, log-spaced (1.0 included)."""
    return [round(2 ** (e / 8), 4) for e in range(-16, 25)]


def fit_sts(
    conf: torch.Tensor,  # [N, K] raw confidences of N held-out blocks
    accepted: torch.Tensor,  # [N] drafts accepted in each block (0..K)
    grid: list[float] | None = None,
    bins: int = 10,
) -> list[float]:
    """Sequential Temperature Scaling: for k = 1..K in order, the grid temperature t_k whose
    cumulative product a_k = prod_{i<=k} c_i(t_i) has the lowest ECE against "the whole prefix
    1..k was accepted", keeping t_1..t_{k-1} fixed."""
    grid = grid or default_grid()
    n, k = conf.shape
    temps: list[float] = []
    prefix = torch.ones(n)  # a_{k-1} with the temperatures chosen so far
    for j in range(k):
        outcome = (accepted > j).float()  # draft j+1 (and all before it) accepted
        best_t, best_e = 1.0, float("inf")
        for t in grid:
            a = prefix * apply_temperatures(conf[:, j:j + 1], [t])[:, 0]
            e = expected_calibration_error(a, outcome, bins)
            if e < best_e - 1e-12:
                best_t, best_e = t, e
        temps.append(best_t)
        prefix = prefix * apply_temperatures(conf[:, j:j + 1], [best_t])[:, 0]
    return temps


# ---------------------------------------------------------------------- measured acceptance

def shrunk_chain(hits: list[float], trials: list[float], weight: float, first: float
                 ) -> list[float]:
    """Per position, hits over trials shrunk towards the position before it (the first
    towards `first`) with `weight` pseudo-trials: a position rarely reached borrows its
    predecessor's rate."""
    out, prev = [], first
    for h, n in zip(hits, trials):
        prev = (h + weight * prev) / (n + weight)
        out.append(prev)
    return out


class _Counts:
    """Per-position counts of drafts reached (verified with every earlier draft accepted) and
    accepted, aged by decay**steps lazily (only when read or added to)."""

    def __init__(self, positions: int, now: int) -> None:
        self.reached = [0.0] * positions
        self.accepted = [0.0] * positions
        self.rounds = self.tokens = 0.0  # rounds, and the tokens they committed (1 + accepted)
        self.stamp = now

    def at(self, now: int, decay: float) -> _Counts:
        if now != self.stamp:
            f = decay ** (now - self.stamp)
            self.reached = [x * f for x in self.reached]
            self.accepted = [x * f for x in self.accepted]
            self.rounds, self.tokens = f * self.rounds, f * self.tokens
            self.stamp = now
        return self

    def add(self, verified: int, accepted: int, rounds: int = 1) -> None:
        for i in range(min(verified, accepted + 1, len(self.reached))):
            self.reached[i] += rounds
            self.accepted[i] += rounds * float(i < accepted)
        self.rounds += rounds
        self.tokens += rounds * (1 + accepted)


class AcceptanceTracker:
    """Conditional acceptance p_i per draft position from this run's own past rounds.

    Estimate for request r at position i (shrinkage towards the global rate g_i):
        p_{r,i} = (acc_{r,i} + m * g_i) / (reached_{r,i} + m)
    and g_i itself is shrunk towards g_{i-1} (g_0 = prior): positions the policy has not
    verified lately borrow the rate of the position before them instead of staying stuck.
    Global counts are kept per class (greedy / sampled): sampled acceptance is lower. Every
    tick() ages all counts by `decay`; the policy ticks on drafting steps only, so new
    evidence replaces old while a drafter written off (verifying nothing, hence observing
    nothing) keeps its rates, and only the policy's probes try it again. The prior is
    optimistic on purpose: a drafter nobody has tried yet gets tried, and learnt."""

    def __init__(self, positions: int, prior: float = 0.7, prior_weight: float = 8.0,
                 request_weight: float = 4.0, decay: float = 0.99) -> None:
        self.positions = positions
        self.prior, self.prior_weight = prior, prior_weight
        self.request_weight = request_weight
        self.decay = decay
        self._global: dict[str, _Counts] = {}
        self._requests: dict[object, _Counts] = {}
        self.now = 0  # steps so far
        self._rates: dict[str, list[float]] = {}  # global rates this step, per class

    def observe(self, key: object, cls: str, verified: int, accepted: int) -> None:
        """One round of request `key`: `verified` drafts were verified, `accepted` accepted."""
        if verified <= 0:
            return
        self._rates.pop(cls, None)
        for table, k in ((self._global, cls), (self._requests, key)):
            counts = table.get(k)
            if counts is None:
                counts = table[k] = _Counts(self.positions, self.now)
            counts.at(self.now, self.decay).add(verified, accepted)

    def tick(self) -> None:
        """One engine step has passed (counts age lazily)."""
        self.now += 1
        self._rates.clear()

    def global_rates(self, cls: str) -> list[float]:
        cached = self._rates.get(cls)
        if cached is not None:
            return cached
        counts = self._global.get(cls)
        if counts is not None:
            counts.at(self.now, self.decay)
        zeros = [0.0] * self.positions
        rates = shrunk_chain(counts.accepted if counts else zeros,
                             counts.reached if counts else zeros, self.prior_weight, self.prior)
        self._rates[cls] = rates
        return rates

    def conditional(self, key: object, cls: str) -> list[float]:
        """p_{r,1..K} for request `key`."""
        g = self.global_rates(cls)
        mine = self._requests.get(key)
        if mine is None:
            return g
        mine.at(self.now, self.decay)
        m = self.request_weight
        return [(a + m * gi) / (n + m) for a, n, gi in zip(mine.accepted, mine.reached, g)]

    def forget(self, key: object) -> None:
        self._requests.pop(key, None)


class MeasuredRates:
    """Conditional acceptance per draft position exactly as measured (accepted / reached, no
    prior), and the tokens a round committed, per key: the verify ladder's arm and request
    class. Each arm keeps its own: a round of a shorter cap starts after fewer rejections
    and drafts from a shorter block, and its first drafts were accepted more often (batch 1
    greedy, survival of drafts 1-4: DSpark 0.75/0.59/0.52/0.46 at cap 4, 0.73/0.52/0.44/0.37
    at cap 8). A key's counts age by the steps that observed it (tick): an arm the ladder
    tries once in hundreds of steps keeps its last rounds, where aging by every drafting
    step left a neighbour of a drafting arm a round or two to be judged on."""

    def __init__(self, positions: int, decay: float = 0.99) -> None:
        self.positions, self.decay = positions, decay
        self._counts: dict[object, _Counts] = {}
        self._seen: set = set()  # keys observed since the last tick

    def observe(self, key: object, verified: int, accepted: int, rounds: int = 1) -> None:
        """`rounds` request-rounds that each verified `verified` drafts (0: a plain round: a
        request at its last token, or one the cost model kept from drafting) and accepted
        `accepted`."""
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = _Counts(self.positions, 0)
        counts.add(verified, accepted, rounds)
        self._seen.add(key)

    def tick(self) -> None:
        """A step has passed: the counts of the keys it observed age by one."""
        for key in self._seen:
            counts = self._counts[key]
            counts.at(counts.stamp + 1, self.decay)
        self._seen.clear()

    def expectation(self, key: object) -> float | None:
        """The log of the key's committed tokens per round, as all its rounds so far tell
        them (aged counts); None before any round."""
        counts = self._counts.get(key)
        if counts is None or counts.rounds <= 0:
            return None
        return math.log(counts.tokens / counts.rounds)

    def rates(self, key: object, least: float) -> list[float]:
        """The key's rates at the leading positions reached in `least` rounds or more (aged
        counts); [] before any."""
        counts = self._counts.get(key)
        if counts is None:
            return []
        out = []
        for reached, acc in zip(counts.reached, counts.accepted):
            if reached < least:
                break
            out.append(acc / reached)
        return out


class ConfidenceCorrection:
    """Online per-position ratio realised / predicted conditional acceptance of calibrated
    confidences (per class), so DSpark's estimates stay honest at temperatures or on text the
    calibration never saw. Starts at 1 (trust the calibration) and is shrunk towards it."""

    def __init__(self, positions: int, weight: float = 4.0, decay: float = 0.99) -> None:
        self.positions, self.weight, self.decay = positions, weight, decay
        self._pred: dict[str, list[float]] = {}
        self._acc: dict[str, list[float]] = {}

    def observe(self, cls: str, cond: list[float], accepted: int) -> None:
        """cond: the conditional estimates of the drafts that were verified."""
        pred = self._pred.setdefault(cls, [0.0] * self.positions)
        acc = self._acc.setdefault(cls, [0.0] * self.positions)
        for i, c in enumerate(cond[:min(len(cond), accepted + 1, self.positions)]):
            pred[i] += c
            acc[i] += float(i < accepted)

    def tick(self) -> None:
        """One engine step has passed: age the sums."""
        for sums in (*self._pred.values(), *self._acc.values()):
            sums[:] = [x * self.decay for x in sums]

    def ratios(self, cls: str) -> list[float]:
        """Per position, shrunk towards the position before it (the first towards 1): a
        position rarely reached borrows its predecessor's evidence instead of trusting the
        head (an over-confident head fails at every position alike)."""
        pred = self._pred.get(cls, [0.0] * self.positions)
        acc = self._acc.get(cls, [0.0] * self.positions)
        return shrunk_chain(acc, pred, self.weight, 1.0)

    def apply(self, cls: str, cond: list[float]) -> list[float]:
        r = self.ratios(cls)
        return [min(1.0, c * r[min(i, self.positions - 1)]) for i, c in enumerate(cond)]
