"""A stop signal that lands inside a finalizer is not lost (Python swallows exceptions raised
there and prints them): the rank still stops, without a traceback. Real signals, in a fresh
process, so the handlers are the ones a rank installs."""

from __future__ import annotations

import subprocess
import sys

# A slow finalizer runs when `o` is deleted; the signal arrives while it sleeps.
SCRIPT = """
import os, signal, threading, time, weakref
from dspark_launch.failure import Interrupted, install_signal_handlers, progress
install_signal_handlers()
progress.phase = {phase!r}
signals = {signals!r}
class Held:
    pass
o = Held()
weakref.finalize(o, time.sleep, 1.0)
for i in range(signals):
    threading.Timer(0.1 + 0.2 * i, os.kill, (os.getpid(), signal.SIGTERM)).start()
try:
    del o
    time.sleep(5)
    print("not stopped")
except Interrupted as err:
    print("Interrupted:", err)
except KeyboardInterrupt:
    print("KeyboardInterrupt")
"""


def _run(phase: str, signals: int) -> tuple[str, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(phase=phase, signals=signals)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


def test_signal_inside_a_finalizer_while_loading_still_stops_the_rank() -> None:
    out, err = _run("loading", 1)
    assert out == "Interrupted: interrupted by SIGTERM; stopped during loading, before any " \
                  "request ran"
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_second_signal_inside_a_finalizer_while_decoding_still_stops_at_once() -> None:
    # Decoding: the first signal only sets the flag; the second (inside the finalizer) is
    # the one that must not be lost.
    out, err = _run("decode", 2)
    assert out == "KeyboardInterrupt"
    assert "Traceback" not in err and "Exception ignored" not in err, err
