"""Cache-aware attn_dp placement: the group caching the longest prefix, unless overloaded."""

from __future__ import annotations

from dspark_launch.engine.placement import BLOCK, CacheAwarePlacer


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


def test_follows_the_longest_cached_prefix() -> None:
    placer = CacheAwarePlacer(groups=3, capacity_tokens=10_000)
    a, b = prompt(1, 5 * BLOCK), prompt(2, 5 * BLOCK)
    load = [0, 0, 0]
    assert placer.place(a, load, 100) == 0  # nothing cached anywhere: the least loaded
    load = [100, 0, 0]
    assert placer.place(b, load, 100) == 1
    load = [100, 100, 0]
    # a's first 3 blocks + something new: group 0 holds 3 blocks of it, despite its load.
    assert placer.place(a[:3 * BLOCK] + prompt(3, BLOCK), load, 100) == 0
    assert placer.matched_tokens(0, placer._chain(a)) == 5 * BLOCK
    # A prompt shorter than a block matches nothing: the least-loaded group.
    assert placer.place(a[:BLOCK - 1], [200, 100, 0], 100) == 2


def test_overloaded_group_is_skipped_and_then_caches_too() -> None:
    placer = CacheAwarePlacer(groups=2, capacity_tokens=10_000)
    shared = prompt(5, 8 * BLOCK)
    load = [0, 0]
    picks = []
    for i in range(6):
        g = placer.place(shared + prompt(100 + i, BLOCK), load, 50)
        load[g] += 50
        picks.append(g)
    # Group 0 takes requests until it is past 1.5x the other's load plus one request; then
    # group 1, which then holds the prefix too, so ties go to the less loaded group.
    assert picks[:2] == [0, 0] and 1 in picks and abs(load[0] - load[1]) <= 100


def test_the_index_forgets_beyond_the_pool_capacity() -> None:
    placer = CacheAwarePlacer(groups=2, capacity_tokens=4 * BLOCK)
    old, new = prompt(7, 4 * BLOCK), prompt(8, 4 * BLOCK)
    placer.place(old, [0, 0], 10)
    placer.place(new, [0, 100], 10)  # group 0 again (least loaded): old is pushed out
    assert placer.matched_tokens(0, placer._chain(new)) == 4 * BLOCK
    assert placer.matched_tokens(0, placer._chain(old)) == 0


def test_same_choices_in_another_process() -> None:
    """Placement runs on every rank: the hash chain must not depend on the process."""
    import subprocess
    import sys
    from pathlib import Path

    import dspark_launch

    root = str(Path(dspark_launch.__file__).resolve().parents[1])

    code = ("from dspark_launch.engine.placement import CacheAwarePlacer as C;"
            "print(C._chain(list(range(40))))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": seed, "PATH": "",
                                            "PYTHONPATH": root}).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1 and str(CacheAwarePlacer._chain(list(range(40)))) in outs.pop()
