"""The verify ladder alone, at batch 1, against a synthetic drafter: where it ends, and how fast.

    python scripts/sim_ladder.py [--drafter dspark|sampled|losing] [--machine uniform|shared]
        [--seeds 40] [--steps 3000] [--z 2.0] [--score measured]

Each step is one request-round: the arm's cap c verifies up to c drafts, accepted left to
right with the drafter's conditional rates, and the step takes its cost in plain steps times
the machine's factor. No engine, no timing of this process: the ladder sees only these
numbers, so a run is reproducible and shows what one-round tries can resolve.
- Drafters: "dspark" (DSpark-like, greedy: a round commits 1-9 tokens, the deep caps pay most;
  a step of cap c costs 1.45 + 0.05 c), "sampled" (DSpark-like at T=1: caps 2-4 pay
  1.24-1.31x, the deepest less) and "losing" (DFlash at T=1 on the Xeon of round 31: the first
  draft accepted ~60% of the time, the next rarely; every cap runs 0.75-0.95x plain decoding).
- Machines: "uniform" (+-10% a step) and "shared" (+-10% log-normal, a slow drift of the
  machine's speed, a 1.3-2x stall in 1% of steps, and a plain step right after drafting ones
  7% slower: scripts/bench_switch.py, batch 1, T=1).
Prints the true speed of every cap over the best one, how many seeds end at each cap, the
speed the ladder achieved (over its last 1000 steps and over the whole run) as a share of the
best cap's, and the share of steps that drafted.
--z overrides the ladder's Z (standard errors a judged neighbour must clear). --score chooses
what a step counts: "measured" (the engine's: spec/policy.py round_score, the tokens a round
commits on average at the conditional rates its arm measured, every try's tokens re-scored
at all its arm's rounds: spec/ladder.py Ladder._gap) or "committed" (the tokens the round
committed, the engine's rule before round 24: the mean of the logs of one round's scattered
tokens judged the deepest caps slowest).
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter

import dspark_launch.spec.ladder as ladder_module
from dspark_launch.spec.acceptance import MeasuredRates
from dspark_launch.spec.ladder import Ladder
from dspark_launch.spec.policy import MEASURED_AFTER, round_score

DRAFTERS = {  # P(draft i accepted | i - 1 were), and a step's cost in plain steps per cap
    "dspark": ((0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5),
               lambda cap: 1.0 if cap == 0 else 1.45 + 0.05 * cap),
    "sampled": ((0.75, 0.6, 0.5, 0.45, 0.4, 0.4, 0.35, 0.3),
                {0: 1.0, 1: 1.7, 2: 1.78, 3: 1.85, 4: 1.95, 7: 2.25, 8: 2.3}.__getitem__),
    "losing": ((0.6, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05),
               {0: 1.0, 1: 1.69, 2: 1.75, 3: 1.85, 4: 1.95, 7: 2.21}.__getitem__),
}


def tokens(accept, cap: int, rng: random.Random) -> int:
    n = 1
    for rate in accept[:cap]:
        if rng.random() >= rate:
            break
        n += 1
    return n


class Machine:
    """A step's time factor: "uniform" +-10%, or "shared" (see the module docstring)."""

    def __init__(self, kind: str, rng: random.Random) -> None:
        self.kind, self.rng, self.mood = kind, rng, 0.0

    def factor(self, cap: int, previous: int) -> float:
        rng = self.rng
        if self.kind == "uniform":
            return rng.uniform(0.9, 1.1)
        self.mood = self.mood * (1 - 1 / 500) + rng.gauss(0, 0.008)
        factor = math.exp(self.mood + rng.gauss(0, 0.1))
        if rng.random() < 0.01:
            factor *= rng.uniform(1.3, 2.0)
        return factor * (1.07 if previous and not cap else 1.0)


def run(drafter: str, machine: str, seed: int, steps: int, score: str
        ) -> tuple[int, list[int]]:
    accept, cost = DRAFTERS[drafter]
    rng = random.Random(seed)
    ladder = Ladder(len(accept))
    measured = MeasuredRates(len(accept))
    if score == "measured":  # as VerifyPolicy._expected tells the engine's ladders
        ladder.expect = lambda j: 0.0 if not ladder.arms[j].cap else \
            None if ladder.arms[j].model else measured.expectation(j)
    clock = Machine(machine, rng)
    played, previous = [], 0
    for _ in range(steps):
        i = ladder.pick()
        cap = ladder.arms[i].cap
        n = tokens(accept, cap, rng)
        rates = measured.rates(i, MEASURED_AFTER)  # this arm's, from earlier steps
        counted = round_score(rates, cap, n - 1) if score == "measured" else float(n)
        if cap:
            measured.observe(i, cap, n - 1)
            measured.tick()  # the engine ages an arm's counts with its drafting steps
        ladder.observe(i, 1, counted, cost(cap) * clock.factor(cap, previous))
        played.append(cap)
        previous = cap
    return ladder.current.cap, played


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=sorted(DRAFTERS), default="dspark")
    ap.add_argument("--machine", choices=("uniform", "shared"), default="uniform")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--z", type=float, default=None)
    ap.add_argument("--score", choices=("measured", "committed"), default="measured")
    args = ap.parse_args()
    if args.z is not None:
        ladder_module.Z = args.z
    accept, cost = DRAFTERS[args.drafter]
    caps = Ladder.caps(len(accept))
    speed = {c: round_score(accept, c, 0) / cost(c) for c in caps}  # every rate known
    best = max(speed.values())
    print("true speed / best:", {c: round(s / best, 3) for c, s in speed.items()})
    ends: Counter[int] = Counter()
    late, whole, drafted = [], [], []
    for seed in range(args.seeds):
        cap, played = run(args.drafter, args.machine, seed, args.steps, args.score)
        ends[cap] += 1
        tail = played[-1000:]
        late.append(sum(speed[c] for c in tail) / len(tail) / best)
        whole.append(sum(speed[c] for c in played) / len(played) / best)
        drafted.append(sum(1 for c in played if c) / len(played))
    print("seeds ending at each cap:", dict(sorted(ends.items())))
    print(f"achieved / best: last 1000 steps {sum(late) / len(late):.3f} (worst seed "
          f"{min(late):.3f}), whole run {sum(whole) / len(whole):.3f} (worst seed "
          f"{min(whole):.3f})")
    print(f"steps that drafted: {sum(drafted) / len(drafted):.3f} (most in a seed "
          f"{max(drafted):.3f})")


if __name__ == "__main__":
    main()
