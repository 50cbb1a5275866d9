"""psclient's errors: the class for every psd status code, and each code provoked through a real psd."""
import os
import signal
import threading
import time

import numpy as np
import pytest

import psclient

# psd/status.h's codes, by number, with the class psclient raises for each.
EXPECTED = {
    1: ("INVALID_ARGUMENT", psclient.InvalidArgument),
    2: ("NOT_FOUND", psclient.NotFound),
    3: ("ALREADY_EXISTS", psclient.AlreadyExists),
    4: ("FAILED_PRECONDITION", psclient.FailedPrecondition),
    5: ("DEADLINE_EXCEEDED", psclient.DeadlineExceeded),
    6: ("UNAVAILABLE", psclient.Unavailable),
    7: ("CANCELLED", psclient.Cancelled),
    8: ("OUT_OF_RANGE", psclient.OutOfRange),
    9: ("RESOURCE_EXHAUSTED", psclient.ResourceExhausted),
    10: ("INTERNAL", psclient.Internal),
    11: ("UNIMPLEMENTED", psclient.Unimplemented),
    12: ("UNAUTHENTICATED", psclient.Unauthenticated),
    13: ("ABORTED", psclient.Aborted),
}


def connect(port, **kwargs):
    kwargs.setdefault("connect_timeout_ms", 5000)
    kwargs.setdefault("request_timeout_ms", 30000)
    return psclient.Client("127.0.0.1", port, **kwargs)


# --- the mapping table ----------------------------------------------------------------------------

@pytest.mark.parametrize("value", sorted(EXPECTED))
def test_every_code_raises_its_class(value):
    name, cls = EXPECTED[value]
    assert psclient.code_name(value) == name  # psd::CodeName agrees with the table
    assert (cls.code, cls.code_value) == (name, value)
    with pytest.raises(cls) as e:
        psclient._core._raise_status(value, "the daemon's words")
    assert type(e.value) is cls
    assert isinstance(e.value, psclient.Error)
    assert (e.value.code, e.value.message) == (name, "the daemon's words")
    assert str(e.value) == f"{name}: the daemon's words"
    assert type(psclient.error_for(value, "m")) is cls


def test_the_table_covers_every_code():
    assert {cls.code_value for cls in psclient.ERRORS} == set(EXPECTED)
    assert psclient.code_name(0) == "OK"
    assert psclient.code_name(14) == "UNKNOWN"  # psd has no code 14: the table is complete
    unknown = psclient.error_for(99, "from a newer psd")
    assert type(unknown) is psclient.Error and unknown.code == "CODE_99"
    assert issubclass(psclient.InvalidArgument, ValueError)  # bad arguments read as Python's


# --- provoked through a real daemon ---------------------------------------------------------------

def test_refused_port_is_unavailable(refused_port):
    with pytest.raises(psclient.Unavailable, match=f"127.0.0.1:{refused_port}"):
        connect(refused_port, connect_timeout_ms=300)


def test_dead_daemon_is_unavailable(psd):
    c = connect(psd.port, connect_timeout_ms=500)
    c.create_variable("w", shape=(2,))
    psd.kill()
    with pytest.raises(psclient.Unavailable):
        c.pull("w", np.zeros(2, np.float32))
    c.close()


