"""Verify-length policy: how many drafts each request of a group verifies this step.

Algorithm 1 of the DSpark paper (reference/dspark-scheduler.md): every request verifies at
least its anchor; candidates (r, j) = "request r also verifies its draft j" are walked in order
of falling survival a_{r,j}; each is admitted while it raises the expected throughput

    theta(B) = (expected committed tokens) / (seconds of a step with B tokens in the forward)

and the walk stops at the FIRST candidate that does not raise it (early stopping). A request
may end with l_r = 0: plain decoding for it this step.

That is the "model" policy. The default, "adaptive", runs it inside the verify ladder
(spec/ladder.py): each step a cap on the drafts verified per request, and whether the model
decides within it or every request verifies the cap, chosen by the speed each choice measured
(the model's prices, a profile refined online, were off by enough on a shared CPU to lose to
plain decoding where a short fixed verify won).

Why this is lossless (the output distribution is exactly the target's)
--------------------------------------------------------------------
Fix a request r and condition on everything that does not depend on r's drafts this step:
the past, and the other requests' drafts (drawn from their own generators, so independent of
r's draws given the past). Write x_1, x_2, ... for r's drafts and F_{j-1} = sigma(x_1..x_{j-1}).

Claim: the event {l_r >= j} is F_{j-1}-measurable, i.e. whether draft j is verified is
decided before draft j is looked at.
- a_{r,i} = prod_{i' <= i} p_{r,i'} and p_{r,i} is computed before x_i is drawn: DSpark's
  c_i reads the hidden state of the block (context only) and x_{i-1} (the Markov feature);
  DFlash/NGRAM estimates read only past rounds. So a_{r,1..j} is F_{j-1}-measurable.
- The candidates walked before (r, j) are those with a larger key (-a, r, j) (ties broken by
  request, then position). r's own candidates among them are (r, i < j) only: a_{r,i} is
  non-increasing in i (enforced by a running minimum, itself F_{j-1}-measurable), so every
  (r, i > j) sorts after (r, j). Which other requests' candidates come before (r, j) depends
  on a_{r,j} and their own values, all known given F_{j-1} and the conditioning.
- The walk reaches (r, j) and admits it iff every candidate before it improved theta and
  (r, j) improves it too: a function of the candidates up to and including (r, j) only —
  early stopping means nothing after (r, j) is ever consulted for it.
Hence l_r is a stopping time of r's draft sequence. Speculative sampling with a stopping-time
block length is exact: at position j, given drafts < j were accepted (so they equal the
committed tokens), either l_r >= j and the min(1, p/q) test with the residual resample yields
a token distributed as p, or l_r < j and the bonus token is drawn from p directly; in both
cases draft j's value never influenced whether it was tested. Greedy decoding is exact for
any length (accepted drafts equal the target's argmax). A search that looked at later
candidates and came back (a global argmax over all length vectors) would make {l_r >= j}
depend on x_j, x_{j+1}, ... — the paper's Appendix A counterexample — hence the early stop.

Dormancy (VerifyPolicy.dormant) leaves some committed rows out of the draft's context (the
draft block skips them: Request.draft_gaps): it changes the drafts' distribution q, never which
drafts are verified nor how, and speculative sampling is exact for any q (greedy, for any
drafts).

The same argument covers any length computed from past rounds only (the "fixed" policy, the
ladder's cap and mode, a probe, a plain step kept to time plain decoding, or the DFlash/NGRAM
decision to skip drafting a request this step), and the draft block's length, which the plan
fixes before any draft exists: a shorter block changes the draft distribution q, and
speculative sampling is exact for any q.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark_launch.spec.acceptance import (
    AcceptanceTracker,
    ConfidenceCorrection,
    MeasuredRates,
    apply_temperatures,
)
from dspark_launch.spec.cost_curve import CostCurve, profile_points
from dspark_launch.spec.drafting_cost import DraftingCost
from dspark_launch.spec.ladder import PLAIN, TRY_STEPS, Allowance, Arm, Ladder

# adaptive: the verify ladder (spec/ladder.py) over caps, the cost model one of its modes;
# model: the cost model alone at the full cap; fixed: every draft is verified.
POLICIES = ("adaptive", "model", "fixed")
PROBE_EVERY = 32  # steps without drafting before one probe step (see VerifyPolicy.plan) ...
PROBE_EVERY_MAX = 512  # ... doubling, up to this, after each probe that did not pay
TOP_COST = 2.0  # a verify step this many plain steps dear at most: the ladder's top cap
# Drafting steps between plain ones while a model arm is the ladder's current arm: a plain
# step now and then (and the first) measures what the model prices drafting against; without
# it, a drafter that looks good would be priced against a plain step nobody timed (the
# ladder's own arms need none). Never in a try of a model arm: the drafting steps of a fixed
# arm count towards PLAIN_EVERY too, so from a fixed arm that had drafted 32 steps every try
# of a model neighbour was played plain and measured nothing.
PLAIN_EVERY = 32
# The plain curve learns from few steps (one in PLAIN_EVERY where drafting pays): each moves
# it more, and a stall of the machine less.
PLAIN_EMA, PLAIN_OUTLIER = 0.3, 1.3
# Dormant (plain decoding settled, no try due within this many steps; for the "model"
# policy: no probe): the engine stops writing the draft's context for committed rows, and
# resumes this far ahead of the next try so that the try drafts from recent context. A
# drafter that never pays then costs what its context costs for a few steps in every
# EXPLORE_MAX (the draft's context projection of every token was 3-5% of the tiny target's
# forward at batch 16 and 64).
WAKE_AHEAD = 32
# A draft position's measured rate scores the ladder's rounds (round_score) once this many
# rounds (aged) reached it; the positions past it are scored by what the round accepted there.
MEASURED_AFTER = 8
CALIBRATION_EVERY = 4  # fixed-cap steps whose estimates are kept for the report: one in 4
IDLE_RECHECK = 8  # while nobody drafts, the same requests are re-planned every 8th step
DRAFT_SHAPE_RATE = 0.2  # how fast the draft curve's points follow measured draft times


@dataclass(frozen=True)
class Choice:
    lengths: list[int]  # drafts verified per request (0 = plain decoding this step)
    expected_tokens: float  # predicted committed tokens: one per request + admitted survival
    tokens: int  # tokens in the forward (base + admitted drafts)


def monotone(survival: Sequence[float]) -> list[float]:
    """Running minimum clipped to [0, 1]: survival of a longer prefix is never higher."""
    out, low = [], 1.0
    for a in survival:
        low = min(low, max(0.0, float(a)))
        out.append(low)
    return out


def _candidates(survival: Sequence[Sequence[float]]) -> tuple[np.ndarray, ...]:
    """Every (r, j) with its a_{r,j}, sorted by the key (-a, r, j): falling survival, ties by
    request then position, so each request's drafts come in prefix order."""
    rows = [monotone(row) for row in survival]
    a = np.array([x for row in rows for x in row], dtype=np.float64)
    r = np.array([i for i, row in enumerate(rows) for _ in row], dtype=np.int64)
    j = np.array([k for row in rows for k in range(len(row))], dtype=np.int64)
    order = np.lexsort((j, r, -a))
    return a[order], r[order], j[order]


