"""The per-step exchange: rank 0's inbox (new requests, aborts) and one small all-gather.

Clients call Engine.add_request / Engine.abort on rank 0, from any thread; the events wait in
the inbox until the next step, which begins with one all-gather of a few ints per rank carrying
their count (with each rank's work flag, received signal, commit digest and step times) and,
only when the count is not zero, one broadcast carrying the events themselves. Under DP
attention a second all-gather, once the step's drafts are sized, carries each rank's token
count (token_counts). An idle engine parks rank 0 on the inbox
(up to IDLE_WAIT_S, waking for signals) while the other ranks wait in the all-gather.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from dspark_launch.comm import all_gather_ints, broadcast_object
from dspark_launch.failure import received_signal
from dspark_launch.parallel import get_parallel

IDLE_WAIT_S = 0.5
_POLL_S = 0.05  # how often a parked rank 0 looks for a signal


@dataclass(frozen=True)
class Flags:
    """What every rank learns about every rank in one step."""

    work: bool  # some rank held unfinished requests when the step began
    signal: int  # a stop signal some rank received (0: none)
    digests: list[int]  # each rank's digest of what it committed last step (divergence.py)
    forward_us: int = 0  # the previous step's time without drafting, max over ranks
    draft_us: int = 0  # the previous step's draft time, max over ranks
    context_us: int = 0  # the previous step's deferred context writes, max over ranks


class Inbox:
    def __init__(self) -> None:
        self._events: list[tuple] = []
        self._ready = threading.Condition()

    def put(self, event: tuple) -> None:
        with self._ready:
            self._events.append(event)
            self._ready.notify()

    def take(self, wait_s: float) -> list[tuple]:
        """Everything queued; when empty, wait up to wait_s for the first event."""
        deadline = time.monotonic() + wait_s
        with self._ready:
            while not self._events and not received_signal():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ready.wait(min(left, _POLL_S))
            events, self._events = self._events, []
        return events


def exchange(events: list[tuple], work: bool, digest: int = 0,
             timing: tuple[int, int, int] = (0, 0, 0)) -> tuple[Flags, list[tuple]]:
    """Collective over every rank: the flags of all ranks, and rank 0's events. `digest`:
    this rank's digest of last step's commits (divergence.py); `timing`: this rank's last
    step (forward, draft, deferred context writes) in microseconds; the verify-length policy
    learns from the maximum, so every rank refines its cost curve alike."""
    rows = all_gather_ints([len(events), int(work), received_signal(), digest, *timing])
    if rows[0][0]:
        events = broadcast_object(events)
    flags = Flags(work=any(r[1] for r in rows), signal=max(r[2] for r in rows),
                  digests=[r[3] for r in rows], forward_us=max(r[4] for r in rows),
                  draft_us=max(r[5] for r in rows), context_us=max(r[6] for r in rows))
    return flags, events


def token_counts(tokens: int) -> list[int]:
    """Every rank's forward tokens this step. Under DP attention one all-gather: an idle group
    must learn whether any other forwards (to join its MLP), and the MLP gathers the groups'
    rows by these counts. In one group every rank forwards the same tokens: no message."""
    state = get_parallel()
    if state.attn_dp_size == 1:
        return [tokens] * state.world_size
    return [row[0] for row in all_gather_ints([tokens])]
