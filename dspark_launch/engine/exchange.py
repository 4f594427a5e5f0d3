"""The per-step exchange: rank 0's inbox (new requests, aborts) and one small all-gather.

Clients call Engine.add_request / Engine.abort on rank 0, from any thread; the events wait in
the inbox until the next step, where one all-gather of a few ints per rank carries their count
(with each rank's token count, work flag and received signal) and, only when the count is not
zero, one broadcast carries the events themselves. An idle engine parks rank 0 on the inbox
(up to IDLE_WAIT_S, waking for signals) while the other ranks wait in the all-gather.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from dspark_launch.comm import all_gather_ints, broadcast_object
from dspark_launch.failure import received_signal

IDLE_WAIT_S = 0.5
_POLL_S = 0.05  # how often a parked rank 0 looks for a signal


@dataclass(frozen=True)
class Flags:
    """What every rank learns about every rank in one step."""

    tokens: list[int]  # tokens each rank's attn_dp group forwards this step (per rank)
    work: bool  # some rank holds unfinished requests
    signal: int  # a stop signal some rank received (0: none)


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


def exchange(events: list[tuple], tokens: int, work: bool) -> tuple[Flags, list[tuple]]:
    """Collective over every rank: the flags of all ranks, and rank 0's events."""
    rows = all_gather_ints([len(events), tokens, int(work), received_signal()])
    if rows[0][0]:
        events = broadcast_object(events)
    flags = Flags(tokens=[r[1] for r in rows], work=any(r[2] for r in rows),
                  signal=max(r[3] for r in rows))
    return flags, events
