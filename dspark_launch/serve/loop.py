"""The server's step loop, run by every rank in lockstep.

Rank 0's HTTP thread admits requests straight into the engine (Engine.add_request is
thread-safe and wakes an idle step); every rank calls Engine.step(); rank 0 turns the outputs
into text (OutputProcessor) and hands them to the waiting handlers.

Shutdown is one agreed decision per step: a tiny all-gather carries each rank's stop signal
and rank 0's phase (time decides the grace period, so one rank must decide). On a stop signal
(SIGTERM, SIGINT, SIGHUP, SIGQUIT; on any rank) rank 0 stops accepting, lets in-flight requests
finish for up to `--shutdown-grace` seconds, aborts the rest, and every rank leaves after the
same step with exit code 128 + the signal (143, 130, 129, 131).
"""

from __future__ import annotations

import signal
import time
from enum import IntEnum

from dspark_launch.comm import all_gather_ints
from dspark_launch.engine.request import RequestSpec
from dspark_launch.failure import EXIT_CODES, StopNow, stop_signals, watch_step
from dspark_launch.log import logger
from dspark_launch.outputs import OutputProcessor
from dspark_launch.parallel import get_parallel
from dspark_launch.serve.bridge import RequestBridge, Submission
from dspark_launch.serve.metrics import ServerMetrics


class Phase(IntEnum):
    SERVE = 0
    DRAIN = 1  # no new requests; in-flight ones may finish until the grace period ends
    ABORT = 2  # grace over: in-flight requests aborted, waiting for the engine to free them
    EXIT = 3


_signals: list[int] = []


def _on_signal(signum: int, _frame) -> None:
    if _signals:  # a second signal: stop now, as the first one asked (its exit code)
        raise StopNow(_signals[0])
    _signals.append(signum)
    watch_step(signum, _on_signal, lambda: bool(_signals))  # a rank stuck in its step


def install_serve_signal_handlers() -> None:
    """Signals only set a flag that this loop exchanges (the engine's own per-step signal stop
    would end the server without its grace period)."""
    _signals.clear()
    for sig in stop_signals():  # SIGHUP / SIGQUIT too: they took the engine's hard stop
        signal.signal(sig, _on_signal)


class ServeLoop:
    def __init__(self, engine, tokenizer, grace_s: float, bridge: RequestBridge | None = None,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.grace_s = grace_s
        self.bridge = bridge  # rank 0 only
        self.metrics = metrics
        self.processor = OutputProcessor(tokenizer, engine.abort)
        self.phase = Phase.SERVE
        self.deadline = 0.0
        self.steps = 0
        if bridge is not None:
            bridge.admit = self._admit
            bridge.cancel = engine.abort

    # ------------------------------------------------------------ rank 0, HTTP thread

    def _admit(self, sub: Submission) -> None:
        """Called under the bridge's lock, so the processor knows the request before any step
        can report it."""
        self.processor.add(sub.rid, sub.prompt_ids, sub.params)
        self.engine.add_request(RequestSpec(index=sub.index, rid=sub.rid,
                                            prompt_ids=sub.prompt_ids, params=sub.params,
                                            prompt_text=sub.prompt_text))

    # ------------------------------------------------------------ every rank

    def run(self) -> int:
        """Serve until a stop signal; returns the exit code (128 + the signal: 143 SIGTERM,
        130 SIGINT, 129 SIGHUP, 131 SIGQUIT)."""
        rank0 = get_parallel().rank == 0
        while True:
            rows = all_gather_ints([_signals[0] if _signals else 0, int(self.phase),
                                    *local_load(self.engine)])
            signum = max(r[0] for r in rows)
            phase = Phase(rows[0][1])  # rank 0's decision binds every rank
            if phase is Phase.EXIT:
                return EXIT_CODES.get(signum, 0) if signum else 0
            outputs = self.engine.step()
            self.steps += 1
            if rank0:
                self._deliver(outputs, rows)
                self.phase = self._next_phase(phase, signum)

    def _deliver(self, outputs, rows: list[list[int]]) -> None:
        with self.bridge.lock:
            deltas = self.processor.process(outputs)
        for delta in deltas:
            done = delta.finished
            if self.metrics is not None:
                self.metrics.generation_tokens.inc(len(delta.token_ids))
                if done is not None:
                    self.metrics.finished(done)
            self.bridge.deliver(delta.rid, delta, done is not None)
        if self.metrics is not None:
            self._update_gauges(rows)

    def _update_gauges(self, rows: list[list[int]]) -> None:
        """Summed over attn_dp groups: one row per group (its attn_tp rank 0), as of the
        start of this step."""
        leaders = rows[::get_parallel().attn_tp_size]
        self.metrics.kv_pages_used.set(sum(r[2] for r in leaders))
        self.metrics.running.set(sum(r[3] for r in leaders))
        self.metrics.waiting.set(sum(r[4] for r in leaders))
        allocator = self.engine.space.allocator
        self.metrics.kv_pages_capacity.set(allocator.num_pages * len(leaders))

    def _next_phase(self, phase: Phase, signum: int) -> Phase:
        """Rank 0 only: the phase every rank follows from the next step on."""
        busy = len(self.processor) > 0 or self.engine.has_work
        if phase is Phase.SERVE and signum:
            logger.info("%s: no new requests; %d in flight get up to %.0f s to finish",
                        signal.Signals(signum).name, len(self.processor), self.grace_s)
            with self.bridge.lock:
                self.bridge.accepting = False
            self.deadline = time.monotonic() + self.grace_s
            phase = Phase.DRAIN
        if phase is Phase.DRAIN and busy and time.monotonic() >= self.deadline:
            with self.bridge.lock:
                rids = self.bridge.open_ids()
            logger.info("grace period over: aborting %d requests", len(rids))
            for rid in rids:
                self.engine.abort(rid)
            return Phase.ABORT
        if phase in (Phase.DRAIN, Phase.ABORT) and not busy:
            return Phase.EXIT
        return phase


def local_load(engine) -> tuple[int, int, int]:
    """(KV pages held by requests, running requests, waiting requests) in this rank's attn_dp
    group. Prefix-cache pages no request holds and spare rows (KVSpace.roll_back) are not
    counted: an allocation frees them on demand. A request still prefilling runs; one
    preempted waits again (the bridge's "no first token yet" counted the first twice and
    the second nowhere)."""
    space = engine.space
    allocator, cache = space.allocator, space.cache
    reclaimable = (cache.evictable_pages if cache is not None else 0) + space.spare_pages()
    return (allocator.num_pages - allocator.num_free_pages - reclaimable,
            len(engine.sched.running), len(engine.sched.waiting))
