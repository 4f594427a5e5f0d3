"""The engine's collectives (dspark_launch/comm.py) on real gloo worlds: recursive doubling on
power-of-two groups, gloo's own ring elsewhere and for large tensors. Oracles: the sum in fp64
of every rank's tensor (each rank regenerates them all from their seeds), the tensors and
objects themselves for the gathers, and bitwise agreement of every rank of a group."""

from __future__ import annotations

import pytest
import torch
from multirank import run_world

from dspark_launch import comm
from dspark_launch.args import resolve_config
from dspark_launch.parallel import get_parallel, init_parallel_runtime


def _tensor(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.int64:
        return torch.randint(-2**40, 2**40, shape, generator=g)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * (rank + 1)).to(dtype)


def _collectives(rank: int, world: int, attn_dp: int) -> dict:
    init_parallel_runtime(resolve_config(["--attn-dp-size", str(attn_dp)], world_size=world))
    state = get_parallel()
    out: dict = {}
    for name, group, members in [("tp", state.tp_group, list(range(world))),
                                 ("attn_tp", state.attn_tp_group, list(state.attn_tp_ranks))]:
        for dtype, shape in [(torch.float32, (3, 256)), (torch.bfloat16, (5, 64)),
                             (torch.int64, (7,)),
                             # past DOUBLING_MAX_BYTES: gloo's ring
                             (torch.float32, (comm.DOUBLING_MAX_BYTES // 4 + 1,))]:
            mine = _tensor(rank, shape, dtype)
            total = comm.all_reduce(mine.clone(), group)
            exact = sum(_tensor(r, shape, dtype).double() for r in members)
            out[name, str(dtype), shape] = {
                "bits": total.view(torch.int16 if dtype == torch.bfloat16 else torch.uint8)
                .numpy().tobytes(),
                "err": float((total.double() - exact).abs().max()),
                "scale": float(exact.abs().max()),
            }
        parts = comm.all_gather(_tensor(rank, (2, 3), torch.float32), group)
        out[name, "gather"] = all(torch.equal(p, _tensor(r, (2, 3), torch.float32))
                                  for p, r in zip(parts, members, strict=True))
    # A view on some ranks and a contiguous tensor on others: the same path everywhere (a
    # choice by memory layout would leave ranks waiting on each other), summed in place.
    base = _tensor(rank, (4, 6), torch.float32).t()  # [6, 4], not contiguous
    view = base if rank % 2 == 0 else base.contiguous()
    comm.all_reduce(view, state.tp_group)
    exact = sum(_tensor(r, (4, 6), torch.float32).double().t() for r in range(world))
    out["view_err"] = float((view.double() - exact).abs().max() / exact.abs().max())
    # Objects of different sizes (the step's outputs: rank 0 often has more to say).
    out["objects"] = comm.all_gather_object({"rank": rank, "payload": "x" * (rank * 37)})
    return out


@pytest.mark.parametrize("world,attn_dp", [(2, 1), (3, 1), (4, 2), (8, 2), (8, 8)],
                         ids=lambda v: str(v))
def test_collectives_sum_gather_and_agree_bitwise(world: int, attn_dp: int) -> None:
    results = run_world(world, _collectives, world, attn_dp)
    attn_tp = world // attn_dp
    for rank, got in enumerate(results):
        group_leader = rank // attn_tp * attn_tp
        for key, value in got.items():
            if key == "view_err":
                assert value <= 1e-6, (rank, value)
            elif key == "objects":
                assert value == [{"rank": r, "payload": "x" * (r * 37)} for r in range(world)]
            elif key[1] == "gather":
                assert value, (rank, key)
            else:
                # Every rank of the group holds the same bits (the engine's ranks must agree).
                leader = results[0 if key[0] == "tp" else group_leader][key]
                assert value["bits"] == leader["bits"], (rank, key)
                dtype = key[1]
                tol = {"torch.int64": 0.0, "torch.float32": 1e-6, "torch.bfloat16": 2e-2}[dtype]
                assert value["err"] <= tol * max(value["scale"], 1.0), (rank, key, value["err"])


def _doubling_applies(rank: int, world: int) -> bool:
    init_parallel_runtime(resolve_config([], world_size=world))
    return comm._doubling(torch.zeros(4), get_parallel().tp_group) is not None


@pytest.mark.parametrize("world,expected", [(2, True), (3, False), (4, True)])
def test_recursive_doubling_only_on_power_of_two_gloo_groups(world: int, expected: bool) -> None:
    assert run_world(world, _doubling_applies, world) == [expected] * world
