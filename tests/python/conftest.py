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
    """One psd process (started; wait_ready() waits for it): .port, .pid, .log (its output), kill(), wait()."""

    def __init__(self, directory, args, listen_socket=None):
        self.dir = directory
        self.log_path = directory / "psd.log"
        port_file = directory / "port"
        self._log = open(self.log_path, "wb")
        if listen_socket is None:
            where, fds = ["--port", "0"], ()
        else:  # a socket the test bound (a cluster's addresses must be known before its shards start)
            where, fds = ["--listen-fd", str(listen_socket.fileno())], (listen_socket.fileno(),)
        self.proc = subprocess.Popen([PSD, *where, "--port-file", str(port_file), *args],
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     pass_fds=fds, preexec_fn=_die_with_parent)
        self.pid = self.proc.pid
        self._port_file = port_file
        self.port = None

    def wait_ready(self):
        """Waits (bounded) until psd wrote its port file: restored, formed and serving."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._port_file.exists() and self._port_file.read_text().strip():
                self.port = int(self._port_file.read_text().strip())
                return self
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
        return daemon.wait_ready()

    yield start
    for daemon in daemons:
        daemon.kill()


@pytest.fixture
def start_cluster(tmp_path):
    """start_cluster(shards, *flags) -> "h:p,h:p" of a psd cluster, each shard serving a socket the
    test bound on port 0 and handed over (--listen-fd); every shard is killed at teardown."""
    daemons, sockets = [], []

    def start(shards, *args):
        bound = []
        for _ in range(shards):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            s.listen(128)
            bound.append(s)
        sockets.extend(bound)
        cluster = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in bound)
        # Every shard is started before any is waited for: a cluster is ready once it has formed.
        for i, s in enumerate(bound):
            d = tmp_path / f"shard{len(daemons)}"
            d.mkdir()
            daemons.append(Daemon(d, ["--cluster", cluster, "--shard-index", str(i), *map(str, args)], s))
        for daemon in daemons[-shards:]:
            daemon.wait_ready()
        return cluster

    yield start
    for daemon in daemons:
        daemon.kill()
    for s in sockets:
        s.close()


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
