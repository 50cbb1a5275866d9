"""psclient given what it must refuse or carry cleanly: integers that are not int64 (TypeError, not
RuntimeError), shapes whose size overflows (ValueError), psd text that is not UTF-8 (its status
kept, the bytes escaped) and rows of no bytes (no division by zero)."""
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import psclient


def connect(port, **kwargs):
    kwargs.setdefault("connect_timeout_ms", 5000)
    kwargs.setdefault("request_timeout_ms", 30000)
    return psclient.Client("127.0.0.1", port, **kwargs)


class HelloRewriter:
    """A TCP relay between a client and psd that replaces `old` with `new` (as long) in psd's first
    frame (the hello reply) and passes everything else through: a daemon saying odd things."""

    def __init__(self, upstream_port, old, new):
        assert len(old) == len(new)
        self.upstream_port, self.old, self.new = upstream_port, old, new
        self.replaced = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self):
        self.listener.close()

    def _accept(self):
        try:
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
                upstream.settimeout(None)
                threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
                threading.Thread(target=self._replies, args=(upstream, client), daemon=True).start()
        except OSError:
            pass  # closed

    @staticmethod
    def _pipe(src, dst, first=b""):
        try:
            dst.sendall(first)
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            src.close()
            dst.close()

    @staticmethod
    def _read(s, n):
        buf = b""
        while len(buf) < n:
            data = s.recv(n - len(buf))
            if not data:
                raise EOFError
            buf += data
        return buf

    def _replies(self, upstream, client):
        # Cap'n Proto's stream framing: (segments - 1), each segment's size in words, padding to 8
        # bytes, then the segments.
        try:
            head = self._read(upstream, 4)
            count = struct.unpack("<I", head)[0] + 1
            table_bytes = (4 + 4 * count + 7) // 8 * 8
            head += self._read(upstream, table_bytes - 4)
            words = struct.unpack_from("<%dI" % count, head, 4)
            body = self._read(upstream, 8 * sum(words))
        except (EOFError, OSError):
            upstream.close()
            client.close()
            return
        self.replaced = body.count(self.old)
        self._pipe(upstream, client, head + body.replace(self.old, self.new))


# --- integers: README "Errors" (arguments of the wrong Python type raise TypeError) ----------------

def test_rows_indices_and_shapes_that_are_not_int64_raise_type_error(psd):
    with connect(psd.port) as c:
        c.create_variable("e", np.zeros((8, 4), np.float32))
        out = np.zeros((2, 4), np.float32)
        for rows in ([2**64, 1], [2**63, 1], [-2**63 - 1, 1], [1.5, 2], np.array([1.0, 2.0]), ["1", 2], [None, 1],
                     np.array([2**64 - 1, 1], np.uint64)):
            with pytest.raises(TypeError, match=r"^pull_rows rows: expected integers in int64 range, got "):
                c.pull_rows("e", rows, out)
        with pytest.raises(TypeError, match=r"got 18446744073709551616$"):
            c.pull_rows("e", [1, 2**64], out)
        # Integers of any kind are integers (numpy's, unsigned arrays within range).
        c.pull_rows("e", [np.int64(1), np.uint8(2)], out)
        c.pull_rows("e", np.array([1, 2], np.uint64), out)
        with pytest.raises(TypeError, match="sparse gradient 'e' indices: expected integers in int64 range"):
            c.push(0, sparse=[("e", [2**64], np.ones((1, 4), np.float32))])
        with pytest.raises(TypeError, match=r"^shape: expected integers in int64 range, got 1.0$"):
            c.create_variable("h", shape=[2, 1.0])
        with pytest.raises(TypeError, match="RawTensor shape: expected integers in int64 range"):
            psclient.RawTensor(0, "float32", [2**70])
        with pytest.raises(TypeError, match="allocate_shared shape: expected integers in int64 range"):
            c.allocate_shared(2**70)
        # Names and dtypes that are not text.
        with pytest.raises(TypeError, match="gradient name: expected a str, got int"):
            c.push(0, {1: np.ones(4, np.float32)})
        with pytest.raises(TypeError, match="dtype: expected a str, got int"):
            c.create_variable("q", shape=[2], dtype=5)


