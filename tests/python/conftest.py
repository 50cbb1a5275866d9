"""Fixtures for psclient's tests: real psd daemons on kernel-assigned ports.

PSD_BINARY names the psd executable (ctest sets it; default: build/server/psd of this checkout) and
PYTHONPATH must reach the built package (<build>/python). Every daemon is started with --port 0
--port-file, dies with the test process (PR_SET_PDEATHSIG) and is killed by PID at teardown; every
wait is bounded.
"""
import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PSD = os.environ.get("PSD_BINARY", str(REPO / "build" / "server" / "psd"))
START_TIMEOUT_S = 30


def _die_with_parent():
    # The daemon is killed if the test process dies without tearing down (SIGKILL, a crash).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Daemon:
    """One psd process: .port, .pid, .log (its stderr), stop(), kill()."""

    def __init__(self, directory, args):
        self.dir = directory
        self.log_path = directory / "psd.log"
        port_file = directory / "port"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([PSD, "--port", "0", "--port-file", str(port_file), *args],
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        self.pid = self.proc.pid
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if port_file.exists() and port_file.read_text().strip():
                self.port = int(port_file.read_text().strip())
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"psd exited with status {self.proc.returncode} before it was ready:\n{self.log}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"psd was not ready within {START_TIMEOUT_S} s:\n{self.log}")
            time.sleep(0.02)

    @property
    def log(self):
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self):
        """SIGKILL and reap (idempotent)."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()

    def wait(self, timeout):
        """Waits (bounded) for the daemon to exit by itself; returns its status."""
        return self.proc.wait(timeout=timeout)


@pytest.fixture
def start_psd(tmp_path):
    """start_psd(*flags) -> Daemon; every daemon started is killed at teardown."""
    daemons = []

    def start(*args):
        d = tmp_path / f"psd{len(daemons)}"
        d.mkdir()
        daemon = Daemon(d, [str(a) for a in args])
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.kill()


@pytest.fixture
def psd(start_psd):
    """A single daemon: one worker (R = N = 1), SGD with learning rate 0.5, no initial tokens."""
    return start_psd("-R", "1", "--init-tokens", "0", "--learning-rate", "0.5")


@pytest.fixture
def refused_port():
    """A 127.0.0.1 port nobody listens on (a bound, non-listening socket holds it): connects are refused."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()
