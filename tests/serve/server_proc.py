"""Launch `dspark_launch serve` as a real process tree (torchrun, or a world of one) and stop it.

The server binds 127.0.0.1 on a free port; readiness is /health answering 200. Every process
is stopped by its own pid (the launcher, then each rank the LAYOUT lines named) and the test
fails if any is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def rank_pids(self) -> list[int]:
        return [json.loads(line.split("LAYOUT ", 1)[1])["pid"]
                for line in self.text().splitlines() if "LAYOUT " in line]

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def metric(self, name: str, label: str = "") -> float:
        """Sum of a Prometheus sample over its label sets (those containing `label`)."""
        _, body = self.get("/metrics")
        pattern = re.compile(rf"^{re.escape(name)}({{[^}}]*}})? (\S+)$", re.M)
        return sum(float(v) for labels, v in pattern.findall(body.decode()) if label in labels)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> int:
        """Signal the launcher, wait for the whole tree; kill leftovers by pid (and fail)."""
        pids = self.rank_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if alive(p)]
        for pid in left + ([self.proc.pid] if rc is None else []):
            os.kill(pid, signal.SIGKILL)
        if rc is None:
            self.proc.wait()
        assert rc is not None and not left, (
            f"server did not stop on {signal.Signals(sig).name} (rc {rc}, left {left}):\n"
            f"{self.text()[-3000:]}")
        return rc


# free_port() finds a port free now; by the time the server binds it, another process of the
# suite (a torchrun rendezvous, another server) may have taken it: the server then exits 2
# naming the port, and is started again on another one.
BIND_ATTEMPTS = 3


def launch(args: list[str], nproc: int | None, log: Path, env: dict | None = None) -> Server:
    """nproc=None: `python -m dspark_launch serve` (a world of one); else torchrun through
    dspark_launch.launch (torch.distributed.run with the job's exit codes)."""
    attempt = 1
    while True:
        try:
            return _launch(args, nproc, log, env)
        except PortTaken:
            if attempt == BIND_ATTEMPTS:
                raise
            attempt += 1


class PortTaken(AssertionError):
    pass


def _launch(args: list[str], nproc: int | None, log: Path, env: dict | None) -> Server:
    port = free_port()
    if nproc is None:
        cmd = [sys.executable, "-m", "dspark_launch"]
    else:
        cmd = [sys.executable, "-m", "dspark_launch.launch", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "dspark_launch"]
    # torch's GEMM, as the offline job these servers are compared with (tests/jobs.py QUIET):
    # the start-up GEMM choice took 15 of a 4-rank server's 22 s to health; it is tested in
    # tests/engine/test_gemm_choice.py, and through a torchrun program in tests/api.
    cmd += ["serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--log-all-ranks", "--cpu-gemm", "torch", *args]
    out = open(log, "w")  # noqa: SIM115 - the child writes it for the server's lifetime
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                            cwd=ROOT)
    out.close()
    server = Server(proc, port, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            text = server.text()
            kind = PortTaken if proc.returncode == 2 and "could not listen" in text else \
                AssertionError
            raise kind(f"server exited with {proc.returncode}:\n{text[-3000:]}")
        try:
            if server.get("/health")[0] == 200:
                return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise AssertionError(f"server not healthy after {START_TIMEOUT_S}s")
        time.sleep(0.5)
