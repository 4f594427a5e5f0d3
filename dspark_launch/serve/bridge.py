"""Rank 0's hand-off between the HTTP thread (asyncio) and the step loop (main thread).

HTTP handlers `submit` requests and `abort` them (a client that went away); both go straight to
the engine through the callbacks the step loop installs (`admit`, `cancel`; the engine's inbox
is thread-safe and wakes an idle step). The step loop hands results back with `deliver`, which
puts them on the handler's asyncio queue through `loop.call_soon_threadsafe` (asyncio queues
are not thread-safe). A request counts as queued from `submit` until its first token; the
`--max-queued-requests` limit is checked against that count.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark_launch.engine.params import SamplingParams
from dspark_launch.serve.errors import bad_request, overloaded, shutting_down


@dataclass(frozen=True)
class Submission:
    rid: str
    index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    prompt_text: str | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    started: bool = False  # produced its first token (no longer counts as queued)


def _unset(*_):
    raise RuntimeError("the step loop has not installed its callbacks")


@dataclass
class RequestBridge:
    max_queued: int | None = None
    accepting: bool = True
    admit: Callable[[Submission], None] = _unset  # called under `lock`
    cancel: Callable[[str], None] = _unset
    lock: threading.Lock = field(default_factory=threading.Lock)
    _streams: dict[str, _Stream] = field(default_factory=dict)
    _counter: itertools.count = field(default_factory=itertools.count)

    # ------------------------------------------------------------ HTTP side (event loop)

    def submit(self, prompts: list[tuple[list[int], str | None]], params: SamplingParams,
               sink: asyncio.Queue) -> list[str]:
        """Queue the prompts of one HTTP request (all or none); their results arrive on `sink`.
        Raises an APIError (503) when shutting down or too many requests are queued."""
        with self.lock:
            if not self.accepting:
                raise shutting_down()
            queued = self.queued
            if self.max_queued is not None and len(prompts) > self.max_queued:
                # No retry gets it through: a 400, not a 503 with a Retry-After.
                raise bad_request(f"prompt holds {len(prompts)} prompts; this server queues "
                                  f"at most --max-queued-requests={self.max_queued}: send at "
                                  f"most that many per request", "prompt")
            if self.max_queued is not None and queued + len(prompts) > self.max_queued:
                raise overloaded(queued, self.max_queued)
            rids = []
            for prompt_ids, text in prompts:
                rid = f"req-{uuid.uuid4().hex[:16]}"
                self._streams[rid] = _Stream(asyncio.get_running_loop(), sink)
                self.admit(Submission(rid, next(self._counter), tuple(prompt_ids), params,
                                      text))
                rids.append(rid)
        return rids

    def abort(self, rid: str) -> None:
        """The client went away: stop the request (a no-op once it finished)."""
        with self.lock:
            if rid not in self._streams:
                return
        self.cancel(rid)

    @property
    def queued(self) -> int:
        """Requests without a first token (call under `lock`)."""
        return sum(1 for s in self._streams.values() if not s.started)

    # ------------------------------------------------------------ step-loop side

    def deliver(self, rid: str, item, finished: bool) -> None:
        """Hand one result to the request's handler (thread-safe)."""
        with self.lock:
            stream = self._streams.get(rid)
            if stream is None:
                return
            stream.started = True
            if finished:
                del self._streams[rid]
        # A closed event loop (the server stopping) has nobody waiting.
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def fail_open(self, error) -> None:
        """The server stops under the requests still open: each handler gets `error` (an
        APIError) as its last item, and answers with it (thread-safe)."""
        with self.lock:
            self.accepting = False
            rids = list(self._streams)
        for rid in rids:
            self.deliver(rid, error, True)

    def open_ids(self) -> list[str]:
        """Requests not finished yet (call under `lock`)."""
        return list(self._streams)
