"""The verify ladder (spec/ladder.py) against a synthetic machine whose speed-up per arm is
known in closed form (plus step-to-step noise): it climbs to the arm a brute-force search over
all arms picks, stays with plain decoding when no arm pays (trying the others less and less
often), and follows the machine when the best arm moves."""

from __future__ import annotations

import random
from collections import Counter

from dspark_launch.spec.ladder import MARGIN, PLAIN, Ladder

ROUNDS = 16  # requests per step
# An arm within the margin of the best is kept (MARGIN), and neighbours are still tried
TOLERANCE = 1 - MARGIN - 0.01


def peaked(best: int, model_share: float = 0.9):
    """Speed-up unimodal in the cap, highest at `best` drafts; the model's arms slower."""
    def speedup(cap: int, model: bool) -> float:
        s = 1.0 + 0.2 * cap - 0.1 * cap * cap / best if cap else 1.0
        return s * (model_share if model and cap else 1.0)
    return speedup


def closed_loop(ladder: Ladder, speedup, steps: int, seed: int = 0) -> list[tuple[int, bool]]:
    """Each step: the ladder picks an arm; its requests commit speedup x ROUNDS tokens (+-10%
    noise) in one plain step's time. Returns the (cap, model) played per step."""
    rng = random.Random(seed)
    played = []
    for _ in range(steps):
        i = ladder.pick()
        arm = ladder.arms[i]
        ladder.observe(i, ROUNDS, ROUNDS * speedup(arm.cap, arm.model) * rng.uniform(0.9, 1.1),
                       1.0)
        played.append((arm.cap, arm.model))
    return played


def brute_force(ladder: Ladder, speedup) -> tuple[int, bool]:
    return max(((a.cap, a.model) for a in ladder.arms), key=lambda arm: speedup(*arm))


def test_climbs_to_the_arm_brute_force_picks():
    for best in (1, 3, 6):
        ladder = Ladder(8)
        speedup = peaked(best)
        played = closed_loop(ladder, speedup, 1500, seed=best)
        # The climb ends at the best arm or at one within the margin of it.
        assert speedup(ladder.current.cap, ladder.current.model) >= TOLERANCE * speedup(
            *brute_force(ladder, speedup))
        # Trying the neighbours costs little: those that keep losing are tried less and less
        # often, those within the margin are nearly as fast.
        late = played[-500:]
        assert achieved(late, speedup) >= TOLERANCE * speedup(*brute_force(ladder, speedup)), \
            Counter(late)


def test_stays_plain_when_no_arm_pays():
    ladder = Ladder(8)
    slower = lambda cap, model: 1.0 - 0.1 * cap  # noqa: E731
    played = closed_loop(ladder, slower, 2000)
    assert ladder.at == PLAIN
    # The others are still tried now and then (less and less often): a few steps in 100.
    assert achieved(played[-1000:], slower) >= 1 - 0.01


def test_follows_the_machine_when_the_best_arm_moves():
    ladder = Ladder(8)
    played = closed_loop(ladder, peaked(4), 1000)
    assert achieved(played[-300:], peaked(4)) >= TOLERANCE * peaked(4)(4, False)
    played = closed_loop(ladder, peaked(1), 1500, seed=1)
    assert (ladder.current.cap, ladder.current.model) == (1, False)
    assert achieved(played[-300:], peaked(1)) >= TOLERANCE * peaked(1)(1, False)


def achieved(played: list[tuple[int, bool]], speedup) -> float:
    return sum(speedup(*arm) for arm in played) / len(played)


def test_neighbours_are_two_caps_away_the_other_mode_or_plain():
    ladder = Ladder(8)
    arms = [(a.cap, a.model) for a in ladder.arms]
    assert arms[PLAIN] == (0, False)
    assert sorted(arms[j] for j in ladder.near[PLAIN]) == [(1, False), (1, True),
                                                                 (2, False), (2, True)]
    three = arms.index((3, False))
    assert sorted(arms[j] for j in ladder.near[three]) == [
        (0, False), (1, False), (2, False), (3, True), (4, False), (6, False)]
    top = arms.index((8, True))
    assert sorted(arms[j] for j in ladder.near[top]) == [(0, False), (4, True),
                                                               (6, True), (8, False)]


def test_falls_back_to_plain_from_anywhere():
    """Climbed high while speculation paid, then drafting stops paying at every cap (the
    batch grew): the ladder returns to plain decoding although the caps in between were
    never measured worse than it on the way."""
    ladder = Ladder(8)
    closed_loop(ladder, peaked(6), 1500)
    assert ladder.current.cap >= 4
    slower = lambda cap, model: 1.0 - 0.05 * cap  # noqa: E731
    played = closed_loop(ladder, slower, 5000, seed=2)
    assert ladder.at == PLAIN
    assert achieved(played[-1000:], slower) >= TOLERANCE
