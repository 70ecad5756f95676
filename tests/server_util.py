"""Start the real `specserve serve` as a subprocess on 127.0.0.1 with a free port, wait for /health.

    with running_server(["--model", str(tiny_dir)], tmp_path / "server.log") as srv:
        httpx.get(srv.url + "/health")
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig`, wait for the exit code (kill after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_server(args: Sequence[str], log: Path, timeout: float = 180.0) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.server.cli", *args, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    with log.open("wb") as out:
        # one torch thread: the tiny test models gain nothing from two, and the test process needs a core too
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    srv = ServerProcess(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{srv.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                return srv
        time.sleep(0.2)
    srv.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy within {timeout} s:\n{srv.log_tail()}")


@contextlib.contextmanager
def running_server(args: Sequence[str], log: Path) -> Iterator[ServerProcess]:
    srv = start_server(args, log)
    try:
        yield srv
    finally:
        srv.stop(signal.SIGKILL)
