"""Process-wide parallel state: the widths, ranks and groups every other part reads.

`init_parallel_runtime` stamps the state once per process, in the order
init_distributed_environment -> initialize_model_parallel -> initialize_dp_attention.
Every KV-head count in the engine (pools, budget, models) reads
`get_parallel().attn_tp_size` from here, never a width re-derived from flags.

Layout: tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank, so attention-TP groups are
contiguous runs of attn_tp_size ranks inside the TP group.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from dspark_launch.errors import ConfigError, RuntimeFailure


@dataclass(frozen=True)
class ParallelState:
    world_size: int
    tp_size: int
    tp_rank: int
    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    # Where this rank sits in the launch (torchrun's LOCAL_RANK / GROUP_RANK).
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    # Process groups; None in a published override (no collectives allowed there).
    tp_group: dist.ProcessGroup | None = None
    attn_tp_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None  # gloo, for control messages
    attn_tp_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        validate_layout(
            tp_size=self.tp_size,
            attn_dp_size=self.attn_dp_size,
            attn_tp_size=self.attn_tp_size,
            tp_rank=self.tp_rank,
            attn_tp_rank=self.attn_tp_rank,
            attn_dp_rank=self.attn_dp_rank,
            world_size=self.world_size,
        )


def validate_layout(
    *,
    tp_size: int,
    attn_dp_size: int,
    attn_tp_size: int | None = None,
    tp_rank: int = 0,
    attn_tp_rank: int | None = None,
    attn_dp_rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Refuse any width/rank combination that breaks the layout, naming every factor."""
    if tp_size < 1:
        raise ConfigError(f"tp_size={tp_size} must be >= 1")
    if attn_dp_size < 1:
        raise ConfigError(f"attn_dp_size={attn_dp_size} must be >= 1")
    if tp_size % attn_dp_size:
        raise ConfigError(
            f"tp_size={tp_size} is not divisible by attn_dp_size={attn_dp_size} "
            f"(attn_tp_size = tp_size / attn_dp_size must be a whole number)"
        )
    expect_attn_tp = tp_size // attn_dp_size
    if attn_tp_size is not None and attn_tp_size != expect_attn_tp:
        raise ConfigError(
            f"attn_tp_size={attn_tp_size} * attn_dp_size={attn_dp_size} != tp_size={tp_size}"
        )
    if world_size is not None and world_size != tp_size:
        raise ConfigError(
            f"world_size={world_size} != tp_size={tp_size}: every rank is one tensor-parallel "
            f"rank (pipeline and replica data parallelism are not supported); "
            f"launch {tp_size} ranks or pass --tp-size {world_size}"
        )
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank={tp_rank} is outside [0, tp_size={tp_size})")
    if attn_tp_rank is not None and attn_tp_rank != tp_rank % expect_attn_tp:
        raise ConfigError(
            f"attn_tp_rank={attn_tp_rank} != tp_rank={tp_rank} % attn_tp_size={expect_attn_tp}"
        )
    if attn_dp_rank is not None and attn_dp_rank != tp_rank // expect_attn_tp:
        raise ConfigError(
            f"attn_dp_rank={attn_dp_rank} != tp_rank={tp_rank} // attn_tp_size={expect_attn_tp}"
        )


_stamped: ParallelState | None = None
_overrides: list[ParallelState] = []
_adopted = False  # the default group was the caller's (LLM in a user's program): keep it
# The store the ranks met through, under a prefix of this runtime's own (None: a world of
# one, or a user's world whose store torch does not expose): check_in() meets there.
_store: dist.Store | None = None
# Runtimes begun in this process (begin_runtime: the same count on every rank, which calls
# LLM() in the same order as every other). Each runtime's keys go under a prefix of their own:
# a second LLM after the first's shutdown read the first's gloo addresses and arrivals, and
# connected to a rank's dead listener.
_runtimes = 0
_begun = False  # begin_runtime() counted the next runtime already
_check_ins = 0  # check_in() calls of this runtime
GAVE_UP = "\x00gave up"  # a check-in value: that rank stopped waiting (check_in)