def _lengths(reqs: int, r: np.ndarray, j: np.ndarray, admitted: int) -> list[int]:
    lengths = [0] * reqs
    for ri, ji in zip(r[:admitted].tolist(), j[:admitted].tolist()):
        assert lengths[ri] == ji, "survival order must respect each request's prefix order"
        lengths[ri] = ji + 1
    return lengths


def choose_lengths(
    survival: Sequence[Sequence[float]],  # per request a_{r,1..L_r}; L_r = drafts available
    base_tokens: int,  # tokens in the forward before any draft (prefill chunks + anchors)
    step_seconds: Callable,  # predicted seconds of a step with n tokens (n: array or number)
) -> Choice:
    """Algorithm 1: greedy admission by falling survival, stopping at the first candidate that
    does not raise expected committed tokens per second.

    theta_d (the objective with the first d candidates admitted) is evaluated for every d at
    once, but the decision is the sequential walk's: admit d while theta_d > theta_{d-1}, stop
    at the first d where it is not (nothing after that candidate is consulted)."""
    reqs = len(survival)
    a, r, j = _candidates(survival)
    tau = reqs + np.concatenate([[0.0], np.cumsum(a)])  # [N+1] tau_d
    theta = tau / step_seconds(base_tokens + np.arange(len(a) + 1))
    worse = np.nonzero(theta[1:] <= theta[:-1])[0]
    admitted = int(worse[0]) if worse.size else len(a)  # early stop at the first non-improver
    return Choice(_lengths(reqs, r, j, admitted), float(tau[admitted]), base_tokens + admitted)


def round_score(rates: Sequence[float], verified: int, accepted: int) -> float:
    """What the ladder counts for one request-round that verified `verified` drafts and
    accepted `accepted`: the tokens it commits on average at the measured conditional rates
    (`rates`, measured by the same arm in earlier steps: spec/acceptance.py MeasuredRates)
    over the positions they cover, plus the drafts it accepted past them.

    Its mean is the mean of the tokens committed, 1 + E[min(A, verified)] for a round whose
    first rejected draft is A + 1: the first part is E[min(A, k)] with k = min(verified,
    len(rates)), the second E[min(A, verified)] - E[min(A, k)]. But it scatters only where no
    rate is measured yet. Why that matters: the ladder averages the log of a step's speed,
    and at batch 1 a step is one round, whose 1 to 9 tokens scatter so widely that the mean
    of their logs sits below the log of their mean (by 0.19, i.e. 17%, for the simulated
    rounds of 3.9 tokens at cap 8; less at lower caps, 0 for plain decoding). Caps 4 to 8
    differ by 2-5%: scored on committed tokens, the arms that draft most were judged slowest,
    and the simulated ladder ended at caps 2 to 4 in a third of the runs
    (scripts/sim_ladder.py)."""
    known = min(verified, len(rates))
    tokens, alive = 1.0, 1.0
    for rate in rates[:known]:
        alive *= rate
        tokens += alive
    return tokens + max(0, accepted - known)


