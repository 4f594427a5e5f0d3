"""The few collectives the engine needs, each a no-op on a group of one."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dspark_launch.errors import ConfigError
from dspark_launch.parallel import get_parallel


def group_size(group: dist.ProcessGroup | None) -> int:
    # group.size(), not dist.get_world_size(group): this runs for every sharded layer and
    # the latter's default-group lookup cost ~27 us a call inside a step.
    return 1 if group is None else group.size()


# Gloo runs an all-reduce as a ring of 2(n-1) sequential hops and an all-gather as n-1, each
# handed to its worker thread; a decode step's tensors are tiny, so on a CPU world that latency
# is the step. Forked gloo ranks on 2 cores, a [16, 256] fp32 sum: 18.0 ms by dist.all_reduce
# against 2.2 ms by recursive doubling over send/recv at 8 ranks, 4.8 / 0.86 ms at 4, 0.80 /
# 0.21 ms at 2 (scripts/bench_collectives.py). Recursive doubling: log2(n) rounds, each an
# exchange with rank XOR 2^k. Every pair adds the same two tensors (IEEE addition commutes),
# so all ranks end bitwise equal, as the engine needs. The ring's bandwidth wins for large
# tensors: above this many bytes an all-reduce stays gloo's (an all-gather moves the same
# bytes either way).
DOUBLING_MAX_BYTES = 1 << 20


def _doubling(tensor: torch.Tensor, group: dist.ProcessGroup) -> tuple[int, list[int]] | None:
    """(this rank's index in `group`, the group's global ranks) where recursive doubling
    applies: a CPU tensor on a gloo group of a power-of-two size; else None. Decided from what
    every rank of the group shares, never from one rank's memory layout (ranks that chose
    differently would wait on each other forever). ~2 us a call, not cached: a cache would
    keep destroyed groups (and their sockets) alive."""
    n = group.size()
    if tensor.device.type != "cpu" or n & (n - 1) or dist.get_backend(group) != "gloo":
        return None
    return group.rank(), dist.get_process_group_ranks(group)


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int,
              group: dist.ProcessGroup) -> None:
    """Send `send` to global rank `peer` while receiving its tensor into `recv`."""
    request = dist.isend(send, peer, group=group)
    dist.recv(recv, peer, group=group)
    request.wait()


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum in place over `group` (tp or attn_tp); returns the tensor."""
    if group_size(group) == 1:
        return tensor
    # Both paths take contiguous memory (gloo's all-reduce summed a transposed view wrongly).
    total = tensor.contiguous()
    peers = _doubling(total, group)
    if peers is None or total.numel() * total.element_size() > DOUBLING_MAX_BYTES:
        dist.all_reduce(total, group=group)
    else:
        me, ranks = peers
        theirs = torch.empty_like(total)
        k = 1
        while k < len(ranks):
            _exchange(total, theirs, ranks[me ^ k], group)
            total.add_(theirs)
            k *= 2
    if total is not tensor:
        tensor.copy_(total)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Gather equally shaped tensors from every rank of `group`, in group-rank order."""
    n = group_size(group)
    if n == 1:
        return [tensor]
    tensor = tensor.contiguous()
    peers = _doubling(tensor, group)
    if peers is None:
        parts = [torch.empty_like(tensor) for _ in range(n)]
        dist.all_gather(parts, tensor, group=group)
        return parts
    me, ranks = peers
    out = torch.empty((n, *tensor.shape), dtype=tensor.dtype)  # [n, ...]
    out[me] = tensor
    k = 1
    while k < n:  # before round k each rank holds the k parts of its aligned block
        mine, theirs = me & ~(k - 1), (me ^ k) & ~(k - 1)
        _exchange(out[mine:mine + k], out[theirs:theirs + k], ranks[me ^ k], group)
        k *= 2
    return list(out.unbind(0))


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable object, in group-rank order (CPU control group by default):
    the lengths in one all-gather, the padded payloads in another."""
    group = group if group is not None else get_parallel().cpu_group
    if group_size(group) == 1:
        return [obj]
    payload = pickle.dumps(obj)
    sizes = [row[0] for row in all_gather_ints([len(payload)], group)]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = all_gather(buf, group)
    return [pickle.loads(part[:size].numpy().tobytes()) for part, size in zip(parts, sizes)]


def tp_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return all_reduce(tensor, get_parallel().tp_group)


def attn_tp_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return all_reduce(tensor, get_parallel().attn_tp_group)


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Every rank's small int vector (same length everywhere), over the CPU control group."""
    group = group if group is not None else get_parallel().cpu_group
    mine = torch.tensor(values, dtype=torch.int64)
    return [t.tolist() for t in all_gather(mine, group)]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from global rank `src` to every rank (CPU control group)."""
    state = get_parallel()
    if group_size(state.cpu_group) == 1:
        return obj
    if state.rank == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=state.cpu_group)
    if state.rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=state.cpu_group)
    return obj if state.rank == src else pickle.loads(payload.numpy().tobytes())



T = TypeVar("T")


def ranks_by(values: list[T]) -> dict[T, list[int]]:
    """Each distinct value of a per-rank list, with the ranks that hold it (first seen first)."""
    by_value: dict[T, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    return by_value


def agreed(step: Callable[[], T]) -> T:
    """Run a startup step on every rank; when any rank raises a ConfigError, every rank raises
    one that names the failing ranks (a shard missing on one node must not leave the others
    waiting in the next collective until --dist-timeout)."""
    error = None
    result = None
    try:
        result = step()
    except ConfigError as err:
        error = str(err)
    errors = all_gather_object(error)
    by_message = ranks_by(errors)
    by_message.pop(None, None)
    if not by_message:
        return result  # type: ignore[return-value]
    if len(by_message) == 1 and len(next(iter(by_message.values()))) == len(errors):
        raise ConfigError(next(iter(by_message)))  # the same on every rank: say it once
    raise ConfigError("; ".join(f"on rank(s) {ranks}: {message}"
                                for message, ranks in by_message.items()))