def test_wrong_auth_token_is_unauthenticated(start_psd, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("the-right-secret-1234\n")
    token_file.chmod(0o600)
    daemon = start_psd("--auth-token-file", token_file)
    with pytest.raises(psclient.Unauthenticated) as e:
        connect(daemon.port, auth_token="a-wrong-secret")
    assert e.value.message  # the daemon's text
    with pytest.raises(psclient.Unauthenticated):
        connect(daemon.port)  # none at all
    with connect(daemon.port, auth_token="the-right-secret-1234") as c:
        assert c.global_step() == 0


def test_too_big_tensor_is_resource_exhausted(start_psd):
    daemon = start_psd("--max-frame-bytes", "64K", "-N", "2")
    # A client that sends requests whole (push_frame_bytes=0) is told which flag to raise.
    with connect(daemon.port, push_frame_bytes=0, worker_name="whole") as c:
        with pytest.raises(psclient.ResourceExhausted, match="--max-frame-bytes 64 KiB") as e:
            c.create_variable("big", np.zeros(100_000, np.float32))  # 400 KB in one frame
    with connect(daemon.port, worker_name="chunks") as c:
        # By default a value and a push bigger than a frame travel in several: a 400 KB initial
        # value, two 40 KB gradients and a 400 KB one (cut into chunks).
        big = np.arange(100_000, dtype=np.float32)
        c.create_variable("big", big)
        got = np.zeros_like(big)
        c.pull("big", got)
        np.testing.assert_array_equal(got, big)
        grads = {name: np.ones(10_000, np.float32) for name in ("a", "b")}
        for name, grad in grads.items():
            c.create_variable(name, grad)
        grads["big"] = np.ones(100_000, np.float32)
        assert c.push(0, grads).accepted == 3
    # The daemon's own refusal: more than the variables may take.
    daemon = start_psd("--max-model-bytes", "1M")
    with connect(daemon.port) as c:
        with pytest.raises(psclient.ResourceExhausted, match="max-model-bytes") as e:
            c.create_variable("huge", shape=(1_000_000,))
        assert "huge" in e.value.message


def test_unknown_variable_is_not_found(psd):
    with connect(psd.port) as c:
        with pytest.raises(psclient.NotFound, match="nope"):
            c.pull("nope", np.zeros(1, np.float32))
        c.create_variable("w", shape=(1,))
        with pytest.raises(psclient.NotFound):
            c.get_slot("w", "no-such-slot", np.zeros(1, np.float32))


def test_mismatched_create_is_already_exists(psd):
    with connect(psd.port) as c:
        c.create_variable("w", shape=(3,))
        with pytest.raises(psclient.AlreadyExists, match="w"):
            c.create_variable("w", shape=(4,))
        with pytest.raises(psclient.AlreadyExists):
            c.create_variable("w", shape=(3,), dtype="float64")


def test_daemon_side_invalid_argument(psd):
    with connect(psd.port) as c:
        with pytest.raises(psclient.InvalidArgument, match="nope"):
            c.create_variable("w", shape=(2,), optimizer="nope")
        with pytest.raises(psclient.InvalidArgument):
            c.create_variable("s", shape=(2,), aggregation="max")  # not one of psd's


def test_token_timeouts_are_deadline_exceeded(start_psd):
    # R = N = 2 and one worker: no step can complete, so waits time out.
    daemon = start_psd("-R", "2", "-N", "2", "--init-tokens", "0")
    with connect(daemon.port, worker_name="w0") as c:
        c.create_variable("w", shape=(2,))
        out = c.push(0, {"w": np.ones(2, np.float32)}, wait_token=True, timeout_ms=50)
        assert out.accepted == 1 and out.waited  # the push itself succeeded: not raised
        assert isinstance(out.token_status, psclient.DeadlineExceeded)
        assert out.token_status.code == "DEADLINE_EXCEEDED" and out.token_status.message
        with pytest.raises(psclient.DeadlineExceeded):
            c.wait_token(timeout_ms=50)
        assert c.global_step() == 0  # nothing was lost, the client still works


def test_training_over_is_out_of_range(psd):
    with connect(psd.port) as c:
        c.create_variable("w", shape=(2,))
        c.finish()  # the job's only worker: the token queue closes
        with pytest.raises(psclient.OutOfRange, match="training is over"):
            c.wait_token(timeout_ms=5000)
        out = c.push(0, {"w": np.ones(2, np.float32)}, wait_token=True, timeout_ms=5000)
        assert isinstance(out.token_status, psclient.OutOfRange)


def test_shutdown_cancels_a_parked_wait(start_psd):
    daemon = start_psd("-R", "2", "-N", "2", "--init-tokens", "0")
    with connect(daemon.port, worker_name="w0") as c, connect(daemon.port, observer=True) as observer:
        c.create_variable("w", shape=(2,))
        result = {}

        def push_and_wait():
            try:
                result["out"] = c.push(0, {"w": np.ones(2, np.float32)}, wait_token=True, timeout_ms=60000)
            except BaseException as e:
                result["out"] = e

        t = threading.Thread(target=push_and_wait)
        t.start()
        deadline = time.monotonic() + 30
        while observer.get_status().accepted_pushes < 1:  # the push (and its wait) reached psd
            assert time.monotonic() < deadline, "the push never reached psd"
            time.sleep(0.01)
        os.kill(daemon.pid, signal.SIGTERM)
        t.join(timeout=60)
        assert not t.is_alive()
        assert isinstance(result["out"], psclient.PushOutcome), result["out"]
        assert isinstance(result["out"].token_status, psclient.Cancelled)
        assert "shutting down" in result["out"].token_status.message


def test_failed_preconditions(psd):
    with connect(psd.port) as c:
        with pytest.raises(psclient.FailedPrecondition, match="checkpoint"):
            c.request_checkpoint()
        with pytest.raises(psclient.FailedPrecondition):
            c.recover()  # no operator decision is awaited by a single psd


def test_device_memory_without_cuda_is_unimplemented(psd):
    # The CPU-only libpsclient (PSD_WITH_CUDA=OFF, the default) answers UNIMPLEMENTED for device views.
    with connect(psd.port) as c:
        c.create_variable("w", shape=(2,))
        device = psclient.RawTensor(0x1000, "float32", (2,), device="cuda")
        with pytest.raises(psclient.Unimplemented):
            c.pull("w", device)