def fixed_lengths(limits: Sequence[int], base_tokens: int) -> Choice:
    """Today's behaviour: every available draft is verified (expected tokens unknown: NaN)."""
    return Choice(list(limits), float("nan"), base_tokens + sum(limits))


def best_prefix(
    survival: Sequence[Sequence[float]],
    base_tokens: int,
    step_seconds: Callable,
    # seconds to draft for n requests whose longest verify is L drafts (arrays n, L; n >= 1)
    draft_seconds: Callable,
) -> Choice:
    """The best number of admitted drafts when every estimate comes from PAST rounds only
    (DFlash/NGRAM, and which requests DSpark drafts at all): no early stop is needed for
    losslessness here, so every prefix of the walk is priced, and the draft forward's cost
    (paid for every request that drafts, over a block as long as the longest verify) can
    make a longer prefix pay where the first candidate alone does not."""
    reqs = len(survival)
    a, r, j = _candidates(survival)
    d = np.arange(len(a) + 1)
    tau = reqs + np.concatenate([[0.0], np.cumsum(a)])
    drafting = np.concatenate([[0], np.cumsum(j == 0)])  # requests with a draft admitted
    longest = np.concatenate([[0], np.maximum.accumulate(j + 1)])  # [N+1] longest admitted
    drafts = np.where(drafting > 0, draft_seconds(np.maximum(drafting, 1), longest), 0.0)
    cost = step_seconds(base_tokens + d) + drafts
    best = int(np.argmax(tau / cost)) if reqs else 0  # first maximum: the shortest prefix
    return Choice(_lengths(reqs, r, j, best), float(tau[best]), base_tokens + best)


# ---------------------------------------------------------------------- the per-group policy

def draft_curve_guess(curve: CostCurve, max_rows: int, scale: float) -> CostCurve:
    """Seconds to draft n draft rows (Proposer.draft_rows) before any draft was timed: the
    target forward at n tokens scaled by the draft/target layer ratio (refined online from
    real draft times)."""
    points = profile_points(max(1, max_rows))
    # The guess's shape is only a guess (the draft attends to long contexts and walks the
    # vocabulary per slot), so each point follows what was measured near it quickly: a probe
    # of one request and a block of 64 must not trade off through the shared overhead alone.
    return CostCurve(points, [scale * curve.step_seconds(n) for n in points],
                     shape_rate=DRAFT_SHAPE_RATE)


class PolicyMetrics:
    """What the summary reports: verified tokens per step, chosen lengths, and predicted vs
    realised tokens per round (overall and per draft position: a calibration check)."""

    def __init__(self, positions: int) -> None:
        self.verified_tokens: Counter[int] = Counter()  # decode tokens in a step's forward
        self.lengths: Counter[int] = Counter()  # drafts verified per request-round
        self.skipped_drafts = 0  # steps whose draft forward the policy skipped
        self.plain_steps = 0  # ... of which steps kept plain to time plain decoding
        self.dormant_steps = 0  # steps that left their rows out of the draft's context
        self.rounds = 0
        self.predicted = 0.0  # sum of predicted committed tokens (1 + survival)
        self.realised = 0.0  # sum of accepted drafts + 1
        self.pos_rounds = [0] * positions  # rounds that verified draft k
        self.pos_predicted = [0.0] * positions  # sum of a_k over those rounds
        self.pos_realised = [0] * positions  # rounds where drafts 1..k were all accepted

    def to_dict(self) -> dict:
        return {
            "verified_tokens_per_step": dict(sorted(self.verified_tokens.items())),
            "chosen_lengths": dict(sorted(self.lengths.items())),
            "skipped_draft_steps": self.skipped_drafts,
            "plain_steps": self.plain_steps,
            "dormant_steps": self.dormant_steps,
            "rounds": self.rounds,
            "predicted_sum": self.predicted, "realised_sum": self.realised,
            "positions": [{"rounds": n, "predicted_sum": p, "realised_sum": a}
                          for n, p, a in zip(self.pos_rounds, self.pos_predicted,
                                             self.pos_realised)],
        }


def merge_metrics(parts: list[dict]) -> dict:
    """One report from every attn_dp group's PolicyMetrics.to_dict(): counts add up."""
    out: dict = {"verified_tokens_per_step": Counter(), "chosen_lengths": Counter(),
                 "skipped_draft_steps": 0, "plain_steps": 0, "dormant_steps": 0, "rounds": 0,
                 "predicted_sum": 0.0, "realised_sum": 0.0, "positions": []}
    for p in parts:
        for key in ("verified_tokens_per_step", "chosen_lengths"):
            out[key].update({int(k): v for k, v in p[key].items()})
        for key in ("skipped_draft_steps", "plain_steps", "dormant_steps", "rounds",
                    "predicted_sum", "realised_sum"):
            out[key] += p[key]
        for i, pos in enumerate(p["positions"]):
            if i == len(out["positions"]):
                out["positions"].append({"rounds": 0, "predicted_sum": 0.0, "realised_sum": 0})
            for key in pos:
                out["positions"][i][key] += pos[key]
    # None without a predicted round (tau is never below 1: 0.0 read as a measurement)
    rounds = out["rounds"]
    predicted, realised = out.pop("predicted_sum"), out.pop("realised_sum")
    out["predicted_tau"] = round(predicted / rounds, 4) if rounds else None
    out["realised_tau"] = round(realised / rounds, 4) if rounds else None
    out["calibration"] = [
        {"position": i + 1, "rounds": p["rounds"],
         "predicted": round(p["predicted_sum"] / max(p["rounds"], 1), 4),
         "realised": round(p["realised_sum"] / max(p["rounds"], 1), 4)}
        for i, p in enumerate(out.pop("positions")) if p["rounds"]]
    for key in ("verified_tokens_per_step", "chosen_lengths"):
        out[key] = dict(sorted(out[key].items()))
    return out