def begin_runtime() -> None:
    """Count one more runtime, at the first line of each LLM(): a call that fails before it
    joins the world on one rank only (a bad argument) must still count, or the ranks' prefixes
    drift apart and every later LLM() waits under another prefix than its peers'. Any other
    runtime (the CLI's, a script's) is counted when it joins."""
    global _runtimes, _begun
    _runtimes, _begun = _runtimes + 1, True


def get_parallel() -> ParallelState:
    """The live parallel state; raises if nothing has been stamped or published yet."""
    if _overrides:
        return _overrides[-1]
    if _stamped is None:
        raise RuntimeError(
            "parallel state read before it was stamped: call init_parallel_runtime(cfg) "
            "(or publish a topology with override_parallel(...) in tests)"
        )
    return _stamped


def is_initialized() -> bool:
    return _stamped is not None


def topology(tp_size: int, attn_dp_size: int = 1, tp_rank: int = 0) -> ParallelState:
    """A validated state for a topology without process groups (for pricing and plans)."""
    validate_layout(tp_size=tp_size, attn_dp_size=attn_dp_size, tp_rank=tp_rank)
    attn_tp_size = tp_size // attn_dp_size
    return ParallelState(
        world_size=tp_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
        attn_tp_size=attn_tp_size,
        attn_tp_rank=tp_rank % attn_tp_size,
        attn_dp_size=attn_dp_size,
        attn_dp_rank=tp_rank // attn_tp_size,
        rank=tp_rank,
    )


@contextlib.contextmanager
def override_parallel(
    tp_size: int, attn_dp_size: int = 1, tp_rank: int = 0
) -> Iterator[ParallelState]:
    """Publish a topology for the duration of a block (validated; restored on exit)."""
    state = topology(tp_size, attn_dp_size, tp_rank)
    _overrides.append(state)
    try:
        yield state
    finally:
        _overrides.remove(state)


# ---------------------------------------------------------------- runtime initialisation


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def launch_world_size() -> int:
    """World size as torchrun announced it (1 outside torchrun)."""
    return _env_int("WORLD_SIZE", 1)


