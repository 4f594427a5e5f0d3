"""Never a hung job: signals become an agreed stop, a broken collective becomes a named failure.

- SIGINT / SIGTERM while decoding only set a flag. The engine exchanges the flag with every rank
  at each step boundary (inside the step's all-gather), so all ranks stop after the same step,
  write what finished, destroy their groups and exit 130 / 143. Before decoding (loading
  weights, allocating pools) there is no boundary to wait for and nothing to write: the signal
  stops the rank at once. A second signal stops at once, except inside an output line's write,
  and so does the first one once the step under way has overrun its stop grace (a rank stuck
  in its step never gets to the boundary: STOP_GRACE_S).
- A rank that stops on its own (a configuration error only it sees, a signal only it got, a
  dead peer) tells the others through the rendezvous store, which outlives any worker: every
  rank posts its verdict, reads the others' (a roll call), and all reach the same conclusion —
  that rank's own message and exit 2 for a configuration error, 130 / 143 for a signal, else
  the ranks that did not answer and the step they were in.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as dist

from dspark_launch.errors import ConfigError, LaunchError

# 128 + the signal. torchrun's agent forwards SIGHUP and SIGQUIT as well: each is a stop like
# SIGTERM (they killed the ranks outright, the output left in finish order).
EXIT_CODES = {signal.SIGHUP: 129, signal.SIGINT: 130, signal.SIGQUIT: 131, signal.SIGTERM: 143}


class Interrupted(LaunchError):
    def __init__(self, signum: int) -> None:
        after = ("completed requests are in the output" if progress.phase == "decode" else
                 f"stopped during {progress.where()}, before any request ran")
        super().__init__(f"interrupted by {signal.Signals(signum).name}; {after}")
        self.signum = signum
        self.exit_code = EXIT_CODES.get(signum, 1)


# A first stop signal while decoding waits for the step boundary, but a rank stuck inside its
# step never gets there: torchrun SIGTERMs it once a peer has named it as stopped answering,
# and then waits 30 s before SIGKILL (tests/failure: the stuck-rank job took 44 s for a 4 s
# --dist-timeout). So once the step under way has run STOP_GRACE_S, or STOP_GRACE_STEPS times
# the slowest step so far if that is longer, the signal counts as a second one: the rank
# stops at once. Requests already completed are written by then (output lines are written as
# requests finish), and a step that slow was not going to reach the boundary in time anyway.
STOP_GRACE_S = 5.0
STOP_GRACE_STEPS = 3


class StopNow(KeyboardInterrupt):
    """A second stop signal: stop at once, with the exit code of the first (`signum`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Progress:
    phase: str = "startup"
    step: int = 0
    began: float = 0.0  # time.monotonic() when this decode step began
    slowest_s: float = 0.0  # the longest decode step so far (from one's start to the next's)
    in_step: bool = False  # a decode step is under way (it has not returned or raised)

    def where(self) -> str:
        return f"step {self.step}" if self.phase == "decode" else self.phase

    def begin(self, step: int) -> None:
        """A decode step begins (Engine.step)."""
        now = time.monotonic()
        if self.phase == "decode":
            self.slowest_s = max(self.slowest_s, now - self.began)
        self.phase, self.step, self.began, self.in_step = "decode", step, now, True

    def grace_left(self) -> float:
        """Seconds until the step under way has overrun its stop grace (STOP_GRACE_S)."""
        grace = max(STOP_GRACE_S, STOP_GRACE_STEPS * self.slowest_s)
        return self.began + grace - time.monotonic()


progress = Progress()
_received: list[int] = []
STOP_SIGNALS = tuple(EXIT_CODES)
# SIGHUP / SIGQUIT the process inherited as ignored (nohup) stay ignored: a job started under
# nohup ran on when its terminal closed, and must. Decided at the first install, before any
# handler of ours replaced the inherited disposition.
_inherited_ignored: set[int] | None = None


def stop_signals() -> tuple[int, ...]:
    """The stop signals this process handles (serve's loop installs the same ones)."""
    global _inherited_ignored
    if _inherited_ignored is None:
        _inherited_ignored = {s for s in (signal.SIGHUP, signal.SIGQUIT)
                              if signal.getsignal(s) is signal.SIG_IGN}
    return tuple(s for s in STOP_SIGNALS if s not in _inherited_ignored)


_record_only = [False]  # while a rank is already stopping: remember signals, never raise
_lost: list[str | None] = [None]  # a stop signal a finalizer swallowed: "first" / "second"


def _on_signal(signum: int, _frame) -> None:
    lost, _lost[0] = _lost[0], None  # this one stands in for a signal a finalizer swallowed
    if _record_only[0]:
        _received[:] = _received or [signum]
        return
    if _received and lost != "first":  # a second signal: stop waiting for the step boundary
        if _holding[0]:
            _holding[1] = True  # raised when the held write is whole
            return
        raise StopNow(_received[0])
    _received[:] = _received or [signum]
    if progress.phase != "decode":
        # Loading or allocating: stop now. The other ranks got the signal too (torchrun sends
        # it to every worker), or learn of it in the roll call when this rank's sockets close.
        raise Interrupted(signum)
    if lost != "first":  # (a redelivered first signal has its watch already)
        watch_step(signum, _on_signal, lambda: bool(_received))


def watch_step(signum: int, handler, pending: Callable[[], bool]) -> None:
    """A first stop signal came to `handler` while decoding: if the step under way overruns
    its stop grace (STOP_GRACE_S) while the signal is still `pending`, it comes again, as a
    second one (stop at once). Once that step has returned, the agreed stop is under way (the
    server's: its drain goes on step by step); once it has raised, the rank is stopping (a
    peer died under a collective: its roll call names the peer, and must not be cut short)."""
    with contextlib.suppress(RuntimeError):  # (none starts at interpreter shutdown)
        _thread.start_new_thread(_stop_if_stuck, (signum, progress.step, handler, pending))


def _stop_if_stuck(signum: int, step: int, handler, pending: Callable[[], bool]) -> None:
    while progress.in_step and progress.step == step and pending() \
            and signal.getsignal(signum) is handler:  # (other handlers now: not ours)
        left = progress.grace_left()
        if left <= 0:
            print(f"dspark_launch: rank {os.environ.get('RANK', '0')} still in step {step} "
                  f"{time.monotonic() - progress.began:.1f} s after it began, past its stop "
                  f"grace: stopping now on {signal.Signals(signum).name}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signum)
            return
        time.sleep(min(left, 0.5))


_holding = [False, False]  # [inside signals_held, a second signal arrived meanwhile]


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Defer the second SIGINT / SIGTERM over a short write (one output line): it is raised
    when the write is whole, so no line is ever torn. Done in the Python handler, not with
    pthread_sigmask: a process-directed signal goes to any thread that does not block it
    (uvicorn's, pytest-xdist's), and Python then runs the handler in the main thread anyway."""
    _holding[:] = [True, False]
    try:
        yield
    finally:
        pending = _holding[1]
        _holding[:] = [False, False]
        if pending:
            raise StopNow(received_signal() or signal.SIGINT)


REDELIVER_S = 0.05  # a signal swallowed inside a finalizer comes again this much later


def _on_unraisable(unraisable) -> None:
    """Python swallows an exception raised inside a finalizer or __del__ (garbage collection
    runs them anywhere, loading weights included): it prints the traceback and goes on. A stop
    signal that lands there would be lost, so it is delivered again a moment later, when the
    main thread is back in ordinary code, and counts as the signal it was (first or second);
    a signal that arrives meanwhile takes its place."""
    if not (_received and isinstance(unraisable.exc_value, (Interrupted, KeyboardInterrupt))):
        _previous_unraisable_hook[0](unraisable)
        return
    _lost[0] = "first" if isinstance(unraisable.exc_value, Interrupted) else "second"
    # A bare thread: threading's own locks may be held by the code GC interrupted. At
    # interpreter shutdown none starts, and there is nothing left to stop.
    with contextlib.suppress(RuntimeError):
        _thread.start_new_thread(_redeliver, (_received[0],))


def _redeliver(signum: int) -> None:
    time.sleep(REDELIVER_S)
    if _lost[0] is not None:
        os.kill(os.getpid(), signum)


_previous_unraisable_hook = [sys.__unraisablehook__]  # whoever printed them before


def install_signal_handlers() -> None:
    _received.clear()
    _record_only[0], _lost[0] = False, None
    for sig in stop_signals():
        signal.signal(sig, _on_signal)
    if sys.unraisablehook is not _on_unraisable:
        _previous_unraisable_hook[0] = sys.unraisablehook
        sys.unraisablehook = _on_unraisable


def record_signals_only() -> None:
    """From here on a signal is remembered, never raised: this rank is already stopping, and
    an exception in the middle of its roll call would cost the job its one clear line."""
    _record_only[0] = True


def received_signal() -> int:
    """The first stop signal received (0 if none)."""
    return _received[0] if _received else 0


def is_collective_failure(err: BaseException) -> bool:
    """A collective broke because of another rank (its death, or a timeout), not this one."""
    if isinstance(err, dist.DistError):
        return True
    # gloo reports a dead peer and an expired --dist-timeout with these; anything else
    # (this rank's own OOM, a bad tensor) is this rank's failure and keeps its traceback.
    text = str(err)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                   "Broken pipe", "Timed out waiting"))


ROLL_CALL_WAIT_S = 5.0  # a rank whose collective broke: how long it waits for the others
REPORT_WAIT_S = 2.0  # a rank with a configuration error: how long it waits to learn whether
# the others hit the same one (they raise it at the same point, within milliseconds)
BROKEN = "broken"  # the verdict of a rank whose collective failed under it
FAILED = "failed"  # the verdict of a rank that failed on its own and printed its traceback
FOLLOWED = "followed"  # a rank stopped because a peer had ended: the peer's verdict stands


def store_of_world():
    """The rendezvous store, which outlives every worker (None when there is none to ask)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store left to ask
        return None


VERDICT_KEY = "dspark/verdict"


def posted_verdicts(store, world_size: int, skip=()) -> dict[int, str]:
    """The verdicts ranks (but those in `skip`) have posted so far; raises when the store is
    gone."""
    return {r: store.get(f"{VERDICT_KEY}/{r}").decode() for r in range(world_size)
            if r not in skip and store.check([f"{VERDICT_KEY}/{r}"])}


def roll_call(store, rank: int, world_size: int, verdict: str, wait_s: float) -> dict[int, str]:
    """Post this rank's verdict; the verdicts posted until every rank has answered, or wait_s
    passed, or (for a rank whose collective broke) some rank posted a reason: its peers may be
    blocked behind this rank and notice only when it exits. A rank missing from the answer is
    dead, stuck, or has not noticed yet. One roll call per process and attempt (the store has
    a prefix per attempt)."""
    if store is None or world_size == 1:
        return {rank: verdict}
    try:
        store.set(f"{VERDICT_KEY}/{rank}", verdict)
        deadline = time.monotonic() + wait_s
        answers: dict[int, str] = {}
        while True:
            answers.update(posted_verdicts(store, world_size, skip=answers))
            reason = verdict == BROKEN and any(v != BROKEN for v in answers.values())
            if len(answers) == world_size or reason or time.monotonic() >= deadline:
                return answers
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store itself is gone: nothing to name
        return {rank: verdict}


def signal_verdict(signum: int) -> str:
    return f"signal {signum}"


def signal_or_follow(signum: int, posted: dict[int, str]) -> str:
    """A stop signal's verdict, unless a peer had already posted another ending (a
    configuration error, a failure of its own, a broken collective): that peer then ended its
    process, and torchrun stops the survivors of a rank that exited, so the signal is the
    ending's consequence (a survivor still working, not yet blocked behind the peer, got it
    first). It follows the peer out (FOLLOWED), silently, and the job ends as the peer's
    verdict says (an "interrupted by SIGTERM" line followed a failure's traceback, and a
    timed-out peer's "rank(s) [0] ... stopped answering")."""
    if any(not v.startswith("signal ") for v in posted.values()):
        return FOLLOWED
    return signal_verdict(signum)


def config_verdict(message: str) -> str:
    return f"config {message}"


def verdict_wait_s(verdict: str) -> float:
    """A signalled rank leaves at once (its peers learn of it from the store); a rank with a
    configuration error waits briefly to learn whether it is the one to say it; a rank whose
    collective broke waits for the others' reasons."""
    if verdict.startswith("signal ") or verdict == FOLLOWED:
        return 0.0
    return REPORT_WAIT_S if verdict.startswith("config ") else ROLL_CALL_WAIT_S


@dataclass(frozen=True)
class Conclusion:
    exit_code: int
    speak: bool
    line: str
    reason: str  # the line less what this rank noticed of it: what a client is told


def conclude(rank: int, world_size: int, answers: dict[int, str], noticed: str = "") -> Conclusion:
    """Every rank's ending from the roll call: a signal outranks a configuration error, which
    outranks a rank's own failure (it printed its traceback), which outranks a dead or stuck
    peer. One rank speaks: rank 0 for a signal (torchrun signals every
    rank); for a configuration error the rank that saw it (the lowest of those that saw the same
    message), in its own words, since its peers only know their collective broke; else the
    lowest rank that answered, naming the ranks that did not."""
    mine = answers[rank]
    signals = {r: int(v.split()[1]) for r, v in answers.items() if v.startswith("signal ")}
    if signals:
        signum = signals[min(signals)]
        after = ("completed requests are in the output" if progress.phase == "decode" else
                 f"stopped during {progress.where()}, before any request ran")
        line = f"interrupted by {signal.Signals(signum).name}; {after}"
        return Conclusion(EXIT_CODES.get(signum, 1), rank == 0, line, line)
    configs = {r: v for r, v in answers.items() if v.startswith("config ")}
    if configs:
        # A rank that followed a peer's error out tells (a client) the lowest rank's error
        said = mine if mine in configs.values() else configs[min(configs)]
        same = sorted(r for r, v in configs.items() if v == said)
        message = said[len("config "):]
        if len(same) < world_size:
            message = f"on rank(s) {same}: {message}"
        return Conclusion(2, mine == said and rank == same[0], message, message)
    failed = sorted(r for r, v in answers.items() if v == FAILED)
    if failed:  # it printed its own traceback; the others only follow it out
        line = f"rank(s) {failed} failed during {progress.where()}"
        return Conclusion(1, False, line, line)
    missing = [r for r in range(world_size) if r not in answers]
    who = f"rank(s) {missing}" if missing else "a peer rank"
    reason = f"{who} of {world_size} stopped answering during {progress.where()}"
    # A follower knows only that a peer ended: the peer's roll call says who stopped answering
    speakers = [r for r, v in answers.items() if v != FOLLOWED]
    return Conclusion(1, bool(speakers) and rank == min(speakers),
                      f"{reason} (noticed by rank {rank}: {noticed})", reason)


def verdict_of(err: Exception, world_size: int) -> str | None:
    """What this rank tells the others in the roll call (None: a failure of its own)."""
    if isinstance(err, Interrupted):
        return signal_or_follow(err.signum, _posted(world_size))
    if is_collective_failure(err):
        # What this rank knows is that its collective broke, even if a signal came meanwhile:
        # torchrun's agent SIGTERMs the survivors of a dead rank, maybe before they notice.
        # A real stop signal reaches every rank, and their verdicts say so in the roll call.
        return BROKEN
    if signum := received_signal():
        verdict = signal_or_follow(signum, _posted(world_size))
        if verdict == FOLLOWED and isinstance(err, ConfigError):
            return config_verdict(str(err))  # its own error, next to the peer's
        return verdict
    if isinstance(err, ConfigError):
        return config_verdict(str(err))
    return None


def _posted(world_size: int) -> dict[int, str]:
    """The roll call's verdicts so far (none when there is no store left to ask)."""
    store = store_of_world()
    if store is None or world_size == 1:
        return {}
    try:
        return posted_verdicts(store, world_size)
    except Exception:  # noqa: BLE001 - the store itself is gone
        return {}


ROLL_CALL_ENDING = "dspark_ending"  # the attribute agree() leaves on an error it concluded


def agree(rank: int, world_size: int, err: Exception) -> Conclusion | None:
    """How the job ends after `err`, as every rank agrees in the roll call (conclude); None
    for a failure of this rank's own, which it reports itself (its traceback). The roll call
    runs once per error: the server asks first, to answer its open requests with the job's
    line, and the CLI's stop then says the same. The ending is kept on the error itself: a
    module-level record would keep the error, its traceback and the dead job's process
    groups alive, into the next forked world of a test run, which hung collecting them."""
    end = getattr(err, ROLL_CALL_ENDING, None)
    if end is not None:
        return end
    record_signals_only()
    verdict = verdict_of(err, world_size)
    if verdict is None:
        return None
    answers = roll_call(store_of_world(), rank, world_size, verdict, verdict_wait_s(verdict))
    noticed = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    end = conclude(rank, world_size, answers, noticed)
    with contextlib.suppress(AttributeError):  # (an exception type without a __dict__)
        setattr(err, ROLL_CALL_ENDING, end)
    return end


# Test hook: "RANK:WHERE:KIND[,RANK:WHERE:KIND...]", first attempt only. WHERE is a decode
# step or a named point ("load", "budget", "rewrite-partial", "rewrite-written",
# "rewrite-replaced"); KIND is raise, kill, hang, config (a ConfigError on that rank only),
# stall (STALL_S seconds of work there: a signal still stops it) or diverge
# (engine/divergence.py).
FAULT_ENV = "DSPARK_FAULT"
STALL_S = 10.0


def fault_wanted(rank: int, where: int | str) -> str | None:
    """The fault KIND DSPARK_FAULT asks of this rank at this point, else None."""
    spec = os.environ.get(FAULT_ENV)
    # Only the first attempt fails: a job restarted by torchrun --max-restarts runs clean.
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    for fault in spec.split(","):
        want_rank, want_where, kind = fault.split(":")
        if int(want_rank) == rank and want_where == str(where):
            return kind
    return None


def inject_fault(rank: int | None, where: int | str) -> None:
    """Fail on purpose where DSPARK_FAULT says, so failure handling is tested for real.
    rank None: this process's RANK (for code that runs on rank 0 only, like the writer)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    kind = fault_wanted(rank, where)
    if kind is None:
        return
    spec = os.environ[FAULT_ENV]
    if kind == "config":
        raise ConfigError(f"fault injected on rank {rank} by {FAULT_ENV}={spec}")
    if kind == "raise":
        raise ValueError(f"fault injected by {FAULT_ENV}={spec}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(10**6)
    if kind == "stall":
        time.sleep(STALL_S)
