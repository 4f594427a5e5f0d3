"""The verify ladder: the most drafts a request verifies this step, chosen by measured speed.

Algorithm 1 (spec/policy.py) prices every verify row and draft row with a cost model, a
profile refined online. On a shared CPU that model's errors cost more than its choices gain:
at batch 16 greedy, DSpark verifying a fixed 2-4 drafts per request ran 1.10-1.29x plain
decoding while the model's own lengths ran 0.98-1.17x in the same runs (engines interleaved),
and at batch 64 the model drafted where plain decoding was faster (0.82-0.93x). A verify row's
price there moves with the batch, the context and the machine's load, and its errors compound
through the draft block it implies. So the policy measures what each choice really yields.

An arm is (cap, model): every request verifies at most `cap` drafts; with `model` the cost
model decides within the cap (Algorithm 1 and best_prefix), without it every request verifies
the cap (cap 0: plain decoding). A step's speed is the tokens its requests commit (on
average at the acceptance rates this run measured, where measured: spec/policy.py
round_score; never a prediction, see VerifyPolicy.record) per request-round, over its seconds
in units of a yardstick step of those tokens (the start-up profile, never refined, so that a
batch of 4 and one of 16 compare).

Paired comparisons: this machine's speed drifts by +-15% within seconds, and a cold start is
slower still, so arms measured at different times do not compare. The ladder plays its current
arm and keeps a short average of its speed; every few steps it tries a neighbour (the next two
caps up or down, the same cap with the other mode, the top cap, plain decoding) for one step
(or `try_steps`, of which the first after the change of arm is not scored: see TRY_STEPS; plain
decoding tried from a drafting arm: PLAIN_TRY_STEPS) and scores it against the current arm's
average just before it: the log of the ratio, averaged (with forgetting) per arm, with its
standard error (a try scatters at least as much as one step's time of the current arm does
around their recent average: the machine's and the batch's noise). The tokens in a try's ratio
are re-scored whenever the arm is judged, at all the rounds it has played (_gap): tries scored
at a young arm's first rates all shared their error. It moves to a neighbour whose ratio is
above 1 + MARGIN (1 + ENTER from plain decoding) and 1 by Z standard errors. A neighbour that
is slower (or ties within the margin) is tried less and less often: its wait doubles (grows 4x
when clearly slower), up to EXPLORE_MAX, so where nothing pays exploring costs little (the
budget bounds it); long waits end on multiples of themselves (ALIGN), so those tries come in
bursts. One not yet resolved keeps being tried, for PATIENCE tries. A try far off its arm's
record (SURPRISE: the machine or the batch changed) makes the old tries count less and the arm
due again soon. After a move the ratios are re-based on the new arm (the old one's is the
mirror of the one that won, the others' shift by the winner's and count less: they are
estimates through it), except after leaving plain decoding or a fixed arm for a cost-model arm:
then the arm left is measured afresh from the new one (_move).

Exploring is paid for: tries are made only while what they lost (and, at plain decoding, what
waking for them cost) stays within BUDGET of the run's time (plus a small ALLOWANCE, one for
all the ladders of a request class: Allowance), so a drafter that never pays costs at most
that, even in a short run; a try faster than the current arm refills the budget. At plain decoding
BUDGET is the rate just after a move; it falls the longer the ladder stays (SETTLE), so
exploring from a settled plain ladder costs ever less of the run. Once the budget has held
plain decoding's tries back, they resume after a REFILL, in a burst.

It starts at plain decoding, so speculation has to earn its place (a smaller batch's new
ladder may start where a larger batch's earned it: start_at), and measures the top cap at
once: where speculation pays most that is where the ladder ends (at batch 1 greedy a climb cap
by cap took hundreds of steps), and where it does not the caps below are measured next.
A climb continues in its direction first. Plain decoding neighbours every arm, so the ladder
can always fall back to it. A fixed cap whose first tries ran far below the current arm, as the
policy predicts it would (this run's acceptance rates and the start-up profile), backs off as
a judged clear loser does, without the tries a judgement takes.

Lossless: the arm of a step is a function of earlier steps' outcomes and times only (and
which ladder plays it, of the step's requests: their class and number), fixed before any draft
of this step exists (a length from past rounds, spec/policy.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from dspark_launch.log import logger

# Caps tried (those below max_drafts, and max_drafts). 7 and 15, not 6 and 12: 1 + cap verify
# rows per request fill GEMM tiles at small batches (one thread's 256->1024 projection took
# 66.9 us for 8 rows and 82.1 us for 9; DSpark with the policy bypassed ran 1.98x plain decoding
# at 7 drafts and 1.92x at 8, batch 1 greedy).
CAPS = (0, 1, 2, 3, 4, 7, 8, 15, 16)
EXPLORE_EVERY = 4  # steps between tries of one neighbour at first ...
EXPLORE_MAX = 512  # ... doubling, up to this, while it does not win
# A wait of ALIGN steps or more (waits are powers of two) ends on the nearest multiple of
# itself: the neighbours a settled ladder tries now and then come due together and are tried
# in one burst, so a dormant ladder (spec/policy.py: WAKE_AHEAD) wakes once for all of them.
# Each due on its own schedule woke it WAKE_AHEAD steps early per neighbour: at batch 1, T=1,
# 45% of a run's steps were awake.
ALIGN = 64
TRY_GAP = 3  # steps between two tries of any neighbours (a climb's next cap excepted)
# A ladder built with try_steps > 1 (the policy's, above batch 1) plays a try for that many
# steps and scores none of the first step after a change of arm, its try's nor the current
# arm's on its return: that step is no measure of the arm it plays.
# - Its caches were left by other shapes: at batch 16 greedy (Xeon, one thread) plain steps
#   between DFlash's cap-3 steps took 8.94, 8.74, 8.47, 8.41 ms as the 1st to 4th step after
#   the change (NONE's own 7.85 ms; scripts/bench_switch.py, docs/bench/bench_switch.json).
# - A drafting step after plain ones drafts from fresh positions, while in a drafting arm every
#   round starts where the last one failed: DFlash's cap 3 committed 39.2, 37.7, 36.5 and 36.9
#   tokens in the 1st to 4th step after four plain ones.
# Both flatter drafting in a one-step try: plain decoding's tries scored 0.81-0.87x DFlash's
# cap 3, which ran 0.97-0.98x plain decoding end to end, and the ladder stayed at cap 3; NGRAM
# stayed at cap 7 (0.91-0.94x plain decoding) beside cap 4 (1.03x). The price: a try costs two
# steps for one measured (the exploration budget counts both). At batch 1 one round's scatter
# (1 to 9 tokens) dwarfs the effect and one-step tries stay. What this left: even in steady
# play, plain steps between drafting ones ran 5-7% over NONE's, so DFlash at batch 16 could
# still settle at cap 4 (0.93x plain decoding end to end, 1.10x by its tries). Most of that
# was the KV rows' layout: each round's rejected rows were freed and reserved anew, scattering
# every request's rows among the others'. They stay the request's now (KVSpace.roll_back), and
# at batch 64 greedy the 2nd to 4th plain steps after DSpark's cap-4 ones took 1.003-1.029x
# NONE's, not 1.046-1.056x (docs/bench/bench_switch_xeon_r{29,30}_b64_dspark.json).
TRY_STEPS = 2
# A try of plain decoding from a drafting arm plays this many steps even at batch 1, and its
# first is not scored either: a plain step right after drafting ones ran 1.04-1.07x a plain
# step after plain ones there (DFlash, T=1, Xeon; scripts/bench_switch.py), which is about
# what a drafting arm that loses 5% beats plain decoding by, so a ladder that had moved to
# one left it only by chance. A drafting arm's tries at batch 1 keep one step: a round's
# scatter there dwarfs the effect, and each step of theirs costs more.
PLAIN_TRY_STEPS = 2
MIN_ROUNDS = 16  # request-rounds a neighbour must have measured before it is judged ...
MIN_TRIES = 3  # ... over this many steps at least
PATIENCE = 6  # tries after which an unresolved neighbour is tried less often too
HALF_LIFE = 2048  # steps (of any arm) after which a try counts half: four tries of a
# neighbour that keeps losing (EXPLORE_MAX apart) still count when it is judged
PATH_KEPT = 64  # moves a ladder's report keeps (to_dict's path), the latest
BASE_ROUNDS = 32  # request-rounds the current arm's speed is averaged over, and ...
BASE_STEPS = 4  # ... steps at least (at batch 64 one step's scatter misled every try)
MARGIN = 0.02  # a neighbour must be this much faster to be moved to ...
TIE = 0.06  # plain decoding within MARGIN / 2 of the current arm, to within this: a tie
# ... and from plain decoding to a drafting arm, this much: one-step tries at batch 16 could
# not tell arms 2-7% apart, and DFlash there wandered among caps that each ran 0.93-1.0x
# plain decoding end to end (per-arm step accounting) while their tries scored 1.0-1.1x
ENTER = 0.05
CLEAR = 0.10  # a neighbour slower by this much (with Z standard errors) waits 4x longer
Z = 2.0  # ... by this many standard errors of its log ratio (judged after every try)
CLIP = math.log(2.0)  # a try's log ratio counts as at most this (a stalled machine's step)
NOISE = 0.05  # the least scatter of a try's log ratio (a few tries can look steadier) ...
NULL_RATE = 1 / 32  # ... or, if more, one step's time around the current arm's recent steps',
# averaged at this rate (Ladder._floor)
SURPRISE = 3.0  # a try this many scatters off its arm's mean: the machine or batch changed
# (at two, DFlash at batch 1, T=1, whose rounds commit 1 to 8 tokens by chance, tried its
# neighbours in 569 of 5495 steps, DSpark, scored by confidences, in 199 of 5587) ...
SURPRISE_KEEP = 0.25  # ... and what its old tries still count then, or once re-based on a
# new arm
PLAIN = 0  # the arm index of plain decoding
# Plain decoding not yet told apart from the current arm is tried at least every UNRESOLVED
# steps: a drafting arm that only ties costs CPU for nothing, and a tie is plain decoding's
# (_judge). Its tries cost next to nothing then (it is about as fast). Waiting EXPLORE_MAX,
# a ladder that moved on a synchronised start's lucky tries (a first wave's requests drafting
# the same stretch of text) could not tell, for hundreds of steps, that its tries since
# then said otherwise: plain's record mixed both.
UNRESOLVED = 64
_KEEP = 0.5 ** (1 / HALF_LIFE)  # what a try still counts one step later
# A neighbour not yet judged whose tries so far AND predicted speed (VerifyPolicy._predictor:
# this run's acceptance and the start-up profile) are both below this share of the current
# arm's is not tried when due; it backs off as a clear loser would, until its wait reaches
# EXPLORE_MAX: at batch 64, T=1, one-step tries of fixed caps ran 0.57-0.67x and took a
# quarter of a repeat's ~115 steps before the ladder could judge them. Either alone may be
# wrong (one try scatters; the profile is another machine's moment), so both must agree.
UNLIKELY = 0.75
# Exploration pays its way: a try is made only while the time tries lost (their seconds times
# how much slower than the current arm they committed; a faster try counts as a gain) stays
# within BUDGET of all steps' seconds plus ALLOWANCE yardstick steps. A drafter that never
# pays then costs at most that, however short the run: at batch 64 a repeat is ~128 steps,
# and the first tries of each neighbour (0.6x plain decoding there) took 10% of it.
BUDGET = 0.01
# ALLOWANCE is shared by the ladders of one request class (Allowance): every batch size has its
# own ladder, and a run's drain alone visits five (batch 64 -> 33-64, 17-32, ..., 1). Each with
# ALLOWANCE of its own, the small ladders of the drains each spent theirs (at batch 64, T=1,
# DSpark and NGRAM: 5.9-7.3 yardstick steps each in the 17-32 and 9-16 ladders' first 90-130
# steps), and a drafter that never paid lost ALLOWANCE times the ladders it had. Not shared
# across classes: greedy and sampled requests are different workloads, and a class's first
# ladder must be able to measure its top cap at once. Shared, the greedy ladder's overdraft
# at batch 1 held the sampled one at plain decoding through a whole warm-up pass (DFlash at
# T=1: tau 1.01 where it had been 1.70).
ALLOWANCE = 6.0
# ... and at plain decoding BUDGET is the rate of a ladder that just came there (or started):
# it falls as the ladder stays, to half after SETTLE yardstick steps, a third after twice that,
# and so on down to BUDGET_FLOOR, so what a ladder settled at plain decoding spends grows like
# the log of the run, not with it. There it explores only to find out whether anything
# changed, and a flat 1% was most of what adaptive engines lost to NONE where nothing paid
# (batch 64 greedy, DSpark: 0.972-0.986x NONE against 0.996-1.001x pinned to plain decoding;
# its ladder spent 0.94% of the run on tries and wakes, and the drain after each burst of
# tries is not counted). A drafting arm keeps the flat rate: its neighbours are close rivals
# whose one-step tries at batch 1 scatter widely, and rationed, a neighbour measured 1.16x
# (NGRAM at batch 1 greedy, cap 2 with the model) went unresolved and the run fell from 1.53x
# to 1.37x NONE. Any move restarts the fall.
SETTLE = 512.0
BUDGET_FLOOR = 0.001
# At plain decoding the tries' budget pays for waking too: an awake plain step writes the
# draft's context (its rows; a dormant one does not), in no arm's time (engine.step) but in
# the run's, and those writes are charged to the budget at the next try (admitted first, so
# that a wake never holds back the try it was for). At batch 16 and 64 an awake plain step
# ran 3.7% over a dormant one, and uncharged, a ladder kept awake by frequent tries ran
# 0.97-0.98x plain decoding with its tries within budget.
# Once the budget stops a try of plain decoding's neighbours, tries resume only when REFILL
# yardstick steps of room are back: then they come in bursts, and a dormant engine wakes
# (WAKE_AHEAD) once per burst. Resumed as soon as one try fitted, a settled ladder at batch 16,
# T=1 tried one neighbour every ~60 steps, each after 32 awake steps: a third of the steps
# were awake, at +2.7% each (DFlash). A drafting arm has no wake to save: no refill there.
REFILL = 3.0


class Allowance:
    """ALLOWANCE yardstick steps that the ladders sharing it (a request class's, every batch
    size: policy.py) may lose, together, beyond the budget each earned (BUDGET): a ladder may
    spend its own unspent budget, then what is left of the allowance once every ladder's
    overdraft is taken out. So all of them together lose at most their budgets plus ALLOWANCE
    (plus the try that crossed it, each)."""

    def __init__(self, steps: float = ALLOWANCE) -> None:
        self.steps = steps
        self.ladders: list[Ladder] = []

    def left(self) -> float:
        return self.steps - sum(max(0.0, lad.spent - lad.earned) for lad in self.ladders)


@dataclass
class Arm:
    cap: int  # most drafts a request verifies (0: plain decoding)
    model: bool  # the cost model decides within the cap (False: every request verifies it)
    # Forgetting sums over its tries t, each of weight w_t (request-rounds) and log ratio y_t
    # (its speed over the current arm's just before):
    rounds: float = 0.0  # sum w
    seen: float = 0.0  # sum w, never faded: how much it was measured (when to judge it) ...
    count: int = 0  # ... and over how many tries
    total: float = 0.0  # sum w y
    # sum w u, u_t the log of the tokens per round its try was scored with: the part of y_t
    # that the arm's own acceptance, as measured then, set (Ladder._gap re-scores it)
    tokens: float = 0.0
    squares: float = 0.0  # sum w y^2 ...
    weights: float = 0.0  # ... and sum w^2: the mean's standard error
    warm: bool = False  # its first step was seen (and not scored: one-time costs)
    wait: int = EXPLORE_EVERY  # steps until this arm is tried again as a neighbour
    due: int = 0  # the step from which it may be

    def __str__(self) -> str:
        return f"cap {self.cap}{' (model)' if self.model else ''}" if self.cap else "plain"

    def observe(self, rounds: int, log_ratio: float, log_tokens: float = 0.0) -> None:
        self.rounds += rounds
        self.seen += rounds
        self.count += 1
        self.total += rounds * log_ratio
        self.tokens += rounds * log_tokens
        self.squares += rounds * log_ratio * log_ratio
        self.weights += rounds * rounds

    def fade(self, keep: float) -> None:
        """Every step: old tries count less, whichever arm was played (a ratio measured
        long ago says little of the machine now). Their mean's standard error stays: fading
        weighs new tries against old ones, it does not make an arm untried."""
        self.rounds *= keep
        self.total *= keep
        self.tokens *= keep
        self.squares *= keep
        self.weights *= keep * keep

    def shift(self, by: float) -> None:
        """Re-base the tries: every log ratio moves by `by` (their scatter stays)."""
        self.squares += 2 * by * self.total + by * by * self.rounds
        self.total += by * self.rounds

    def forget(self) -> None:
        """No tries: measured afresh (young)."""
        self.rounds = self.seen = self.total = self.tokens = self.squares = self.weights = 0.0
        self.count = 0

    def mirror(self, other: Arm) -> None:
        """Take `other`'s tries, negated: A over B is the inverse of B over A."""
        self.rounds, self.weights = other.rounds, other.weights
        self.seen, self.count = other.seen, other.count
        self.total, self.squares = -other.total, other.squares
        self.tokens = 0.0

    @property
    def judgeable(self) -> bool:
        """Enough tries to judge: MIN_ROUNDS request-rounds over MIN_TRIES steps or more
        (one step's scatter says nothing of the next's)."""
        return self.seen >= MIN_ROUNDS and self.count >= MIN_TRIES

    @property
    def log_ratio(self) -> float:
        return self.total / self.rounds if self.rounds else 0.0

    def scatter(self, floor: float = NOISE ** 2) -> float:
        """One try's standard deviation around the mean (its variance at least `floor`)."""
        if not self.rounds:
            return math.inf
        return math.sqrt(max(floor, self.squares / self.rounds - self.log_ratio ** 2))

    def log_error(self, floor: float = NOISE ** 2) -> float:
        return (self.scatter(floor) * math.sqrt(self.weights) / self.rounds if self.rounds
                else math.inf)