class VerifyPolicy:
    """One attn_dp group's verify-length policy, called by the engine every step:

    1. plan(): before drafting, from past steps only — the ladder's arm (spec/ladder.py:
       the most drafts any request verifies, and whether the cost model decides within that
       cap), then per request the most drafts it may verify (0: do not draft it): the cap,
       or, in a model arm, best_prefix's lengths, which price the draft forward by its rows
       (a block drafter runs the shortest block that holds the longest verify).
       DFlash/NGRAM: these are the lengths. DSpark in a model arm: choose() may cut further.
    2. choose(): DSpark, after drafting — calibrated confidences, Algorithm 1 (early stop).
    3. record() each request's outcome, record_step() the measured times (which score the
       step's arm on its ladder, one per request class and batch size).

    Every rank of the group calls it with the same values (tokens, agreed times), so they
    choose the same lengths. In "fixed" mode it only predicts (for the calibration report)."""

    def __init__(self, mode: str, curve: CostCurve, draft_curve: CostCurve, positions: int,
                 temperatures: list[float] | None = None, confidence: bool = False,
                 draft_rows: Callable = lambda requests, longest: requests) -> None:
        if mode not in POLICIES:
            raise ValueError(f"speculative policy {mode!r}: expected one of {POLICIES}")
        self.mode, self.curve, self.draft_curve = mode, curve, draft_curve
        self.positions = positions
        self.temperatures = temperatures
        self.confidence = confidence
        self.draft_rows = draft_rows  # (requests, longest verify) -> the draft curve's unit
        self.tracker = AcceptanceTracker(positions)
        self.correction = ConfidenceCorrection(positions)
        self.metrics = PolicyMetrics(positions)
        self._survival: dict[object, list[float]] = {}  # this step's a_{r,1..} per request
        # Acceptance as each ladder arm measured it (round_score), and this step's reads
        self.measured = MeasuredRates(positions)
        self._rates: dict[tuple, list[float]] = {}
        self._idle = 0  # consecutive steps planned without any draft
        self._probe_every = PROBE_EVERY
        self._drafting = False  # the last step planned drafts
        self._accepted = False  # ... and some draft was accepted since drafting began
        self._idle_keys: list = []  # the requests of the last idle plan
        self._probes = 0  # probes so far: whose turn the next one is
        # What a drafting step's verify rows past the base really cost, over a plain step,
        # learned from past steps only: choices stay lossless.
        self.drafting = DraftingCost()
        self.plain_curve = CostCurve(list(curve.tokens), list(curve.seconds), ema=PLAIN_EMA,
                                     outlier_ratio=PLAIN_OUTLIER)
        # The ladder's yardstick: the start-up profile, never refined, so that arms measured
        # at different times are scored alike (a learned curve would move under them).
        self.reference = CostCurve(list(curve.tokens), list(curve.seconds))
        # ... read every step (a numpy interpolation each, ~8 us): remembered per token count
        self.yardstick: Callable[[int], float] = functools.cache(
            lambda tokens: float(self.reference.step_seconds(tokens)))
        self._since_plain = PLAIN_EVERY  # drafting steps planned since the last plain one
        self.ladders: dict[str, Ladder] = {}  # per request class and batch size ...
        # ... and the ladders of a class (every batch size) share one allowance
        # (spec/ladder.py: Allowance)
        self.allowances: dict[str, Allowance] = {}
        self._by_size: dict[tuple[str, int], Ladder] = {}  # the same, by (class, size)
        self._model = True  # this step's lengths are the cost model's (choose() may cut)
        # The step being planned: its times arrive in record_step() at the next step's
        # exchange, before that step is planned (engine.Engine._step).
        self._played: _Played | None = None
        self.dormant = False  # this step drafts nothing and its context may be left out
        self._choices = 0  # choose() calls (CALIBRATION_EVERY)
        self._picked: tuple[Ladder, int, str] | None = None  # pick()'s, for this step's plan()
        # A new ladder starts where a larger batch's stands (_ladder); False: at plain
        # decoding always (scripts/bench_warm_start.py compares the two)
        self.warm_start = True

    @property
    def adaptive(self) -> bool:
        return self.mode != "fixed"

    def pick(self, classes: Sequence[str]) -> int:
        """This step's arm on the ladder of its requests' majority class and number, from
        past steps only: the most drafts a request may verify (0: plain decoding). The
        engine asks before plan() to skip what a plain step does not need (each request's
        draft limit: ~45 us of a 20 ms step at batch 64); plan() picks itself otherwise."""
        cls = classes[0]  # the step's majority class (ties: the first met, as most_common)
        if 2 * classes.count(cls) < len(classes):
            cls = Counter(classes).most_common(1)[0][0]
        ladder = self._ladder(cls, len(classes))
        arm = ladder.pick(self._predictor(cls, len(classes)))
        self._picked = (ladder, arm, cls)
        return ladder.arms[arm].cap

    def plan(self, keys: Sequence[object], classes: Sequence[str], limits: Sequence[int],
             base_tokens: int) -> list[int]:
        self._survival = {}
        self._rates = {}
        self._played = None  # a step whose times never came (nothing of it was timed)
        self.dormant = False
        if not self.adaptive or not keys:
            self._picked = None
            return list(limits)
        if self._picked is None:
            self.pick(classes)
        (ladder, arm, cls), self._picked = self._picked, None
        cap, self._model = ladder.arms[arm].cap, ladder.arms[arm].model
        capped = [min(n, cap) for n in limits]
        lengths = (self._model_lengths(keys, classes, capped, base_tokens) if self._model
                   else capped)
        if self._model and arm == ladder.at and sum(lengths) \
                and self._since_plain >= PLAIN_EVERY:
            # Plain now, and let drafting resume next step (the step counts as plain's): the
            # model prices drafting against plain steps (the ladder's arms need none).
            self._since_plain, arm, lengths = 0, PLAIN, [0] * len(limits)
            self.metrics.plain_steps += 1
        self._since_plain = self._since_plain + 1 if sum(lengths) else 0
        if (not cap or any(limits)) and not sum(lengths):  # (at cap 0 the engine may pass
            self.metrics.skipped_drafts += 1  # zeros for limits it did not work out: pick())
        self.dormant = arm == ladder.at and not sum(lengths) and (
            self._model_asleep() if self.mode == "model" else ladder.quiet(WAKE_AHEAD))
        self.metrics.dormant_steps += self.dormant
        self._played = _Played(ladder, arm, cls, base_tokens)
        return lengths

    def _ladder(self, cls: str, requests: int) -> Ladder:
        """The ladder of the step's majority class and batch size, in powers of two (greedy
        and sampled rounds accept drafts at different rates, and verify rows cost more, next
        to a plain step, the more requests share it). One ladder for every size climbed to
        the top cap in a run's tail (a few requests left) and started the next run there at
        batch 64, where the top cap ran at 0.65x plain decoding.

        A new ladder starts where the nearest ladder of a larger batch of its class that left
        plain decoding stands (if any): drafting that pays for more requests pays for fewer
        (a request's acceptance is its own, and its verify rows cost less next to a smaller
        plain step), and a new ladder at plain decoding spent a run's drain there (at batch
        16 greedy, DFlash's drain below 9 requests was 5.5-5.8% of its decode time, plain
        at 0.36-0.44x the full batch's speed, scratch). It still measures plain decoding
        from there at once, and its top cap."""
        size = 1 << (requests - 1).bit_length()  # 1, 2, 3-4, 5-8, ..., 33-64: a full
        # batch of 64 and the 63 left for a step when one finishes play the same ladder
        ladder = self._by_size.get((cls, size))
        if ladder is None:
            key = f"{cls}, batch " + (f"{size // 2 + 1}-{size}" if size > 2 else f"{size}")
            ladder = self.ladders[key] = self._by_size[(cls, size)] = (
                Ladder(self.positions, top_cap(self.reference, size, self.positions),
                       try_steps=TRY_STEPS if size > 1 else 1,
                       allowance=self.allowances.setdefault(cls, Allowance()))
                if self.mode == "adaptive" else Ladder.single(self.positions, model=True))
            ladder.expect = functools.partial(self._expected, ladder, cls)
            ladder.name = key
            if self.mode == "adaptive" and self.warm_start:
                drafting = [s for (c, s), lad in self._by_size.items()
                            if c == cls and s > size and lad.current.cap]
                if drafting:
                    above = self._by_size[(cls, min(drafting))].current
                    ladder.start_at(above.cap, above.model)
        return ladder

    def _expected(self, ladder: Ladder, cls: str, j: int) -> float | None:
        """The log of arm j's committed tokens per round as all its measured rounds tell them
        (Ladder._gap); None before any, and for the cost model's arms: their steps' times
        move with the drafts the model chose (a step it kept from drafting is cheap and
        commits one token a round), so the tokens of their tries are no constant to
        re-score apart from the times (credited with the arm's mean, its cheap steps made
        DSPARK's and DFLASH's batch-16 greedy ladders end on the model's arms, round 31)."""
        arm = ladder.arms[j]
        if not arm.cap:
            return 0.0  # plain decoding commits one token a round, always
        return None if arm.model else self.measured.expectation((ladder, j, cls))

    def _predictor(self, cls: str, requests: int) -> Callable[[Arm], float | None]:
        """An arm's predicted speed over plain decoding for `requests` requests of class
        `cls`: committed tokens per round (1 + the survival of its drafts, this run's rates:
        optimistic until measured) over its step's seconds in plain steps (the start-up
        profile's verify and the draft curve's draft). None for the model's arms, whose
        lengths it does not know. From past rounds only, like every choice of the ladder."""
        def predict(arm: Arm) -> float | None:
            if arm.model:
                return None
            if not arm.cap:
                return 1.0
            tokens = 1.0 + sum(survival_of(self.tracker.global_rates(cls)[:arm.cap]))
            seconds = (self.yardstick(requests * (1 + arm.cap))
                       + self.draft_curve.step_seconds(self.draft_rows(requests, arm.cap)))
            return tokens * self.yardstick(requests) / seconds

        return predict

    def _model_lengths(self, keys: Sequence[object], classes: Sequence[str],
                       limits: Sequence[int], base_tokens: int) -> list[int]:
        """The cost model's lengths from past rounds (best_prefix), probing now and then
        while it drafts nothing."""
        if self.mode == "model" and self._backed_off() and self._idle + 1 < self._probe_every:
            # Idle after a probe that did not pay: nothing drafts before the next probe (the
            # estimates it would re-price have not moved), so that the policy can sleep
            # until WAKE_AHEAD steps before it (_model_asleep). (The ladder's model arms keep
            # re-pricing: a ladder sleeps only at plain decoding.)
            self._idle += 1
            return [0] * len(limits)
        if (self._idle % IDLE_RECHECK and self._idle + 1 < self._probe_every
                and keys == self._idle_keys):
            # Idle, same requests: their estimates have not moved (counts age with drafting
            # steps only) and only the cost curve drifts; skip re-pricing most steps.
            self._idle += 1
            return [0] * len(limits)
        past = [survival_of(self.tracker.conditional(k, c)[:lim])
                for k, c, lim in zip(keys, classes, limits)]
        choice = best_prefix(past, base_tokens, self._drafting_step(base_tokens),
                             lambda n, longest: self.draft_curve.step_seconds(
                                 self.draft_rows(n, longest)))
        if sum(choice.lengths) == 0 and any(limits):
            if self._drafting:  # drafting stopped: probe less often if none was accepted
                self._probe_every = (PROBE_EVERY if self._accepted
                                     else min(2 * self._probe_every, PROBE_EVERY_MAX))
            self._idle += 1
            if self._idle >= self._probe_every:
                # Probe: one request (in turn) drafts what it may, so the acceptance and the
                # draft's cost are measured again whatever the estimates say, at the price
                # of one request's draft; one step in PROBE_EVERY at most, backing off (up
                # to PROBE_EVERY_MAX) while no drafted round is accepted.
                choice = self._probe(limits, base_tokens)
        if sum(choice.lengths) and not self._drafting:
            self._accepted = False
        self._drafting = sum(choice.lengths) > 0
        if sum(choice.lengths) == 0 and any(limits):
            self._idle_keys = list(keys)
        else:
            self._idle = 0
        return choice.lengths

    def _backed_off(self) -> bool:
        """Idle, and probes spaced out past PROBE_EVERY (the last one accepted nothing)."""
        return self._idle > 0 and self._probe_every > PROBE_EVERY

    def _model_asleep(self) -> bool:
        """The "model" policy drafts nothing in this step nor in the WAKE_AHEAD after it:
        idle and backed off, its next probe further away (_model_lengths re-prices nothing
        before it). Its steps may then leave their rows out of the draft's context, as a
        ladder settled at plain decoding does (Ladder.quiet), which a one-arm ladder never
        is: without this, a drafter the model wrote off still cost its context writes at
        every step (batch 16, T=1: 2.1% of the embedded engine's wall time, 1.0-1.3% with
        sleep, prefill rows' writes included; scripts/bench_model_sleep.py)."""
        return self._backed_off() and self._idle + WAKE_AHEAD < self._probe_every

    def _probe(self, limits: Sequence[int], base_tokens: int) -> Choice:
        """The next request in turn that may draft drafts all it may; the others none."""
        drafting = [i for i, n in enumerate(limits) if n > 0]
        turn = drafting[self._probes % len(drafting)]
        self._probes += 1
        return fixed_lengths([n if i == turn else 0 for i, n in enumerate(limits)],
                             base_tokens)

    def choose(self, keys: Sequence[object], classes: Sequence[str], limits: Sequence[int],
               base_tokens: int, conf: Callable[[], torch.Tensor] | None = None,
               draft_rows: int = 0) -> list[int]:
        """The lengths to verify, after drafting. `conf` () -> [R, K]: DSpark's raw
        c_{r,1..K}, called only when read (None for the others, whose estimates are the
        tracker's); `draft_rows`: what was drafted
        (Proposer.draft_rows; paid already: a constant in every candidate's price)."""
        self._choices += 1
        if self.adaptive and not self._model and self._choices % CALIBRATION_EVERY:
            # A fixed cap decided in plan(): the estimates only feed the calibration report
            # and the confidence correction, which a sample of the steps serves as well
            # (every step's were ~2% of a batch-1 step).
            return list(limits)
        if conf is not None:
            cal = apply_temperatures(conf(), self.temperatures).tolist()  # one device->host copy
            cond = [self.correction.apply(cls, row[:lim])
                    for cls, row, lim in zip(classes, cal, limits)]
        else:
            cond = [self.tracker.conditional(k, c)[:lim]
                    for k, c, lim in zip(keys, classes, limits)]
        survival = [survival_of(row) for row in cond]
        self._survival = {k: s for k, s in zip(keys, survival)}
        self._cond = {k: row for k, row in zip(keys, cond)}
        if not self.adaptive:
            return list(limits)
        if conf is None or not self._model:
            return list(limits)  # decided in plan(): from past rounds, or the ladder's cap
        # The draft forward is paid, and so is verifying at all (plan() let these requests
        # draft at that price): Algorithm 1 weighs each candidate by its rows. (With the
        # overhead on the first candidate, its early stop would rarely pass it.)
        sunk = self.draft_curve.step_seconds(draft_rows) if draft_rows else 0.0
        step = self._drafting_step(base_tokens, verifying=True)
        return choose_lengths(survival, base_tokens, lambda n: step(n) + sunk).lengths

    def _drafting_step(self, base_tokens: int, verifying: bool = False) -> Callable:
        """Seconds of a step with n tokens: a plain step's (what plain steps measured) and,
        with rows past the base, what verifying was learned to cost (DraftingCost: an
        overhead for verifying at all, and the profile's price of the rows, scaled).
        `verifying`: the overhead is paid whatever n (a constant: choose())."""
        base, plain = self.curve.step_seconds(base_tokens), self._plain_seconds(base_tokens)

        def seconds(n):
            extra = self.drafting.seconds(self.curve.step_seconds(n) - base)
            return plain + (extra if verifying else np.where(np.asarray(n) > base_tokens,
                                                             extra, 0.0))
        return seconds

    def _plain_seconds(self, tokens: int) -> float:
        """A plain step of `tokens`: what plain steps measured (the first step, and one in
        PLAIN_EVERY, is plain even where drafting pays)."""
        return self.plain_curve.step_seconds(tokens)

    def _learn_drafting_cost(self, base_tokens: int, forward_tokens: int,
                             seconds: float) -> None:
        """One drafting step's forward over a plain step of its base, against the profile's
        price of its verify rows (DraftingCost): the profile runs fresh, uniform blocks,
        while real verify rows attend to long contexts in mixed widths, and a step that
        verifies pays for the verify path too. (The draft forward has its own curve.)"""
        if forward_tokens <= base_tokens:
            return
        seconds = self.curve.clipped(forward_tokens, seconds)  # (a stall, before the fit's
        # own clip applies)
        self.drafting.observe(
            self.curve.step_seconds(forward_tokens) - self.curve.step_seconds(base_tokens),
            seconds - self._plain_seconds(base_tokens))

    def record(self, key: object, cls: str, verified: int, accepted: int) -> None:
        """One request's round: `verified` drafts verified, `accepted` of them accepted."""
        m = self.metrics
        m.lengths[verified] += 1
        surv = self._survival.get(key)
        if self._played is not None:
            # The ladder scores what rounds commit, on average at the rates this run
            # measured (round_score; re-scored at all the arm's rounds when it is judged:
            # Ladder._gap, _expected): never a prediction. DSpark's confidences overstate deep
            # positions and sampled rounds (scored on them, batch 16 greedy climbed to caps
            # that ran at 1.01x plain decoding where cap 4 ran 1.2x, and batch 1 at T=1 left
            # plain decoding for 0.72x), and the tracker's rates lean on an optimistic prior
            # where little was measured (scored on those, batch 16 moved to cap 7, 1.06x,
            # from cap 4, 1.17x).
            played = self._played
            arm = (played.ladder, played.arm, cls)
            rates = self._rates.get(arm)
            if rates is None:  # as of the step's plan: from earlier steps only
                rates = self._rates[arm] = self.measured.rates(arm, MEASURED_AFTER)
            played.rounds += 1
            played.committed += round_score(rates, verified, accepted)
            self.measured.observe(arm, verified, accepted)
        self._accepted = self._accepted or accepted > 0
        self.tracker.observe(key, cls, verified, accepted)
        if surv is None:
            return
        if self.confidence and verified:
            self.correction.observe(cls, self._cond[key][:verified], accepted)
        m.rounds += 1
        m.predicted += 1.0 + sum(surv[:verified])
        m.realised += 1.0 + accepted
        for i in range(min(verified, self.positions)):
            m.pos_rounds[i] += 1
            m.pos_predicted[i] += surv[i]
            m.pos_realised[i] += int(accepted > i)

    def record_plain(self, rounds: int) -> None:
        """`rounds` requests of a step in which none drafted: record() of (0 verified,
        0 accepted) for each, at once (a plain round commits one token and teaches the
        acceptance estimates nothing; at batch 64 the calls one by one were ~0.4% of a
        plain step)."""
        self.metrics.lengths[0] += rounds
        if self._played is not None:
            played = self._played
            played.rounds += rounds
            played.committed += rounds * round_score([], 0, 0)
            if played.arm != PLAIN:  # a drafting arm's step in which no request drafted
                self.measured.observe((played.ladder, played.arm, played.cls), 0, 0, rounds)

    def record_step(self, decode_tokens: int, forward_tokens: int, forward_s: float,
                    draft_rows: int, draft_s: float, base_tokens: int | None = None,
                    context_s: float = 0.0) -> None:
        """Measured (agreed) times of the last step (`base_tokens`: its tokens before any
        draft; `context_s`: deferred context writes, in neither time): refine both curves and
        the drafting cost; age the counts.
        Acceptance counts age with drafting steps only: new evidence replaces old, but a
        drafter written off does not drift back to the optimistic prior by itself. Probes
        (plan(), backing off) are what tries it again."""
        self.metrics.verified_tokens[decode_tokens] += 1
        if decode_tokens:
            self._observe_ladder(forward_s + draft_s, context_s)
        if self.adaptive and base_tokens is not None and draft_rows \
                and forward_tokens == decode_tokens:
            # (A step that also prefills prices its chunks as plain steps' rows: not learned)
            self._learn_drafting_cost(base_tokens, forward_tokens, forward_s)
        if decode_tokens:
            # A prefill-only step is no choice of the policy's (and a chunk of n tokens costs
            # less than n requests' rows). The plain curve prices the step every candidate
            # starts from, so it learns from plain steps only: a drafting step's extra rows
            # (long contexts, mixed widths) would pull its overhead up and over-price plain
            # decoding; those rows are the drafting cost's.
            self.curve.observe(forward_tokens, forward_s)
            if not draft_rows:
                self.plain_curve.observe(forward_tokens, forward_s)
        if draft_rows:
            self.draft_curve.observe(draft_rows, draft_s)
            self.tracker.tick()
            self.measured.tick()
            self.correction.tick()

    def _observe_ladder(self, seconds: float, context_s: float) -> None:
        """The timed step's outcome to its ladder. Its times arrive at the next step's
        exchange, before that step is planned; a step none of whose requests was recorded
        is not the one timed."""
        played, self._played = self._played, None
        if played is None or not played.rounds:
            return
        yardstick = self.yardstick(played.base_tokens)
        played.ladder.observe(played.arm, played.rounds, played.committed,
                              seconds / yardstick, context_s / yardstick)

    def forget(self, key: object) -> None:
        self.tracker.forget(key)

    def report(self) -> dict:
        return {"policy": self.mode, **self.metrics.to_dict(),
                "ladders": {cls: ladder.to_dict() for cls, ladder in self.ladders.items()},
                "drafting_cost": self.drafting.to_dict(),
                "cost_curve": self.curve.to_dict(), "draft_cost_curve": self.draft_curve.to_dict()}