def test_shapes_whose_size_overflows_are_refused():
    # 2^64 elements: NumElements wrapped around (nbytes said 0, and a view of it was undefined).
    with pytest.raises(psclient.InvalidArgument, match="RawTensor: shape .* is too large"):
        psclient.RawTensor(0, "float32", [2**32, 2**32])
    with pytest.raises(ValueError, match="RawTensor: shape .* exceeds"):
        psclient.RawTensor(0, "float64", [2**61])  # elements fit an int64, bytes do not
    with pytest.raises(ValueError, match="negative dimension"):
        psclient.RawTensor(0, "float32", [-4])
    assert psclient.RawTensor(0, "float32", [0, 2**40]).nbytes == 0
    assert psclient.RawTensor(0x1000, "float32", [2**20, 2**20]).nbytes == 4 << 40


def test_allocate_shared_refuses_a_size_that_overflows(psd):
    with connect(psd.port) as c:
        with pytest.raises(psclient.InvalidArgument, match="allocate_shared: shape .* is too large"):
            c.allocate_shared([2**32, 2**32])


# --- text that is not UTF-8 ----------------------------------------------------------------------

def test_a_status_message_that_is_not_utf8_keeps_its_status():
    # Strict decoding raised UnicodeDecodeError instead of the status's exception.
    with pytest.raises(psclient.Internal) as e:
        psclient._core._raise_status(10, b"the daemon's \xff\xfe words")
    assert e.value.message == "the daemon's \\xff\\xfe words"
    assert e.value.code == "INTERNAL"


def test_shared_memory_status_that_is_not_utf8_reads(psd):
    # psd's shared-memory socket, renamed with a byte that is not UTF-8: unreachable, and the
    # status that says so quotes the name.
    relay = HelloRewriter(psd.port, b"psd-shm-", b"psd-shm\xff")
    try:
        with connect(relay.port) as c:
            assert relay.replaced == 1
            assert c.shared_memory_shards == 0
            status = c.shared_memory_status
            assert "@psd-shm\\xff" in status and "not reachable" in status, status
            c.create_variable("w", np.arange(4, dtype=np.float32))  # over TCP, through the relay
            out = np.zeros(4, np.float32)
            c.pull("w", out)
            np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32))
    finally:
        relay.close()


# --- rows of no bytes ----------------------------------------------------------------------------

def test_pull_rows_of_a_sliced_variable_whose_rows_have_no_bytes(start_cluster):
    # A [8, 0] variable sliced over two shards (colocated with a sliced one): its rows are 0 bytes,
    # which PullRows divided by (SIGFPE, the whole process). Run apart so a crash is a failure.
    cluster = start_cluster(2, "--slice-bytes", "4K", "--init-tokens", "0")
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import psclient
        for shm in (1 << 30, 0):  # rows through the shared-memory segment, and over TCP
            with psclient.Client(cluster=sys.argv[1].split(","), connect_timeout_ms=20000,
                                 request_timeout_ms=30000, shared_memory_bytes=shm) as c:
                c.create_variable("v", np.zeros((8, 256), np.float32))
                with c.colocate_vars_with("v"):
                    c.create_variable("z", shape=(8, 0))
                p = c.placement("z")
                assert p.sliced and len(p.parts) == 2, (p.sliced, [(q.shard, q.row_begin, q.row_end) for q in p.parts])
                out = np.zeros((3, 0), np.float32)
                print("step", c.pull_rows("z", [1, 6, 1], out), flush=True)
                with np.testing.assert_raises(psclient.InvalidArgument):
                    c.pull_rows("z", [8], np.zeros((1, 0), np.float32))
    """)
    r = subprocess.run([sys.executable, "-c", script, cluster], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"exit status {r.returncode} (-8 is SIGFPE)\n{r.stdout}\n{r.stderr}"
    assert r.stdout.count("step ") == 2, r.stdout