class Ladder:
    """The hill climb of one request class and batch size (see the module docstring)."""

    def __init__(self, max_drafts: int, top: int | None = None, try_steps: int = 1,
                 allowance: Allowance | None = None) -> None:
        """`top`: the cap every arm neighbours and the ladder measures first (default the
        largest; see policy.py's top_cap). `try_steps`: steps a try plays (TRY_STEPS; above 1
        the first step after every change of arm is not scored). `allowance`: shared with the
        other ladders of its request class (default: one of its own)."""
        caps = self.caps(max_drafts)
        self.top = max_drafts if top is None else top
        assert self.top in caps, f"top cap {self.top} not among {caps}"
        self.arms = [Arm(0, False)] + [Arm(c, m) for c in caps if c for m in (False, True)]
        self.near = [self._neighbours(i) for i in range(len(self.arms))]  # per arm
        self.at = PLAIN  # the current arm: plain decoding until speculation measured faster
        # Its moves, (step, cap, model) each, the latest PATH_KEPT, at this ladder's steps
        # (a ladder that starts where a larger batch's left plain decoding, start_at, moves
        # there at step 0): where a table's cell drafted in only part of its decode time,
        # the path tells how the ladder climbed and fell back, and at which of its steps.
        self.path: list[tuple[int, int, bool]] = []
        self.base = math.nan  # the current arm's recent speed (the yardstick of every try)
        self._base_rounds, self._base_steps = 0.0, 0
        self.steps = 0
        self.tries = 0  # steps that tried a neighbour
        self._turn = 0  # which neighbour is tried next
        self._tried = -TRY_GAP  # the step a neighbour was last tried
        self.try_steps = try_steps
        self._trying: tuple[int, int] | None = None  # a try under way: (arm, steps left)
        self._previous: int | None = None  # the arm of the last step observed
        self.spent = 0.0  # what tries lost in the steps seen (BUDGET) ...
        self.earned = 0.0  # ... and may lose: the budget's rate summed over them (SETTLE)
        self._settled = 0.0  # yardstick steps since the last move (SETTLE)
        self._refilling = False  # the budget stopped a try: no tries until REFILL is back
        self._waking = 0.0  # context writes of awake plain steps not yet charged (BUDGET)
        self.name = ""  # its request class and batch sizes, for the log (policy.py)
        self.allowance = Allowance() if allowance is None else allowance
        self.allowance.ladders.append(self)
        self._unfaded = 0  # scored steps whose fade the arms have not had yet (_settle)
        # The current arm's steps: the average log of their relative seconds, and the mean
        # squared miss of one step's against it (over _misses steps): the machine's and the
        # batch's noise in a try's ratio (its tokens' is in the arm's own scatter).
        self._seconds = 0.0
        self._null = NOISE ** 2
        self._misses = 0
        self._quiet_until = 0  # picks before this step return the current arm (quiet())
        # An arm's committed tokens per round as all its rounds so far tell them (the log),
        # or None (then its tries' own scores stand): the policy's (spec/policy.py:
        # VerifyPolicy._expected). See _gap.
        self.expect: Callable[[int], float | None] | None = None
        # The arm a climb measures next, at once (from plain decoding: the top cap, where
        # speculation pays most; the caps below are measured next, being young)
        self._ahead: int | None = next((j for j, a in enumerate(self.arms)
                                        if a.cap == self.top and a.cap and not a.model), None)

    @staticmethod
    def caps(max_drafts: int) -> list[int]:
        """The caps of a ladder for up to max_drafts drafts, plain decoding (0) first."""
        return sorted({c for c in CAPS if c < max_drafts} | {max_drafts})

    @classmethod
    def single(cls, cap: int, model: bool) -> Ladder:
        """One arm, never left (the "model" policy: the cost model alone at the full cap)."""
        ladder = cls(0)
        ladder.arms, ladder.near, ladder.top = [Arm(cap, model)], [[]], cap
        ladder._ahead = None
        return ladder

    def start_at(self, cap: int, model: bool) -> None:
        """Begin at arm (cap, model) rather than plain decoding, as if just moved there from
        plain decoding (which is then measured afresh from it, at once), still measuring the
        top cap at once: for the ladder of a batch smaller than one whose ladder settled
        there (VerifyPolicy._ladder)."""
        self._move(next(j for j, a in enumerate(self.arms) if (a.cap, a.model) == (cap, model)))
        if self.top > cap:
            self._ahead = next(j for j, a in enumerate(self.arms)
                               if (a.cap, a.model) == (self.top, model))

    def _neighbours(self, i: int) -> list[int]:
        """Arms one or two caps up or down with the same mode (two: a cap that only ties
        must not hide the one past it), the same cap with the other mode, plain decoding
        (whatever the climb measured on its way, it can always fall back) and the top cap
        with the same mode (batch 1 greedy is fastest at the largest, and a climb cap by cap
        would take hundreds of steps; from plain decoding: both modes)."""
        arm, out = self.arms[i], []
        caps = sorted({a.cap for a in self.arms})
        k = caps.index(arm.cap)
        for j, other in enumerate(self.arms):
            step = abs(caps.index(other.cap) - k)
            same = other.model == arm.model or arm.cap == 0
            if (step in (1, 2) and (same or other.cap == 0)) or (step == 0 and j != i) \
                    or (j == PLAIN != i) or (other.cap == self.top and same and j != i):
                out.append(j)
        return out

    def pick(self, predict: Callable[[Arm], float | None] | None = None) -> int:
        """This step's arm: the current one, or (one step, then TRY_GAP steps of the
        current arm at least, once its speed is averaged over BASE_STEPS steps) the next
        neighbour in turn that is due; one not yet measured enough to be judged is due at
        once, and a climb's next cap is tried at once, unless `predict` (an arm's predicted
        speed over plain decoding, None: no prediction) makes it unlikely to pay."""
        self.steps += 1
        if self._trying is not None:  # a try's next step (its first paid the switch)
            j, left = self._trying
            self._trying = (j, left - 1) if left > 1 else None
            self._tried = self.steps
            return j
        if self.steps < self._quiet_until:  # quiet() found nothing due before then
            return self.at
        if self._base_steps < BASE_STEPS:  # no yardstick yet: tries would share one step's
            return self.at  # scatter (since the start, or a move)
        if self._over_budget():
            return self.at  # exploring has lost its share: the current arm earns it back
        if self._ahead is not None and self._unlikely(self._ahead, predict):
            self._ahead = None
        if self._ahead is not None and not self.arms[self._ahead].judgeable:
            # In a row, once: one-step tries spaced out each paid the draft's cold caches
            # (at batch 1 greedy the top cap's 16 measured 1.2x, in a row 1.45x; it runs
            # 1.8x), and the ladder climbed through caps 2 and 4 for hundreds of steps.
            self._begin_try()
            return self._ahead
        if self.steps - self._tried <= TRY_GAP:
            return self.at
        near = self.near[self.at]
        for k in range(len(near)):
            j = near[(self._turn + k) % len(near)]
            arm = self.arms[j]
            if self.steps >= arm.due:
                if self._unlikely(j, predict):  # a clear loser by prediction: backs off
                    arm.wait = min(4 * arm.wait, EXPLORE_MAX)
                    arm.due = self._due(arm.wait)
                    continue
                self._turn = (self._turn + k + 1) % len(near)
                arm.due = self._due(arm.wait) if arm.judgeable else self.steps + 1
                self._begin_try()
                steps = self._steps_of_try(j)
                if steps > 1:
                    self._trying = (j, steps - 1)
                return j
        return self.at

    def _steps_of_try(self, j: int) -> int:
        """Steps a try of arm j plays: try_steps, and at least two for plain decoding tried
        from a drafting arm (PLAIN_TRY_STEPS)."""
        if j == PLAIN and self.at != PLAIN:
            return max(self.try_steps, PLAIN_TRY_STEPS)
        return self.try_steps

    def _begin_try(self) -> None:
        """A neighbour is tried this step: counted, and charged what waking for it cost."""
        self.tries += 1
        self._tried = self.steps
        self.spent += self._waking  # (BUDGET)
        self._waking = 0.0

    def _room(self) -> float:
        """Yardstick steps tries may still lose: the budget earned (SETTLE) and not spent, plus
        what the shared ALLOWANCE has left, keeping room for a whole try (each of its steps
        after the first loses at most one)."""
        return (max(self.earned - self.spent, 0.0) + self.allowance.left()
                - (self.try_steps - 1))

    @property
    def rate(self) -> float:
        """The budget's share of the time now: BUDGET, falling at plain decoding (SETTLE)."""
        if self.at != PLAIN:
            return BUDGET
        return max(BUDGET * SETTLE / (SETTLE + self._settled), BUDGET_FLOOR)

    def _over_budget(self) -> bool:
        """No room for a try, or, at plain decoding since there was none, not yet REFILL."""
        room = self._room()
        self._refilling = room < (REFILL if self._refilling and self.at == PLAIN else 0.0)
        return self._refilling

    @property
    def _floor(self) -> float:
        """The least variance of a try's log ratio: NOISE, or, if more, how far one step's
        time strays from the current arm's recent steps' (the machine, the batch's contexts;
        not its tokens, whose scatter is the tried arm's own). A few tries can look steadier
        than the machine is: at batch 64 plain steps strayed from their yardstick by ~12%,
        three tries of an arm that ran 0.89x plain decoding scattered by less, and the
        ladder moved to it."""
        return max(NOISE ** 2, self._null)

    def _due(self, wait: int) -> int:
        """The step a neighbour waiting `wait` steps from now is due (ALIGN): on average
        `wait` steps from now, and later than now."""
        due = self.steps + wait
        return (due + wait // 2) // wait * wait if wait >= ALIGN else due

    def _unlikely(self, j: int, predict: Callable[[Arm], float | None] | None) -> bool:
        """Arm j, tried but not judged yet and not yet kept waiting EXPLORE_MAX steps, ran
        and is predicted below UNLIKELY x the current arm's speed (in the end every arm is
        judged on its tries alone)."""
        arm = self.arms[j]
        if predict is None or arm.judgeable or arm.wait >= EXPLORE_MAX or not arm.rounds \
                or self._gap(j) >= math.log(UNLIKELY):
            return False
        mine, there = predict(self.current), predict(arm)
        return mine is not None and there is not None and there < UNLIKELY * mine

    def observe(self, i: int, rounds: int, committed: float, relative_seconds: float,
                context: float = 0.0) -> None:
        """One step played with arm i: `rounds` requests committed `committed` tokens in a
        step that took `relative_seconds` yardstick steps of them, and `context` yardstick
        steps more writing the draft's context for earlier plain steps (in no arm's time:
        at plain decoding it is the price of being awake for tries: BUDGET)."""
        if self.at == PLAIN:
            self._waking += max(context, 0.0)
        if rounds <= 0 or not relative_seconds > 0 or committed <= 0:
            return
        arm = self.arms[i]
        speed = committed / (rounds * relative_seconds)
        self.earned += relative_seconds * self.rate  # a try's first step loses time too
        self._settled += relative_seconds
        if i != self.at and not math.isnan(self.base):
            self.spent += relative_seconds * (1 - speed / self.base)
        switched, self._previous = self._previous is not None and i != self._previous, i
        if switched and arm.warm and self._steps_of_try(i) > 1:
            return  # the first step after a change of arm: not this arm's speed (TRY_STEPS)
        if not arm.warm:
            # An arm's first step pays one-time costs (allocations, first use): not its
            # speed. On the AMD EPYC of earlier rounds a switch of arms cost nothing
            # measurable after that (the first step of a try scored 0.002 +- 0.031 at batch 1
            # and -0.019 +- 0.024 at batch 16 in log ratio over the step after it, DSpark, 47
            # and 48 tries); on the Xeon of round 15 it did above batch 1 (TRY_STEPS).
            arm.warm = True
            return
        self._unfaded += 1  # every arm fades by _KEEP: applied when next read (_settle)
        if i == self.at:
            # A short average (over BASE_ROUNDS request-rounds and BASE_STEPS steps at
            # least): the machine's speed now.
            seconds = math.log(relative_seconds)
            if self._base_steps:  # how far one step's time strays from the recent average
                miss = min(max(seconds - self._seconds, -CLIP), CLIP)
                self._misses += 1  # a plain mean at first, then an average at NULL_RATE
                self._null += max(NULL_RATE, 1 / self._misses) * (miss * miss - self._null)
            self._base_rounds = min(self._base_rounds + rounds, BASE_ROUNDS)
            self._base_steps = min(self._base_steps + 1, BASE_STEPS)
            w = min(rounds / self._base_rounds, 1 / self._base_steps)
            self._seconds = seconds if self._base_steps == 1 else \
                (1 - w) * self._seconds + w * seconds
            self.base = speed if math.isnan(self.base) else \
                math.exp((1 - w) * math.log(self.base) + w * math.log(speed))
        elif not math.isnan(self.base) and i in self.near[self.at]:
            self._settle()
            self._quiet_until = 0  # a surprise below may bring a due forward
            ratio = min(max(math.log(speed / self.base), -CLIP), CLIP)
            tokens = math.log(committed / rounds)
            if arm.judgeable and abs(ratio - tokens - (arm.total - arm.tokens) / arm.rounds) \
                    > SURPRISE * arm.scatter(self._floor):  # (their times: tokens re-scored)
                # Far outside its record: the machine, the batch or the prompts changed.
                # Its old tries count less, and it is measured again soon.
                arm.fade(SURPRISE_KEEP)
                arm.wait = EXPLORE_EVERY
                arm.due = min(arm.due, self.steps + EXPLORE_EVERY)
            arm.observe(rounds, ratio, tokens)
            self._judge(i)

    def _judge(self, i: int) -> None:
        there = self.arms[i]
        if not there.judgeable:
            return
        gap, noise = self._evidence(i)
        if i == PLAIN and gap > -math.log(1 + MARGIN) / 2 and noise < math.log(1 + TIE) \
                and gap - noise > -math.log(1 + ENTER):
            # Plain decoding takes a tie: it costs the least CPU and its speed rests on no
            # estimate, so a drafting arm stays only while it beats plain by the margin (at
            # T=1 the cost model's arms, which draft little, drifted in on ties at 0.99x).
            # A tie within Z standard errors of the bar for entering the arm from plain
            # decoding (ENTER): judged after every plain try, a tie read at the estimate
            # alone came, by chance, to an arm that ran 1.07-1.10x plain decoding (DFlash's
            # cap 2 at batch 16, greedy: plain's tries read 1.01x it after 13), and the
            # climb back from plain needs ENTER (round 44's traces).
            self._move(i)
            return
        if -noise < gap < noise and noise > math.log(1 + MARGIN):
            # Not resolved yet: measure it more, but less often while it looks like a tie or
            # after many tries (a difference this hard to see is worth little).
            if abs(gap) < math.log(1 + MARGIN) or there.count >= PATIENCE:
                self._wait(there, min(2 * there.wait, EXPLORE_MAX if i != PLAIN else UNRESOLVED))
            return
        if i == self._ahead:
            self._ahead = None
        if gap > math.log(1 + (ENTER if self.at == PLAIN else MARGIN)):
            self._move(i)
        else:
            # Not faster: tried less often, and far less often when clearly slower (its
            # tries cost most). A tie within the margin costs little either way, and the
            # current arm keeps it (plain decoding keeps a drafter never accepted).
            grow = 4 if gap + noise < math.log(1 - CLEAR) else 2
            self._wait(there, min(grow * there.wait, EXPLORE_MAX))

    def _wait(self, arm: Arm, wait: int) -> None:
        """Arm, judged, waits `wait` steps before its next try, from now: its due was set
        from its old wait when the try began (pick), and a loser given a longer wait was
        tried again after its old one (every drafting arm at 0.8x plain decoding: given 64
        steps, tried 24 steps later)."""
        arm.wait = wait
        arm.due = max(arm.due, self._due(wait))

    def _evidence(self, j: int) -> tuple[float, float]:
        """Arm j's log speed ratio over the current arm (_gap) and Z standard errors of it:
        what _judge weighs, and what the report shows."""
        return self._gap(j), Z * self.arms[j].log_error(self._floor)

    def _gap(self, j: int) -> float:
        """Arm j's log speed ratio over the current arm, its tries' tokens re-scored.

        A try's ratio holds the tokens its rounds committed as scored then (round_score: at
        the rates its arm had measured by then, from few rounds while it is young), and all
        the tries of that time share that estimate's error, which their scatter does not
        show. Here every try's tokens are re-scored at all the rounds its arm has played
        (self.expect). With a drafter that commits 1.5 tokens a round for 1.6 plain steps
        and was scored at 2 on its first rounds, the ladder no longer leaves plain decoding
        (tests/policy/test_ladder.py). With one that pays 1.24-1.31x at caps 2-4
        (scripts/sim_ladder.py --drafter sampled --machine shared --steps 28000) the ladder
        ran at 0.965 of the best cap's speed (0.988 over the last 1000 steps), 0.930 before
        round 31 (with MeasuredRates' aging and PLAIN_TRY_STEPS). Counting the estimate's
        error in the standard error as well made the ladder keep the first drafting arm it
        reached (scratch). The cost model's arms keep their tries' own scores (the policy's
        expect gives None: VerifyPolicy._expected)."""
        arm = self.arms[j]
        log_tokens = self.expect(j) if self.expect is not None and arm.rounds else None
        if log_tokens is None:
            return arm.log_ratio
        return arm.log_ratio + log_tokens - arm.tokens / arm.rounds

    def _rescore(self, j: int, gap: float) -> None:
        """Arm j's tries now read `gap` (re-scored: _gap) as they stand."""
        arm = self.arms[j]
        log_tokens = self.expect(j) if self.expect is not None and arm.rounds else None
        if log_tokens is None:
            arm.shift(gap - arm.log_ratio)
        else:
            arm.tokens = arm.total + arm.rounds * (log_tokens - gap)

    def _settle(self) -> None:
        """Apply the fades of the steps since the arms were last read (one multiply per
        arm, not one per arm and step: the current arm's steps read no arm)."""
        if self._unfaded:
            keep = _KEEP ** self._unfaded
            for arm in self.arms:
                arm.fade(keep)
            self._unfaded = 0

    def _move(self, i: int) -> None:
        self._settle()
        self._quiet_until = 0
        self._trying = None
        came_from, there = self.arms[self.at], self.arms[i]
        gap = self._gap(i)
        if logger.isEnabledFor(logging.DEBUG):  # --log-level DEBUG: how a ladder got where
            # it ended (the summary shows where; a drift is seen only here)
            noise = Z * there.log_error(self._floor)
            why = (f"{math.exp(gap):.3f}x (band {math.exp(gap - noise):.3f}-"
                   f"{math.exp(gap + noise):.3f}) over {there.count} tries" if there.count
                   else "untried (start_at)")
            logger.debug(f"verify ladder {self.name}: {came_from} -> {there} at step "
                         f"{self.steps}, {why}")
        # From a fixed arm to a cost-model arm: the model's tries read its choices in the
        # state the fixed arm keeps (every request's acceptance freshly counted, a plain
        # step priced between drafting ones), which its own play does not keep. DFlash's
        # (3, model) at batch 16, greedy scored 1.16-1.19x over cap 3 in its tries and
        # drafted in 49-80% of a repeat once current; cap 3, with the mirror of those tries,
        # waited as a clear loser for 1000-2800 steps (round 44's move logs). So the arm
        # left is measured afresh from the model's, and the others are not re-based by its
        # tries' gap (they count less, as after any move).
        biased = there.model and not came_from.model and came_from.cap > 0
        for j, arm in enumerate(self.arms):  # ratios re-based on the new arm: estimates
            if j not in (i, self.at):  # through the winner's, so the next try counts more
                if not biased:
                    arm.shift(-gap)
                arm.fade(SURPRISE_KEEP)
        if self.at == PLAIN or biased:
            # Left plain decoding: plain decoding is measured afresh from the new arm, not
            # credited with the mirror of the tries that won. Those tries were biased the
            # one way: a drafting step after plain ones drafts from fresh positions, where
            # a settled drafting arm starts every round where the last one failed, and at a
            # synchronised start the tries all come from the same requests' same stretch
            # of text. At batch 64 greedy DFlash's cap 2 committed 2.47 tokens a round in
            # its three tries from plain decoding (scored 1.18x), 2.09 once settled, and
            # ran 0.95x plain decoding. A try of plain decoding commits one token a round
            # whatever came before, so plain's tries from the new arm are the fair test.
            # (From a fixed arm to a model arm: see above.)
            came_from.forget()
            came_from.wait, came_from.due = EXPLORE_EVERY, 0  # young: due at once
        else:
            came_from.mirror(there)
            self._rescore(self.at, -gap)
        there.forget()
        self.path = [*self.path, (self.steps, there.cap, there.model)][-PATH_KEPT:]
        self.base *= math.exp(gap)
        self._base_rounds, self._base_steps = 0.0, 0
        self._settled = 0.0  # the budget's full rate again (SETTLE)
        self.at = i
        for j in self.near[i]:  # the new neighbours are tried sooner (their ratios to the
            # new arm are re-based estimates, not measured) ...
            arm = self.arms[j]
            arm.wait = max(EXPLORE_EVERY, arm.wait // 4)
            arm.due = min(arm.due, self.steps + arm.wait)
        # ... and first, at once, the next cap further in the direction of this move
        further = [j for j in self.near[i] if self.arms[j].model == there.model and
                   self.arms[j].cap and (self.arms[j].cap - there.cap) *
                   (there.cap - came_from.cap) > 0]
        self._ahead = min(further, key=lambda j: abs(self.arms[j].cap - there.cap),
                          default=None)

    @property
    def current(self) -> Arm:
        return self.arms[self.at]

    def quiet(self, horizon: int) -> bool:
        """Plain decoding is the current arm and no neighbour is due to be tried (nor let in
        by the budget) in the next pick or the `horizon` after it: nothing will draft for a
        while (picks count self.steps up by one; a neighbour never tried is due at once)."""
        if self.current.cap or self._trying is not None or not self.near[self.at]:
            return False
        if self.steps + 1 + horizon < self._quiet_until:
            return True
        # steps (of about one yardstick step each) until the budget lets a try in again:
        # a climb's next cap waits for it too, and a ladder awake meanwhile would pay its
        # context writes for nothing (BUDGET). Counted from this ladder's earning alone: the
        # other ladders sharing the allowance only spend it (or, where a try wins, refill it
        # a little sooner).
        room = self._room()
        held = max(0.0, (REFILL if self._refilling or room < 0 else 0.0) - room) / self.rate
        if held > 1 + horizon:
            return True
        if self._ahead is not None:
            return False
        due = min(self.arms[j].due for j in self.near[self.at])
        if due <= self.steps + 1 + horizon:
            return False
        # Before the first due every pick returns the current arm (whatever the budget), and
        # nothing moves a due meanwhile but a try's outcome (observe) or a move.
        self._quiet_until = due
        return True

    def to_dict(self) -> dict:
        """The current arm, and each neighbour's measured speed over it: its ratio, the
        tries behind it and the band of Z standard errors around it that _judge weighs. A
        ratio from a few tries says little: at batch 16, T=1, round 37's report read
        DSpark's (4, model) arm at 1.11x plain decoding, its ladder having tried anything
        28 times in 7,394 steps; pinned to that arm, DSpark ran no faster than plain
        decoding (round 38, scripts/bench_plain_cost.py --caps 4m)."""
        self._settle()
        return {"current": {"cap": self.current.cap, "model": self.current.model},
                "steps": self.steps, "tries": self.tries,
                "neighbours": [self._reading(j) for j in self.near[self.at]],
                "path": [{"step": n, "cap": c, "model": m} for n, c, m in self.path]}

    def _reading(self, j: int) -> dict:
        """Arm j's entry in to_dict()."""
        arm = self.arms[j]
        out = {"cap": arm.cap, "model": arm.model, "rounds": round(arm.rounds, 1),
               "tries": arm.count, "ratio": None, "band": None}
        if arm.rounds:
            gap, noise = self._evidence(j)
            out["ratio"] = round(math.exp(gap), 4)
            if math.isfinite(noise):
                out["band"] = [round(math.exp(gap - noise), 4), round(math.exp(gap + noise), 4)]
        return out