@dataclass
class _Played:
    """A step as the ladder played it: its arm, and what its requests committed."""

    ladder: Ladder
    arm: int  # index into ladder.arms
    cls: str  # the ladder's request class (the step's majority)
    base_tokens: int
    rounds: int = 0  # requests recorded
    committed: float = 0.0  # tokens they committed, as round_score counts them


def top_cap(curve: CostCurve, requests: int, max_drafts: int) -> int:
    """The largest cap whose verify the start-up profile prices at TOP_COST plain steps of
    `requests` at most (1 at least): the ladder measures it first and neighbours it from
    every arm. On this machine's profile that is the whole block at batch 1 (1 + 8 rows cost
    ~1.25 plain steps) and two drafts at batch 64 (the whole block, 5x a plain step there,
    ran at 0.65x plain decoding)."""
    plain = curve.step_seconds(requests)
    fits = [c for c in Ladder.caps(max_drafts)
            if c and curve.step_seconds(requests * (1 + c)) <= TOP_COST * plain]
    return max(fits) if fits else min(1, max_drafts)


def survival_of(cond: Sequence[float]) -> list[float]:
    out, a = [], 1.0
    for c in cond:
        a *= min(1.0, max(0.0, float(c)))
        out.append(a)
    return out


def format_policy(report: dict) -> str:
    """Summary lines: the policy's choices and its calibration check."""
    calib = " ".join(f"{c['position']}:{c['predicted']:.2f}/{c['realised']:.2f}"
                     for c in report.get("calibration", []))
    ladders = "; ".join(
        f"{cls} cap {lad['current']['cap']}{' (model)' if lad['current']['model'] else ''}"
        f" after {lad['steps']} steps ({lad['tries']} trying a neighbour)"
        for group in report.get("ladders", []) for cls, lad in group.items())

    def tau(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    # Rounds with a prediction: under adaptive the cost model's, and the fixed-cap rounds
    # that read the confidence head (CALIBRATION_EVERY): a sample of the drafting rounds.
    return (f"verify ladder: {ladders or 'none'}\n"
            f"speculative policy {report['policy']}: predicted tau {tau(report['predicted_tau'])}"
            f" vs realised {tau(report['realised_tau'])} over {report['rounds']} predicted "
            f"rounds; drafts "
            f"verified per round {report['chosen_lengths']}; draft forward skipped in "
            f"{report['skipped_draft_steps']} steps ({report['plain_steps']} of them "
            f"to time plain decoding, {report['dormant_steps']} dormant)\n"
            f"verified tokens per step {report['verified_tokens_per_step']}\n"
            f"survival per position, predicted/realised: {calib}")
