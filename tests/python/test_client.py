"""psclient against a real psd: round trips, zero-copy, the sync barrier, sparse pushes, the API."""
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import psclient

LR = 0.5  # the `psd` fixture's learning rate (SGD)
REPO = Path(__file__).resolve().parents[2]


def connect(daemon, **kwargs):
    kwargs.setdefault("connect_timeout_ms", 5000)
    kwargs.setdefault("request_timeout_ms", 30000)
    return psclient.Client("127.0.0.1", daemon.port, **kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_create_pull_push_round_trip(psd, dtype):
    init = np.arange(12, dtype=dtype).reshape(3, 4) / 8
    grad = np.linspace(-1, 1, 12, dtype=dtype).reshape(3, 4)
    with connect(psd, worker_name="w0") as c:
        info = c.create_variable("w", init)
        assert (info.name, info.dtype, info.shape, info.created, info.trainable) == (
            "w", np.dtype(dtype).name, (3, 4), True, True)
        assert c.create_variable("w", init).created is False  # create-or-get
        out = np.zeros_like(init)
        assert c.pull("w", out) == 0
        np.testing.assert_array_equal(out, init)
        outcome = c.push(0, {"w": grad}, wait_token=True)
        assert outcome.token_status is None and outcome.waited and outcome.token == 1
        assert (outcome.accepted, outcome.stale) == (1, 0)
        assert outcome.results[0].accepted and outcome.results[0].step == 0
        assert c.pull("w", out) == 1
        np.testing.assert_allclose(out, init - LR * grad, rtol=1e-6)
        assert c.global_step() == 1


def test_pull_writes_into_the_callers_array(psd):
    with connect(psd) as c:
        c.create_variable("w", np.full(8, 3.0, np.float32))
        out = np.zeros(8, np.float32)
        address = out.__array_interface__["data"][0]
        c.pull("w", out)
        assert out.__array_interface__["data"][0] == address  # the same memory, written in place
        np.testing.assert_array_equal(out, 3.0)
        # A contiguous slice of a bigger array: the pull lands in the bigger array's memory.
        big = np.zeros(16, np.float32)
        window = big[4:12]
        assert np.shares_memory(window, big)
        c.pull("w", window)
        np.testing.assert_array_equal(big, [0] * 4 + [3] * 8 + [0] * 4)
        # pull_after writes the new values into the given array too.
        outcome = c.push(0, {"w": np.ones(8, np.float32)}, wait_token=True, pull_after={"w": out})
        assert outcome.pulled_step == 1
        np.testing.assert_array_equal(out, 3.0 - LR)


def test_same_host_shared_memory_and_tcp_give_the_same_values(start_psd):
    results = {}
    # (segment, piece, copy threads, lane): one piece, 64 KiB pieces copied with helpers and the
    # frames over TCP, TCP.
    for shm_bytes, piece, copiers, lane in ((1 << 30, 0, 0, True), (1 << 30, 64 << 10, 3, False), (0, 4 << 20, 2, True)):
        daemon = start_psd("-R", "1", "--init-tokens", "0", "--learning-rate", "0.5")
        with connect(daemon, shared_memory_bytes=shm_bytes, shm_piece_bytes=piece, copy_threads=copiers,
                     shm_lane=lane) as c:
            assert c.shared_memory_shards == (1 if shm_bytes else 0)
            assert c.shared_memory_lanes == (1 if shm_bytes and lane else 0)
            assert (c.shared_memory_status == "") == bool(shm_bytes)
            c.create_variable("w", np.linspace(0, 1, 100_000, dtype=np.float32))
            out = np.zeros(100_000, np.float32)
            for step in range(3):
                grad = np.sin(np.arange(100_000, dtype=np.float32) + step)
                c.push(step, {"w": grad}, wait_token=True, pull_after={"w": out})
            results[(shm_bytes, piece)] = out.copy()
    np.testing.assert_array_equal(results[(1 << 30, 0)], results[(0, 4 << 20)])
    np.testing.assert_array_equal(results[(1 << 30, 64 << 10)], results[(0, 4 << 20)])
    with pytest.raises(psclient.InvalidArgument):
        connect(start_psd("-R", "1"), copy_threads=-1)


def test_shared_buffers_move_in_place_with_the_values_tcp_gives(start_psd):
    results = {}
    for shared in (True, False):
        daemon = start_psd("-R", "1", "--init-tokens", "0", "--learning-rate", "0.5")
        # A 64 KiB segment cannot hold w: only the shared buffers carry it through shared memory.
        with connect(daemon, shared_memory_bytes=64 << 10, shared_buffer_bytes=8 << 20) as c:
            c.create_variable("w", np.linspace(0, 1, 100_000, dtype=np.float32))
            if shared:
                out = c.allocate_shared(100_000)
                grad = c.allocate_shared((100_000,), "float32")
                assert out.dtype == np.float32 and out.shape == (100_000,)
                assert not out.any()  # zeroed
            else:
                out = np.zeros(100_000, np.float32)
                grad = np.zeros(100_000, np.float32)
            for step in range(3):
                grad[:] = np.sin(np.arange(100_000, dtype=np.float32) + step)
                c.push(step, {"w": grad}, wait_token=True, pull_after={"w": out})
            results[shared] = out.copy()
            # Rows of a [1000, 100] view of w into a shared array: written there in place.
            rows = c.allocate_shared((3, 100), "float32") if shared else np.zeros((3, 100), np.float32)
            c.create_variable("t", out.reshape(1000, 100))
            assert c.pull_rows("t", [999, 0, 999], rows) == 3
            results[(shared, "rows")] = rows.copy()
            if shared:
                with pytest.raises(psclient.InvalidArgument):
                    c.allocate_shared(4, "bfloat16")  # numpy has none
                with pytest.raises(psclient.ResourceExhausted):
                    c.allocate_shared(8 << 20)
    np.testing.assert_array_equal(results[True], results[False])
    np.testing.assert_array_equal(results[(True, "rows")], results[(False, "rows")])
    np.testing.assert_array_equal(results[(True, "rows")][0], results[True][99900:])


def test_push_reads_the_callers_array(psd):
    with connect(psd) as c:
        c.create_variable("w", shape=(2, 2), dtype="float64")
        grad_storage = np.zeros(8, np.float64)
        grad = grad_storage[2:6].reshape(2, 2)  # a contiguous view into other memory
        grad_storage[2:6] = [1, 2, 3, 4]
        c.push(0, [("w", grad)], wait_token=True)
        out = np.empty((2, 2), np.float64)
        c.pull("w", out)
        np.testing.assert_array_equal(out, -LR * np.array([[1, 2], [3, 4]]))


def test_non_contiguous_arrays_are_refused(psd):
    with connect(psd) as c:
        c.create_variable("w", shape=(4,))
        strided = np.zeros(8, np.float32)[::2]
        with pytest.raises(psclient.InvalidArgument, match="ascontiguousarray") as e:
            c.push(0, {"w": strided})
        assert isinstance(e.value, ValueError) and e.value.code == "INVALID_ARGUMENT"
        with pytest.raises(psclient.InvalidArgument, match="ascontiguousarray"):
            c.pull("w", strided)
        fortran = np.zeros((4, 4), np.float32, order="F")
        with pytest.raises(psclient.InvalidArgument, match="not C-contiguous"):
            c.create_variable("f", fortran)
        c.push(0, {"w": np.ascontiguousarray(strided)})  # the documented one explicit copy


def test_wrong_dtypes_read_only_outputs_and_non_arrays(psd):
    with connect(psd) as c:
        c.create_variable("w", shape=(4,))
        with pytest.raises(psclient.InvalidArgument, match="float32, float64 or float16"):
            c.push(0, {"w": np.zeros(4, np.int32)})
        read_only = np.zeros(4, np.float32)
        read_only.flags.writeable = False
        with pytest.raises(psclient.InvalidArgument, match="read-only"):
            c.pull("w", read_only)
        with pytest.raises(TypeError, match="numpy array"):
            c.push(0, {"w": [0.0, 0.0, 0.0, 0.0]})
        with pytest.raises(psclient.InvalidArgument):  # a float64 array for a float32 variable
            c.pull("w", np.zeros(4, np.float64))
        with pytest.raises(psclient.InvalidArgument):  # a shape that is not the variable's
            c.pull("w", np.zeros(5, np.float32))
        with pytest.raises(psclient.InvalidArgument, match="dtype 'float64'"):
            c.create_variable("x", np.zeros(2, np.float32), dtype="float64")


def test_sync_barrier_two_workers_in_threads(start_psd):
    # R = N = 2 and no initial tokens: a token is released only once both workers pushed, so each
    # wait is a real barrier; both workers run in one process, which works only because every
    # blocking call releases the GIL.
    daemon = start_psd("-R", "2", "-N", "2", "--init-tokens", "0", "--learning-rate", "0.25")
    steps = 5
    init = np.array([1.0, -2.0, 0.5], np.float32)
    grads = [np.array([1.0, 0.0, 2.0], np.float32), np.array([3.0, 4.0, -2.0], np.float32)]
    results, errors = {}, []
    ready = threading.Barrier(2, timeout=30)

    def worker(i):
        try:
            with connect(daemon, worker_name=f"w{i}") as c:
                c.create_variable("w", init)
                ready.wait()
                values = np.empty(3, np.float32)
                local_step = c.pull("w", values)
                history = []
                for _ in range(steps):
                    out = c.push(local_step, {"w": grads[i]}, wait_token=True, timeout_ms=20000,
                                 pull_after={"w": values})
                    assert out.token_status is None, out.token_status
                    assert out.accepted == 1
                    assert out.pulled_step == out.token
                    local_step = out.token
                    history.append((out.token, values.copy()))
                results[i] = history
                c.finish()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    mean = (grads[0] + grads[1]) / 2
    for i in range(2):
        assert [token for token, _ in results[i]] == list(range(1, steps + 1))
        for token, values in results[i]:
            np.testing.assert_allclose(values, init - 0.25 * token * mean, rtol=1e-5)


def test_sparse_push(psd):
    with connect(psd) as c:
        table = np.arange(18, dtype=np.float32).reshape(6, 3)
        c.create_variable("emb", table)
        values = np.array([[1, 1, 1], [2, 2, 2], [4, 4, 4]], np.float32)
        # Rows in any order, repeated: summed per row by the client before sending.
        out = c.push(0, sparse=[psclient.SparseGradient("emb", np.array([4, 1, 4]), values, dense_shape=(6, 3))],
                     wait_token=True)
        assert out.token_status is None and out.accepted == 1
        expected = table.copy()
        expected[1] -= LR * values[1]
        expected[4] -= LR * (values[0] + values[2])
        pulled = np.empty_like(table)
        c.pull("emb", pulled)
        np.testing.assert_allclose(pulled, expected)
        rows = np.empty((3, 3), np.float32)
        assert c.pull_rows("emb", [4, 0, 4], rows) == 1
        np.testing.assert_allclose(rows, expected[[4, 0, 4]])
        # The tuple form.
        out = c.push(1, sparse=[("emb", [0], np.ones((1, 3), np.float32))], wait_token=True)
        assert out.token == 2


def test_pull_many_and_status(psd):
    with connect(psd, worker_name="w0") as c:
        assert c.is_chief and c.should_init and c.should_checkpoint and c.should_save_summary
        assert c.config.replicas_to_aggregate == 1 and c.config.optimizer == "sgd" and c.config.mode == "sync"
        assert c.initial_global_step == 0 and c.shards == 1 and c.chief_shard == 0
        assert c.parameter_devices == [f"127.0.0.1:{psd.port}"]
        c.create_variable("a", np.ones(2, np.float32))
        c.create_variable("b", np.full((2, 2), 2.0, np.float64))
        a, b = np.empty(2, np.float32), np.empty((2, 2), np.float64)
        sent = c.requests_sent
        assert c.pull_many({"a": a, "b": b}) == 0
        assert c.requests_sent == sent + 1  # one round trip
        np.testing.assert_array_equal(a, 1.0)
        np.testing.assert_array_equal(b, 2.0)
        assert c.pull_many([("a", a)]) == 0
        status = c.get_status()
        assert status.global_step == 0 and status.workers_connected == 1 and status.is_chief
        assert status.config.replicas_to_aggregate == 1 and status.ready
        placement = c.placement("b")
        assert placement.shape == (2, 2) and placement.dtype == "float64" and not placement.sliced
        assert [v.name for v in c.placement_map().variables] == ["a", "b"]
        assert c.worker_devices() == ["w0"]
        c.set_learning_rate(0.1)
        with pytest.raises(psclient.FailedPrecondition):
            c.request_checkpoint()  # psd runs without --checkpoint-dir


def test_distribution_primitives(psd):
    with connect(psd) as c:
        c.create_variable("total", shape=(2,), trainable=False)
        result = np.empty(2, np.float32)
        r = c.reduce_to("sum", 0, np.array([1.0, 2.0], np.float32), "total", result)
        assert r.accepted
        np.testing.assert_array_equal(result, [1.0, 2.0])
        c.broadcast_to(np.array([5.0, 6.0], np.float32), ["total"])
        out = np.empty(2, np.float32)
        c.pull("total", out)
        np.testing.assert_array_equal(out, [5.0, 6.0])
        assert c.update("total", "assign_add", np.array([1.0, 1.0], np.float32))
        assert c.update("total", "scale", factor=2.0)
        c.pull("total", out)
        np.testing.assert_array_equal(out, [12.0, 14.0])
        c.create_variable("m", shape=(1,), trainable=False)
        results = c.batch_reduce_to("mean", 1, [(np.array([3.0], np.float32), "m", None),
                                                (np.array([4.0, 4.0], np.float32), "total")])
        assert [x.accepted for x in results] == [True, True]
        with c.colocate_vars_with("total"):
            c.create_variable("near", shape=(1,))
        assert c.placement("near").parts[0].shard == 0


def test_raw_tensor_host_memory(psd):
    with connect(psd) as c:
        src = np.array([1.5, 2.5, 3.5], np.float32)
        raw = psclient.RawTensor(src.ctypes.data, "float32", (3,), owner=src)
        assert raw.owner is src and raw.nbytes == 12 and raw.device == "cpu" and raw.shape == (3,)
        c.create_variable("r", raw)
        dst = np.zeros(3, np.float32)
        c.pull("r", psclient.RawTensor(dst.ctypes.data, "float32", [3], owner=dst))
        np.testing.assert_array_equal(dst, src)
        with pytest.raises(psclient.InvalidArgument):
            psclient.RawTensor(0, "int8", (1,))
        with pytest.raises(psclient.InvalidArgument, match="device"):
            psclient.RawTensor(src.ctypes.data, "float32", (3,), device="tpu")


def test_close_is_idempotent_and_calls_after_close_fail(psd):
    c = connect(psd)
    c.create_variable("w", shape=(1,))
    assert not c.closed
    c.close()
    c.close()
    assert c.closed
    with pytest.raises(psclient.FailedPrecondition, match="closed"):
        c.pull("w", np.zeros(1, np.float32))
    with pytest.raises(psclient.FailedPrecondition):
        c.is_chief
    with connect(psd) as again:  # a new client works after the old one closed
        out = np.ones(1, np.float32)
        again.pull("w", out)
        assert out[0] == 0
    with pytest.raises(psclient.FailedPrecondition):
        again.global_step()


def test_launch_environment(monkeypatch, psd):
    monkeypatch.setenv("PSD_CLUSTER", f"127.0.0.1:{psd.port}")
    monkeypatch.setenv("PSD_WORKER_INDEX", "0")
    monkeypatch.setenv("PSD_NUM_WORKERS", "1")
    env = psclient.read_launch_environment()
    assert (env.worker_index, env.num_workers) == (0, 1)
    assert env.client_options["worker_name"] == "worker-0"
    with psclient.Client.from_environment() as c:
        assert c.worker_devices() == ["worker-0"]
    monkeypatch.setenv("PSD_WORKER_INDEX", "x")
    with pytest.raises(psclient.InvalidArgument, match="PSD_WORKER_INDEX"):
        psclient.read_launch_environment()


def test_close_while_another_thread_waits(start_psd):
    # close() on one thread while a call blocks on another: the call ends by its own deadline
    # (or, if close() came first, with FailedPrecondition) — never a crash or a hang.
    daemon = start_psd("-R", "2", "-N", "2", "--init-tokens", "0")
    c = connect(daemon)
    outcome = []

    def wait():
        try:
            outcome.append(c.wait_token(timeout_ms=300))
        except psclient.Error as e:
            outcome.append(e)

    t = threading.Thread(target=wait)
    t.start()
    c.close()
    t.join(timeout=30)
    assert not t.is_alive()
    assert isinstance(outcome[0], (psclient.DeadlineExceeded, psclient.FailedPrecondition)), outcome
    with connect(daemon) as again:
        assert again.global_step() == 0


def test_slots_averages_and_shard_status(start_psd):
    daemon = start_psd("--optimizer", "momentum", "--momentum", "0.9", "--learning-rate", "0.5",
                       "--ema-decay", "0.5", "--init-tokens", "0")
    with connect(daemon) as c:
        assert c.slot_names == c.config.slot_names and len(c.slot_names) == 1
        c.create_variable("w", np.ones(3, np.float32), average=True)
        grad = np.array([1.0, 2.0, -2.0], np.float32)
        assert c.push(0, {"w": grad}, wait_token=True).token == 1
        slot = np.zeros(3, np.float32)
        c.get_slot("w", c.slot_names[0], slot)
        np.testing.assert_allclose(slot, grad)  # the first momentum accumulator is the gradient
        value, average = np.empty(3, np.float32), np.empty(3, np.float32)
        c.pull("w", value)
        assert c.pull_averages({"w": average}) == 1
        assert not np.array_equal(average, value)  # the average lags the value
        status = c.get_shard_status(0)
        assert status.shard_index == 0 and status.global_step == 1
        assert c.config.ema_decay == 0.5


def test_cluster_of_two_shards(start_cluster):
    # A variable sliced by rows over both shards: the client fans every call out and back.
    cluster = start_cluster(2, "--slice-bytes", "4K", "--init-tokens", "0", "--learning-rate", "0.5")
    with psclient.Client(cluster=cluster.split(","), connect_timeout_ms=20000, request_timeout_ms=30000) as c:
        assert c.shards == 2 and c.chief_shard >= 0
        assert c.parameter_devices == cluster.split(",")
        init = np.arange(4096, dtype=np.float32).reshape(1024, 4)
        c.create_variable("w", init)
        placement = c.placement("w")
        assert placement.sliced and [p.shard for p in placement.parts] == [0, 1]
        assert [(p.row_begin, p.row_end) for p in placement.parts] == [(0, 512), (512, 1024)]
        assert sum(c.placement_map().shard_bytes) == init.nbytes
        values = np.empty_like(init)
        out = c.push(0, {"w": np.ones_like(init)}, wait_token=True, pull_after={"w": values})
        assert out.token == 1 and out.pulled_step == 1
        np.testing.assert_array_equal(values, init - 0.5)
        rows = np.empty((2, 4), np.float32)
        c.pull_rows("w", [1023, 0], rows)
        np.testing.assert_array_equal(rows, (init - 0.5)[[1023, 0]])
        assert c.get_status().cluster_state == "running"


def test_tls_and_client_certificates(start_psd, tmp_path):
    certs = tmp_path / "certs"
    subprocess.run([str(REPO / "deploy" / "make_tls_certs.sh"), str(certs)], check=True, timeout=60)
    daemon = start_psd("--tls-cert-file", certs / "server.pem", "--tls-key-file", certs / "server.key",
                       "--tls-ca-file", certs / "ca.pem", "--tls-require-client-cert")
    with connect(daemon, tls_ca_file=str(certs / "ca.pem"), tls_cert_file=str(certs / "client.pem"),
                 tls_key_file=str(certs / "client.key")) as c:
        c.create_variable("w", np.ones(2, np.float32))
        assert c.global_step() == 0
    with pytest.raises(psclient.Unavailable, match="certificate"):  # no client certificate: refused
        connect(daemon, tls_ca_file=str(certs / "ca.pem"), connect_timeout_ms=2000)
