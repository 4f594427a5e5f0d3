"""The verify ladder alone, at batch 1, against a synthetic drafter: where it ends, and how fast.

    python scripts/sim_ladder.py [--seeds 40] [--steps 3000] [--z 2.0] [--expected]

Each step is one request-round: the arm's cap c verifies up to c drafts, accepted left to
right with the conditional rates ACCEPT (DSpark-like), so a round commits 1-9 tokens; the step
takes COST(c) plain steps (a verify block and a draft forward: 1.45 + 0.05 c) times a uniform
+-10% (the machine). No engine, no timing of this process: the ladder sees only these numbers,
so a run is reproducible and shows what one-round tries can resolve. Prints the true speed of
every cap over the best one, how many seeds end at each cap, and the speed the ladder achieved
(over its last 1000 steps and over the whole run) as a share of the best cap's.
--z overrides the ladder's Z (standard errors a judged neighbour must clear). --expected scores
each step by the tokens its round is expected to commit, from per-position acceptance pooled
over every round so far (a Beta(1, 1) prior per position), instead of the tokens it committed.
Here every cap accepts with the same per-position rates; in the engine they are not pooled so
simply (a shorter block drafts differently, and positions past the current cap are seen only in
tries), and that scoring moved DSpark at batch 16 to a deeper, slower cap (README, Benchmarks).
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

import dspark_launch.spec.ladder as ladder_module
from dspark_launch.spec.ladder import Ladder

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


def expected_tokens(rates, cap: int) -> float:
    """1 + the drafts a round verifying `cap` accepts on average, at these conditional rates."""
    tau, alive = 1.0, 1.0
    for rate in rates[:cap]:
        alive *= rate
        tau += alive
    return tau


def speed(cap: int) -> float:
    """Expected committed tokens per plain step's time."""
    return expected_tokens(ACCEPT, cap) / cost(cap)


def run(seed: int, steps: int, expected: bool) -> tuple[int, list[float]]:
    rng = random.Random(seed)
    ladder = Ladder(len(ACCEPT))
    accepted, reached = [1.0] * len(ACCEPT), [2.0] * len(ACCEPT)  # Beta(1, 1) per position
    got = []
    for _ in range(steps):
        i = ladder.pick()
        cap = ladder.arms[i].cap
        n = tokens(cap, rng)
        for pos in range(min(n, cap)):  # the accepted drafts, then the first rejected one
            reached[pos] += 1
            accepted[pos] += pos < n - 1
        score = (expected_tokens([a / r for a, r in zip(accepted, reached)], cap) if expected
                 else float(n))
        ladder.observe(i, 1, score, cost(cap) * rng.uniform(0.9, 1.1))
        got.append(speed(cap))
    return ladder.current.cap, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--z", type=float, default=None)
    ap.add_argument("--expected", action="store_true")
    args = ap.parse_args()
    if args.z is not None:
        ladder_module.Z = args.z
    caps = Ladder.caps(len(ACCEPT))
    best = max(speed(c) for c in caps)
    print("true speed / best:", {c: round(speed(c) / best, 3) for c in caps})
    ends: Counter[int] = Counter()
    late, whole = [], []
    for seed in range(args.seeds):
        cap, got = run(seed, args.steps, args.expected)
        ends[cap] += 1
        late.append(sum(got[-1000:]) / len(got[-1000:]) / best)
        whole.append(sum(got) / len(got) / best)
    print("seeds ending at each cap:", dict(sorted(ends.items())))
    print(f"achieved / best: last 1000 steps {sum(late) / len(late):.3f} (worst seed "
          f"{min(late):.3f}), whole run {sum(whole) / len(whole):.3f}")


if __name__ == "__main__":
    main()