def init_distributed_environment(
    device_type: str = "auto", timeout_s: float = 600.0, timeout_name: str = "--dist-timeout"
) -> ParallelState:
    """Join the world torchrun announced (or a world of one) and pick the backend."""
    global _stamped
    if _stamped is not None:
        raise RuntimeError("init_parallel_runtime() already ran in this process")
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    node_rank = _env_int("GROUP_RANK", 0)
    use_cuda = torch.cuda.is_available() if device_type == "auto" else device_type == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError(f"--device={device_type}: this torch ({torch.__version__}) sees no "
                          f"CUDA device; use --device cpu or auto")
    if use_cuda:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)  # before init_process_group, so NCCL binds this GPU
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    global _adopted, _store, _check_ins, _runtimes, _begun
    _runtimes, _begun, _check_ins = _runtimes + (not _begun), False, 0
    _adopted = dist.is_initialized()
    if _adopted:  # a user's program initialised the world: join it as it is
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
        if backend != "nccl":
            device = torch.device("cpu")
        _store = _default_store()
    elif "MASTER_ADDR" in os.environ:
        _store = _launch_store(rank, world_size, timeout)
        await_peers(_store, rank, world_size, timeout_s, timeout_name=timeout_name)
        dist.init_process_group(backend, store=_store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:  # outside torchrun: a world of one, so every collective is the same code path
        if world_size != 1:
            raise ConfigError(f"WORLD_SIZE={world_size} is set but MASTER_ADDR is not")
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    _stamped = ParallelState(
        world_size=world_size,
        tp_size=world_size,
        tp_rank=rank,
        attn_tp_size=world_size,
        attn_tp_rank=rank,
        attn_dp_size=1,
        attn_dp_rank=0,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        device=device,
        backend=backend,
    )
    return _stamped


def _launch_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store torchrun announced, under a per-attempt prefix.

    After a torchrun --max-restarts restart the agent's store still holds the previous
    attempt's gloo addresses under the same keys; a rank that reads one before its peer
    overwrites it connects to a dead process. A prefix per TORCHELASTIC_RESTART_COUNT keeps
    attempts apart (torchrun's agent hosts the store when TORCHELASTIC_USE_AGENT_STORE=True,
    else rank 0 does, as with plain env://).
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(  # the workers are awaited in Python: await_peers
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=rank == 0 and not agent_store, timeout=timeout, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"dspark/attempt_{attempt}/runtime_{_runtimes}", store)


def _default_store() -> dist.Store | None:
    """A user's default group's store, under this runtime's prefix (torch keeps it private:
    None where this torch does not have it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - any torch without it: no check-ins
        return None
    return dist.PrefixStore(f"dspark/runtime_{_runtimes}", store)


class NotJoined(RuntimeFailure):
    """Ranks that never reached the rendezvous: said by the lowest rank that did."""

    def __init__(self, message: str, speaker: int) -> None:
        super().__init__(message)
        self.speaker = speaker


ARRIVAL_POLL_S = 0.05  # the longest pause between two looks at the store ...
FIRST_POLL_S = 0.001  # ... the first, doubling: ranks a few ms apart meet in a few ms


def await_peers(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                key: str = "arrived", value: str = "1", doing: str = "join",
                timeout_name: str = "--dist-timeout") -> list[str]:
    """Wait until every rank of the world has set `key/<rank>` in the store, polling from
    Python: a signal stops a rank waiting here at once (torchrun's SIGTERM after a peer died
    before joining), and a peer that never comes is named after the timeout. Inside
    init_process_group the wait is C++'s, where neither happened: torchrun's SIGKILL came
    30 s later, and a timeout was a store traceback. -> every rank's value, in rank order."""
    from dspark_launch.failure import Interrupted, progress

    store.set(f"{key}/{rank}", value)
    keys = [f"{key}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    pause = FIRST_POLL_S

    def missing() -> list[int]:
        return [r for r, k in enumerate(keys) if not store.check([k])]

    try:
        while not store.check(keys):
            if time.monotonic() >= deadline:
                absent = missing()
                raise NotJoined(f"rank(s) {absent} of {world_size} did not {doing} within "
                                f"{timeout_name}={timeout_s:g} s",
                                speaker=min(r for r in range(world_size) if r not in absent))
            time.sleep(pause)
            pause = min(2 * pause, ARRIVAL_POLL_S)
    except Interrupted as err:  # say whom it was waiting for (maybe a peer that died)
        if absent := missing():
            progress.phase = f"the rendezvous, rank(s) {absent} of {world_size} not there yet"
        raise Interrupted(err.signum) from None
    return [store.get(k).decode() for k in keys]


def check_in(value: str, doing: str, timeout_s: float) -> list[str] | None:
    """Every rank's `value` for this SPMD call (every rank calls check_in in the same order:
    LLM() and each generate()), met through the runtime's store, so a rank that never comes
    is named after `timeout_s` (a collective would wait in C++, deaf to Ctrl-C) and a caller
    can compare what each rank was asked. None where there is no store (a world of one, or a
    user's world whose store torch does not expose). A rank deletes its key of two calls
    back: every rank has read it (it set the last call's key after). A rank that stops
    waiting leaves GAVE_UP as its value, so a peer that comes late finds out instead of
    stepping alone."""
    global _check_ins
    state = get_parallel()
    if _store is None or state.world_size == 1:
        return None
    _check_ins += 1
    if _check_ins > 2:
        with contextlib.suppress(Exception):
            _store.delete_key(f"check_in_{_check_ins - 2}/{state.rank}")
    key = f"check_in_{_check_ins}"
    try:
        return await_peers(_store, state.rank, state.world_size, timeout_s, key=key,
                           value=value, doing=doing, timeout_name="dist_timeout")
    except BaseException:
        with contextlib.suppress(Exception):
            _store.set(f"{key}/{state.rank}", GAVE_UP)
        raise


def _new_groups(rank_lists: list[list[int]], backend: str | None, timeout_s: float):
    """Create one group per rank list (every rank must create every group) and return ours."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(
            ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s)
        )
        if dist.get_rank() in ranks:
            mine = group
    return mine


def initialize_model_parallel(tp_size: int, timeout_s: float = 600.0) -> ParallelState:
    global _stamped
    state = get_parallel()
    validate_layout(tp_size=tp_size, attn_dp_size=1, world_size=state.world_size)
    world = list(range(state.world_size))
    tp_group = _new_groups([world], None, timeout_s)
    # Control messages (prompts, step plans) always travel over gloo on the CPU.
    cpu_group = tp_group if state.backend == "gloo" else _new_groups([world], "gloo", timeout_s)
    _stamped = replace(state, tp_size=tp_size, tp_rank=state.rank, tp_group=tp_group,
                       cpu_group=cpu_group)
    return _stamped


def initialize_dp_attention(attn_dp_size: int, timeout_s: float = 600.0) -> ParallelState:
    global _stamped
    state = get_parallel()
    validate_layout(tp_size=state.tp_size, attn_dp_size=attn_dp_size)
    attn_tp_size = state.tp_size // attn_dp_size
    runs = [
        list(range(start, start + attn_tp_size))
        for start in range(0, state.tp_size, attn_tp_size)
    ]
    # Alias the TP group when attention is not data-parallel: one group, not two.
    attn_tp_group = state.tp_group if attn_dp_size == 1 else _new_groups(runs, None, timeout_s)
    _stamped = replace(
        state,
        attn_tp_size=attn_tp_size,
        attn_tp_rank=state.tp_rank % attn_tp_size,
        attn_dp_size=attn_dp_size,
        attn_dp_rank=state.tp_rank // attn_tp_size,
        attn_tp_group=attn_tp_group,
        attn_tp_ranks=tuple(runs[state.tp_rank // attn_tp_size]),
    )
    return _stamped


def init_parallel_runtime(cfg, joined: Callable[[], None] | None = None) -> ParallelState:
    """Stamp the parallel state from a resolved RunConfig (tp_size, attn_dp_size, ...).
    `joined` runs once the world is joined, before the first group is made (LLM(): every
    rank checks in with what it was asked, so ranks asked for other topologies are named
    rather than left waiting in mismatched new_group calls)."""
    try:
        init_distributed_environment(cfg.device, cfg.dist_timeout,
                                     getattr(cfg, "timeout_name", "--dist-timeout"))
        if joined is not None:
            joined()
        initialize_model_parallel(cfg.tp_size, cfg.dist_timeout)
        return initialize_dp_attention(cfg.attn_dp_size, cfg.dist_timeout)
    except BaseException:
        destroy_parallel_runtime()
        raise


def destroy_parallel_runtime() -> None:
    """Destroy every process group and forget the stamps; safe to call twice."""
    global _stamped, _adopted, _store
    state, _stamped, _store = _stamped, None, None
    if dist.is_available() and dist.is_initialized():
        if _adopted:  # only the groups we made; the caller's default group stays
            groups = {id(g): g for g in (state.tp_group, state.attn_tp_group, state.cpu_group)
                      if state is not None and g is not None}
            for group in groups.values():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)
        else:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    _adopted = False
    # A destroyed gloo group can linger in a reference cycle; collected later in a forked
    # child, its destructor waits on threads the child does not have. Collect it now.
    gc.collect()
