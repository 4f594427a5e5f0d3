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


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum in place over `group` (tp or attn_tp); returns the tensor."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Gather equally shaped tensors from every rank of `group`, in group-rank order."""
    n = group_size(group)
    if n == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(n)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


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
    state = get_parallel()
    errors = [error]
    if group_size(state.cpu_group) > 1:
        errors = [None] * state.world_size
        dist.all_gather_object(errors, error, group=state.cpu_group)
    by_message: dict[str, list[int]] = {}
    for rank, message in enumerate(errors):
        if message is not None:
            by_message.setdefault(message, []).append(rank)
    if not by_message:
        return result  # type: ignore[return-value]
    if len(by_message) == 1 and len(next(iter(by_message.values()))) == len(errors):
        raise ConfigError(next(iter(by_message)))  # the same on every rank: say it once
    raise ConfigError("; ".join(f"on rank(s) {ranks}: {message}"
                                for message, ranks in by_message.items()))
