"""The verify ladder alone, at batch 1, against a synthetic drafter: where it ends, and how fast.

    python scripts/sim_ladder.py [--seeds 40] [--steps 3000] [--z 2.0] [--score measured]

Each step is one request-round: the arm's cap c verifies up to c drafts, accepted left to
right with the conditional rates ACCEPT (DSpark-like), so a round commits 1-9 tokens; the step
takes COST(c) plain steps (a verify block and a draft forward: 1.45 + 0.05 c) times a uniform
+-10% (the machine). No engine, no timing of this process: the ladder sees only these numbers,
so a run is reproducible and shows what one-round tries can resolve. Prints the true speed of
every cap over the best one, how many seeds end at each cap, and the speed the ladder achieved
(over its last 1000 steps and over the whole run) as a share of the best cap's.
--z overrides the ladder's Z (standard errors a judged neighbour must clear). --score chooses
what a step counts: "measured" (the engine's: spec/policy.py round_score, the tokens a round
commits on average at the conditional rates its arm measured, spec/acceptance.py
MeasuredRates) or "committed" (the tokens the round committed, the engine's rule
before: the mean of the logs of one round's scattered tokens judged the deepest caps slowest).
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

import dspark_launch.spec.ladder as ladder_module
from dspark_launch.spec.acceptance import MeasuredRates
from dspark_launch.spec.ladder import Ladder
from dspark_launch.spec.policy import MEASURED_AFTER, round_score

ACCEPT = (0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)  # P(draft i accepted | i - 1 were)


def cost(cap: int) -> float:
    return 1.0 if cap == 0 else 1.45 + 0.05 * cap


def tokens(cap: int, rng: random.Random) -> int:
    n = 1
    for rate in ACCEPT[:cap]:
        if rng.random() >= rate:
            break
        n += 1
    return n


def speed(cap: int) -> float:
    """Expected committed tokens per plain step's time."""
    return round_score(ACCEPT, cap, 0) / cost(cap)  # every rate known: the expectation


def run(seed: int, steps: int, score: str) -> tuple[int, list[float]]:
    rng = random.Random(seed)
    ladder = Ladder(len(ACCEPT))
    measured = MeasuredRates(len(ACCEPT))
    got = []
    for _ in range(steps):
        i = ladder.pick()
        cap = ladder.arms[i].cap
        n = tokens(cap, rng)
        rates = measured.rates(i, MEASURED_AFTER)  # this arm's, from earlier steps
        counted = round_score(rates, cap, n - 1) if score == "measured" else float(n)
        measured.observe(i, cap, n - 1)
        if cap:
            measured.tick()  # the engine ages counts with drafting steps
        ladder.observe(i, 1, counted, cost(cap) * rng.uniform(0.9, 1.1))
        got.append(speed(cap))
    return ladder.current.cap, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--z", type=float, default=None)
    ap.add_argument("--score", choices=("measured", "committed"), default="measured")
    args = ap.parse_args()
    if args.z is not None:
        ladder_module.Z = args.z
    caps = Ladder.caps(len(ACCEPT))
    best = max(speed(c) for c in caps)
    print("true speed / best:", {c: round(speed(c) / best, 3) for c in caps})
    ends: Counter[int] = Counter()
    late, whole = [], []
    for seed in range(args.seeds):
        cap, got = run(seed, args.steps, args.score)
        ends[cap] += 1
        late.append(sum(got[-1000:]) / len(got[-1000:]) / best)
        whole.append(sum(got) / len(got) / best)
    print("seeds ending at each cap:", dict(sorted(ends.items())))
    print(f"achieved / best: last 1000 steps {sum(late) / len(late):.3f} (worst seed "
          f"{min(late):.3f}), whole run {sum(whole) / len(whole):.3f}")


if __name__ == "__main__":
    main()
