"""Parallel state on real gloo worlds: widths, ranks, groups, and the attn_tp all-reduce."""

from __future__ import annotations

import pytest
import torch
from multirank import run_world

from dspark_launch.args import resolve_config
from dspark_launch.comm import attn_tp_all_reduce, tp_all_reduce
from dspark_launch.errors import ConfigError
from dspark_launch.parallel import (
    get_parallel,
    init_parallel_runtime,
    override_parallel,
    topology,
)

LAYOUTS = [(tp, dp) for tp in (1, 2, 4, 8) for dp in (1, 2, 4, 8) if tp % dp == 0]


def _stamp_and_report(rank: int, tp: int, attn_dp: int) -> dict:
    state = init_parallel_runtime(resolve_config(["--attn-dp-size", str(attn_dp)], world_size=tp))
    assert get_parallel() is state
    return {
        "fields": (state.world_size, state.tp_size, state.tp_rank, state.attn_tp_size,
                   state.attn_tp_rank, state.attn_dp_size, state.attn_dp_rank),
        "attn_tp_ranks": state.attn_tp_ranks,
        # Each rank contributes 1 << rank: the sum names exactly the ranks in the group.
        "attn_tp_mask": int(attn_tp_all_reduce(torch.tensor([1 << rank])).item()),
        "tp_mask": int(tp_all_reduce(torch.tensor([1 << rank])).item()),
    }


@pytest.mark.parametrize("tp,attn_dp", LAYOUTS, ids=[f"tp{t}-dp{d}" for t, d in LAYOUTS])
def test_stamped_layout_and_groups(tp: int, attn_dp: int) -> None:
    reports = run_world(tp, _stamp_and_report, tp, attn_dp)
    attn_tp = tp // attn_dp
    for rank, got in enumerate(reports):
        dp_rank, tp_in_group = divmod(rank, attn_tp)
        assert got["fields"] == (tp, tp, rank, attn_tp, tp_in_group, attn_dp, dp_rank)
        members = list(range(dp_rank * attn_tp, (dp_rank + 1) * attn_tp))
        assert list(got["attn_tp_ranks"]) == members
        assert got["attn_tp_mask"] == sum(1 << r for r in members)
        assert got["tp_mask"] == (1 << tp) - 1


def test_reading_before_stamping_raises() -> None:
    with pytest.raises(RuntimeError, match="before it was stamped"):
        get_parallel()


def test_override_publishes_validates_and_restores() -> None:
    with override_parallel(16, 16, tp_rank=5) as state:
        assert get_parallel() is state
        assert (state.attn_tp_size, state.attn_tp_rank, state.attn_dp_rank) == (1, 0, 5)
        with override_parallel(16, 4, tp_rank=13) as inner:
            assert get_parallel().attn_tp_size == 4 and inner.attn_dp_rank == 3
        assert get_parallel() is state
    with pytest.raises(RuntimeError):
        get_parallel()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tp_size": 8, "attn_dp_size": 3}, "tp_size=8 is not divisible by attn_dp_size=3"),
        ({"tp_size": 4, "attn_dp_size": 2, "tp_rank": 4}, "tp_rank=4 is outside [0, tp_size=4)"),
        ({"tp_size": 0}, "tp_size=0 must be >= 1"),
    ],
)
def test_override_refuses_bad_layouts(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err, override_parallel(**kwargs):
        pass
    assert message in str(err.value)
    with pytest.raises(RuntimeError):
        get_parallel()


def test_topology_rank_layout_equation() -> None:
    for tp, dp in [(16, 16), (16, 4), (8, 2), (8, 1)]:
        for r in range(tp):
            s = topology(tp, dp, r)
            assert s.tp_rank == s.attn_dp_rank * s.attn_tp_size + s.attn_tp_rank
            assert s.attn_tp_size * s.attn_dp_size == s.tp_size


def test_rank_failure_is_reported_with_rank_and_traceback() -> None:
    from multirank import RankError

    def boom(rank: int) -> None:
        if rank == 2:
            raise ValueError("rank two exploded")

    with pytest.raises(RankError, match=r"rank 2 of 4 failed:(.|\n)*rank two exploded"):
        run_world(4, boom)
