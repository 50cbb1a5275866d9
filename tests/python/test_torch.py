"""psclient.torch against torch's own optimizers: a model trained through psd ends where one process
training on the full batch ends (README "Python": "PyTorch").

Every test owns its psd (conftest's start_psd: 127.0.0.1, port 0, --port-file) and its worker threads, each with its
own psclient.Client (the binding releases the GIL during calls). Deterministic: the workers
synchronise through psd's tokens; the straggler of the backup test waits for a condition (the
global step moving past its gradients), never for a time.
"""

import copy
import math
import os
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
psclient = pytest.importorskip("psclient")
pst = pytest.importorskip("psclient.torch")

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
DEADLINE_S = 60  # every wait in this file is bounded by this


def _client(d, name):
    """A worker's own Client to daemon d (conftest's start_psd)."""
    return psclient.Client("127.0.0.1", d.port, worker_name=name)


# Lockstep: without init tokens (psd --init-tokens 0, the least TF allows when R = N) a worker's
# first token comes with step 1, so every push of every worker is fresh and lands in its step.
# (TF's default, R init tokens, lets each worker run one push ahead on the initial values.)
LOCKSTEP = ("--init-tokens", 0)


def _run_workers(fns):
    """Runs fns[i]() in a thread each; re-raises the first failure; bounded in time."""
    errors, results = [None] * len(fns), [None] * len(fns)

    def body(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: B902 - reported in the main thread
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S * 2)
        assert not t.is_alive(), "a worker thread did not finish (psd's waits are bounded: see its errors)"
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if failed:
        # The cause first: a worker that failed makes the others time out waiting for its push.
        failed.sort(key=lambda ie: isinstance(ie[1], psclient.DeadlineExceeded))
        i, e = failed[0]
        raise AssertionError("worker %d failed: %r; all failures: %s"
                             % (i, e, ["worker %d: %r" % f for f in failed])) from e
    return results


# ----------------------------------------------------------------------------- models and data
def _mlp():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(steps, rows, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(steps)]


def _reference(model, batches, make_opt):
    """One process, the full batch, a torch optimizer."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _train_sync(d, model, batches, workers=2, grad_dtype=None, after=None, overlap=False, shared_buffers=False):
    """`workers` threads, each on its share of every batch, through SyncReplicasOptimizer.
    Returns the workers' models and their step outcomes."""
    clients = [_client(d, "worker-%d" % i) for i in range(workers)]  # worker 0 says hello first: chief
    assert clients[0].is_chief

    def worker(i):
        m = copy.deepcopy(model)
        if i > 0:  # the non-chief workers' own values are overwritten by the chief's
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1.0)
        opt = pst.SyncReplicasOptimizer(clients[i], m.named_parameters(), prefix="m/", timeout_ms=DEADLINE_S * 1000,
                                        grad_dtype=grad_dtype, overlap=overlap, shared_buffers=shared_buffers)
        opt.initialize()
        outcomes = []
        progress[i] = outcomes
        for x, y in batches:
            part = x.shape[0] // workers
            xs, ys = x[i * part:(i + 1) * part], y[i * part:(i + 1) * part]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(xs), ys).backward()
            outcomes.append(opt.step())
        # what psd holds is what this worker holds
        for name, value in opt.state_dict().items():
            assert torch.equal(value, dict(m.named_parameters())[name[len("m/"):]].detach()), name
        if after is not None:
            after(opt)
        opt.close()
        return m, outcomes, opt

    progress = [None] * workers
    try:
        return _run_workers([lambda i=i: worker(i) for i in range(workers)])
    except AssertionError as e:
        raise AssertionError("%s; the workers' step outcomes: %s" % (e, progress)) from e
    finally:
        for c in clients:
            c.close()


def _assert_params_close(model, ref, atol, rtol=0):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        diff = (p.detach().double() - q.detach().double()).abs().max().item()
        assert torch.allclose(p.detach().double(), q.detach().double(), atol=atol, rtol=rtol), \
            "%s differs from the reference by %g (atol %g)" % (name, diff, atol)


# ----------------------------------------------------------------------------- (a) SGD
@pytest.mark.parametrize("overlap", [False, True], ids=["push_in_step", "overlap"])
def test_sgd_two_workers_match_full_batch_torch_sgd(start_psd, overlap):
    lr, steps = 0.1, 6
    d = start_psd(*LOCKSTEP, "-R", 2, "-N", 2, "--optimizer", "sgd", "--learning-rate", lr)
    model, batches = _mlp(), _batches(steps, 32)
    results = _train_sync(d, model, batches, overlap=overlap)
    ref = _reference(model, batches, lambda ps: torch.optim.SGD(ps, lr=lr))
    for m, outcomes, opt in results:
        assert len(outcomes) == steps and all(o is not None and o.stale == 0 for o in outcomes)
        assert all(o.accepted == 4 for o in outcomes)  # every parameter's gradient, once
        if overlap:  # three pushed during backward, the last with the token
            assert all(isinstance(o, pst.StepOutcome) and o.pushes == 4 for o in outcomes)
        assert [o.token for o in outcomes] == list(range(1, steps + 1))
        assert opt.local_step == steps and opt.stale_total == 0
        # float32 sums in another order than torch's full-batch kernels: a few ulps per step.
        _assert_params_close(m, ref, atol=2e-6)


@pytest.mark.parametrize("overlap", [False, True], ids=["push_in_step", "overlap"])
def test_shared_buffers_train_like_copies_with_gradients_and_values_in_place(start_psd, overlap):
    lr, steps = 0.1, 4
    model, batches = _mlp(), _batches(steps, 32)
    copied = _train_sync(start_psd(*LOCKSTEP, "-R", 2, "-N", 2, "--learning-rate", lr), model, batches,
                         overlap=overlap)
    checked = []

    def check(opt):
        # Every parameter and its gradient still live where _share_memory put them before the
        # first step: autograd accumulated into the shared gradients and psd wrote the values in
        # place (nothing was re-allocated or staged).
        assert opt.shared_parameters == 4
        for p, (value, grad) in zip(opt._params, opt._shared):
            assert p.param.data_ptr() == value.data_ptr() and p.param.grad.data_ptr() == grad.data_ptr(), p.name
        checked.append(opt)

    shared = _train_sync(start_psd(*LOCKSTEP, "-R", 2, "-N", 2, "--learning-rate", lr), model, batches,
                         overlap=overlap, shared_buffers=True, after=check)
    for (m, _, _), (s_m, outcomes, opt) in zip(copied, shared):
        assert opt.client is not None and len(outcomes) == steps
        # The same sums in the same order: bit-identical to the run with copies.
        for (name, p), (_, q) in zip(m.named_parameters(), s_m.named_parameters()):
            assert torch.equal(p.detach(), q.detach()), name
    assert len(checked) == 2


# ----------------------------------------------------------------------------- (b) Adam
def _tf_adam_reference(model, batches, lr, b1, b2, eps):
    """psd's Adam is TF's ApplyAdam (README "Optimizers"): lr_t = lr sqrt(1-b2^t)/(1-b1^t);
    v -= lr_t m / (sqrt(v) + eps) -- TF's epsilon-hat. Computed in float64 here."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    w = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, (x, y) in enumerate(batches, start=1):
        with torch.no_grad():
            for p, wi in zip(params, w):
                p.copy_(wi)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        lr_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        for i, p in enumerate(params):
            g = p.grad.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            w[i] = w[i] - lr_t * m[i] / (v[i].sqrt() + eps)
    with torch.no_grad():
        for p, wi in zip(params, w):
            p.copy_(wi)
    return model


def _max_diff(a, b):
    return max((p.detach().double() - q.detach().double()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("eps", [1e-8, 1e-12])
def test_adam_two_workers_match_tf_adam_and_torch_adam(start_psd, eps):
    """psd's Adam is TF's: v -= lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps) (epsilon-hat).
    torch.optim.Adam divides by sqrt(v)/sqrt(1-b2^t) + eps, which is TF's formula with
    eps_hat = eps sqrt(1-b2^t): the two differ only where eps is not small against sqrt(v), i.e.
    for near-zero gradients (this model's smallest is ~6e-6). With the default eps = 1e-8 psd
    matches the TF-formula reference and NOT torch's (they differ by ~5e-4 here, on a bias whose
    gradient is ~1e-5); with eps = 1e-12 the placement is immaterial and psd matches
    torch.optim.Adam(eps=1e-12) as tightly as the TF reference."""
    lr, b1, b2, steps = 0.01, 0.9, 0.999, 6
    d = start_psd(*LOCKSTEP, "-R", 2, "-N", 2, "--optimizer", "adam", "--learning-rate", lr, "--beta1", b1, "--beta2", b2,
            "--epsilon", eps)
    model, batches = _mlp(), _batches(steps, 32)
    def slots(opt):  # psd's Adam state: the m and v slots
        assert opt.get_slot("m/0.weight", "m").shape == (16, 8)
        assert opt.get_slot("m/0.weight", "v").abs().sum() > 0
        assert opt.get_slot("m/0.weight", "nope") is None

    results = _train_sync(d, model, batches, after=slots)
    tf_ref = _tf_adam_reference(model, batches, lr, b1, b2, eps)
    torch_ref = _reference(model, batches, lambda ps: torch.optim.Adam(ps, lr=lr, betas=(b1, b2), eps=eps))
    # psd computes in float32 (the reference in float64), from gradients summed in another order:
    # Adam's m/sqrt(v) magnifies the relative rounding of small gradients; 2e-6 absolute on
    # parameters of size ~0.3 after 6 steps of ~0.01 is ~100 float32 ulps.
    tol = 2e-6
    for m, outcomes, _ in results:
        assert all(o.stale == 0 for o in outcomes)
        _assert_params_close(m, tf_ref, atol=tol)
        if eps == 1e-12:
            _assert_params_close(m, torch_ref, atol=tol)
        else:
            assert _max_diff(m, torch_ref) > 10 * tol  # epsilon's placement is visible: TF's, not torch's


# ----------------------------------------------------------------------------- (c) backups
def test_backup_workers_loss_falls_and_stale_pushes_reported(start_psd):
    lr, steps, workers = 0.5, 20, 4
    d = start_psd("-R", 2, "-B", 2, "--optimizer", "sgd", "--learning-rate", lr)
    model = _mlp()
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(512, 8, generator=g)
    y_all = (x_all[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)  # learnable labels
    clients = [_client(d, "worker-%d" % i) for i in range(workers)]
    straggler = workers - 1

    def loss_of(m):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(m(x_all), y_all).item()

    initial_loss = loss_of(model)

    def worker(i):
        m = copy.deepcopy(model)
        opt = pst.SyncReplicasOptimizer(clients[i], m.named_parameters(), timeout_ms=DEADLINE_S * 1000)
        opt.initialize()
        gen = torch.Generator().manual_seed(100 + i)
        outcomes = []
        while opt.local_step < steps:
            rows = torch.randint(0, 512, (32,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x_all[rows]), y_all[rows]).backward()
            if i == straggler:
                # The straggler's gradients arrive after the step they were computed for has
                # committed (the other three make it: R = 2): a condition, awaited with a bound.
                deadline = time.monotonic() + DEADLINE_S
                while clients[i].global_step() <= opt.local_step:
                    assert time.monotonic() < deadline, "the other workers did not complete a step"
                    time.sleep(0.002)
            outcomes.append(opt.step())
        return m, outcomes, opt

    try:
        results = _run_workers([lambda i=i: worker(i) for i in range(workers)])
    finally:
        for c in clients:
            c.close()
    final_losses = [loss_of(m) for m, _, _ in results]
    # Every worker ends holding a model that learned (the last token's values; the workers stop at
    # slightly different steps only if a token carried an older step).
    assert max(final_losses) < 0.7 * initial_loss, (initial_loss, final_losses)
    _, s_outcomes, s_opt = results[straggler]
    # Every push of the straggler came too late: reported as stale, per gradient, with staleness.
    assert len(s_outcomes) >= 1
    for o in s_outcomes:
        assert o.accepted == 0 and o.stale == len(o.results)
        assert all(not r.accepted and r.staleness >= 1 for r in o.results)
    assert s_opt.stale_total == sum(len(o.results) for o in s_outcomes) and s_opt.accepted_total == 0
    # The others' pushes made the steps: at least R fresh ones per variable per step.
    accepted = sum(opt.accepted_total for _, _, opt in results)
    n_vars = len(list(model.parameters()))
    assert accepted >= 2 * steps * n_vars


# ----------------------------------------------------------------------------- (d) sparse
class _EmbModel(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(4)
        self.emb = torch.nn.Embedding(10, 4, sparse=sparse)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, idx):
        return self.out(self.emb(idx))


@pytest.mark.parametrize("overlap", [False, True], ids=["push_in_step", "overlap"])
def test_sparse_embedding_matches_dense_full_batch(start_psd, overlap):
    lr, steps = 0.5, 5
    d = start_psd(*LOCKSTEP, "-R", 2, "-N", 2, "--optimizer", "sgd", "--learning-rate", lr)
    g = torch.Generator().manual_seed(8)
    # psd averages each row over the gradients that contained it (TF's SparseConditionalAccumulator):
    # the full-batch mean equals it when every row a worker touches is touched by the other too,
    # so each half holds every index (in its own order, with repeats).
    batches = []
    for _ in range(steps):
        halves = [torch.cat([torch.randperm(10, generator=g), torch.randint(0, 10, (6,), generator=g)])
                  for _ in range(2)]
        idx = torch.cat(halves)
        batches.append((idx, torch.randint(0, 3, (idx.shape[0],), generator=g)))
    model = _EmbModel(sparse=True)
    dense_model = _EmbModel(sparse=False)
    dense_model.load_state_dict(model.state_dict())
    clients = [_client(d, "worker-%d" % i) for i in range(2)]

    def worker(i):
        m = copy.deepcopy(model)
        opt = pst.SyncReplicasOptimizer(clients[i], m.named_parameters(), timeout_ms=DEADLINE_S * 1000,
                                        overlap=overlap)
        opt.initialize()
        for idx, y in batches:
            half = idx.shape[0] // 2
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(idx[i * half:(i + 1) * half]), y[i * half:(i + 1) * half]).backward()
            assert m.emb.weight.grad.is_sparse
            o = opt.step()
            assert o.stale == 0 and o.accepted == 3
        opt.close()
        return m

    try:
        results = _run_workers([lambda i=i: worker(i) for i in range(2)])
    finally:
        for c in clients:
            c.close()
    ref = dense_model
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for idx, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(idx), y).backward()
        opt.step()
    for m in results:
        _assert_params_close(m, ref, atol=2e-6)


def test_sparse_gradient_of_a_sparse_embedding_goes_as_indexed_slices(start_psd):
    """Only the touched rows move (psd applies sparse updates lazily, to the rows it got)."""
    d = start_psd("-R", 1, "-N", 1, "--optimizer", "sgd", "--learning-rate", 1.0)
    with _client(d, "w") as c:
        emb = torch.nn.Embedding(6, 2, sparse=True)
        before = emb.weight.detach().clone()
        opt = pst.SyncReplicasOptimizer(c, [("emb", emb.weight)])
        opt.initialize()
        emb(torch.tensor([4, 1, 4])).sum().backward()
        o = opt.step()
        assert o.accepted == 1 and o.stale == 0
        after = emb.weight.detach()
        expected = before.clone()
        expected[1] -= 1.0
        expected[4] -= 2.0  # two lookups of row 4 sum in the coalesced gradient
        assert torch.equal(after, expected)


# ----------------------------------------------------------------------------- (e) half precision
def _round_to(x32, dtype):
    """float32 -> dtype, round to nearest even (torch's conversion), computed in the test."""
    return x32.to(dtype)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_half_gradients_into_float32_variables_pulled_as_half(start_psd, half):
    """Master weights: the parameters and gradients are half precision; psd keeps float32
    variables, sums the gradients in float32 and hands the values back rounded to the half dtype."""
    dtype = getattr(torch, half)
    lr, steps = 0.25, 4
    d = start_psd(*LOCKSTEP, "-R", 2, "-N", 2, "--optimizer", "sgd", "--learning-rate", lr)
    g = torch.Generator().manual_seed(21)
    init = torch.randn(3, 5, generator=g).to(dtype)
    # gradients with bits below the half dtype's precision once summed: rounding matters
    grads = [[(torch.randn(3, 5, generator=g) * 0.37).to(dtype) for _ in range(2)] for _ in range(steps)]
    clients = [_client(d, "worker-%d" % i) for i in range(2)]

    def worker(i):
        p = torch.nn.Parameter(init.clone())
        opt = pst.SyncReplicasOptimizer(clients[i], [("w", p)], timeout_ms=DEADLINE_S * 1000)
        opt.initialize()
        seen = []
        for s in range(steps):
            p.grad = grads[s][i].clone()
            opt.step()
            assert p.dtype == dtype
            seen.append(p.detach().clone())
        return seen, opt.state_dict()

    try:
        results = _run_workers([lambda i=i: worker(i) for i in range(2)])
    finally:
        for c in clients:
            c.close()
    # The reference: float32 master, float32 sum of the half gradients, mean, sgd, round to dtype.
    master = init.to(torch.float32)
    expected = []
    for s in range(steps):
        total = grads[s][0].to(torch.float32) + grads[s][1].to(torch.float32)
        master = master - torch.tensor(lr, dtype=torch.float32) * (total / 2)
        expected.append(_round_to(master, dtype))
    for seen, state in results:
        for s in range(steps):
            assert torch.equal(seen[s], expected[s]), "step %d: %s vs %s" % (s + 1, seen[s], expected[s])
        # psd holds the float32 master
        assert state["w"].dtype == torch.float32
        assert torch.equal(state["w"], master)


def test_bfloat16_grad_dtype_for_float32_parameters(start_psd):
    """grad_dtype=torch.bfloat16: float32 parameters push bfloat16 gradients (half the bytes)."""
    d = start_psd("-R", 1, "-N", 1, "--optimizer", "sgd", "--learning-rate", 1.0)
    with _client(d, "w") as c:
        p = torch.nn.Parameter(torch.zeros(4))
        opt = pst.SyncReplicasOptimizer(c, [("w", p)], grad_dtype=torch.bfloat16)
        opt.initialize()
        p.grad = torch.tensor([1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9, -0.1, 3.0])
        opt.step()
        expected = -p.grad.to(torch.bfloat16).to(torch.float32)
        assert p.dtype == torch.float32 and torch.equal(p.detach(), expected)


# ----------------------------------------------------------------------------- psd lost the variables
def test_psd_restarted_empty_chief_recreates_from_its_parameters(start_psd, tmp_path):
    """psd came back without its checkpoints (same address): step() drops the batch, the chief
    re-creates the variables from its parameters, every parameter is re-pulled, training goes on."""
    import signal
    import subprocess
    d = start_psd("-R", 1, "-N", 1, "--init-tokens", 0, "--learning-rate", 1.0)
    port = d.port
    binary = d.proc.args[0]
    with _client(d, "w") as c:
        p = torch.nn.Parameter(torch.zeros(3))
        opt = pst.SyncReplicasOptimizer(c, [("w", p)], timeout_ms=DEADLINE_S * 1000)
        opt.initialize()
        p.grad = torch.ones(3)
        assert opt.step().accepted == 1
        assert torch.equal(p.detach(), -torch.ones(3))
        d.kill()
        port_file = tmp_path / "port2"
        again = subprocess.Popen([binary, "--port", str(port), "--port-file", str(port_file), "-R", "1",
                                  "--init-tokens", "0", "--learning-rate", "1.0"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not (port_file.exists() and port_file.read_text().strip()):
                if again.poll() is not None:  # someone took the freed port in between: rare
                    pytest.skip("port %d was taken before psd could restart on it" % port)
                assert time.monotonic() < deadline, "psd did not restart"
                time.sleep(0.01)
            p.grad = torch.full((3,), 5.0)
            out = None
            for _ in range(50):  # the client reconnects by itself; Unavailable while it does
                try:
                    out = opt.step()
                    break
                except psclient.Unavailable:
                    time.sleep(0.05)
            assert out is None  # the batch computed on the lost values is dropped
            assert opt.aborted_total == 1 and opt.recreated_total == 1
            assert torch.equal(p.detach(), -torch.ones(3))  # the chief's values, now psd's again
            p.grad = torch.ones(3)
            assert opt.step().accepted == 1
            assert torch.equal(p.detach(), -2 * torch.ones(3))
        finally:
            again.send_signal(signal.SIGKILL)
            again.wait(timeout=DEADLINE_S)


class _AbortingClient:
    """A stand-in Client whose push answers Aborted once (a cluster restored a checkpoint at
    step 7 with w = 3): what a real one does is covered by the tests above; this pins the
    wrapper's reaction."""

    class config:  # noqa: N801 - mirrors Client.config's attributes
        replicas_to_aggregate, total_replicas, init_tokens = 1, 1, 0

    is_chief, initial_global_step, connection_epoch = True, 0, 1

    def __init__(self):
        self.value, self.step, self.aborts, self.pushed_steps = 0.0, 0, 1, []

    def create_variable(self, name, initial):
        self.value = float(np.asarray(initial)[0])

    def pull_many(self, outs):
        for _, out in outs:
            out[...] = self.value
        return self.step

    def global_step(self):
        return self.step

    def push(self, local_step, grads, *, sparse, wait_token, timeout_ms, pull_after):
        self.pushed_steps.append(local_step)
        if self.aborts:
            self.aborts -= 1
            self.value, self.step = 3.0, 7  # the restored checkpoint
            raise psclient.Aborted("the cluster restored the checkpoint of step 7: pull the variables again")
        raise AssertionError("not reached in this test")


def test_aborted_push_repulls_values_and_step():
    c = _AbortingClient()
    p = torch.nn.Parameter(torch.zeros(2))
    opt = pst.SyncReplicasOptimizer(c, [("w", p)])
    opt.initialize()
    p.grad = torch.ones(2)
    with torch.no_grad():
        p.add_(5.0)  # whatever the worker holds is replaced by psd's values
    assert opt.step() is None
    assert opt.aborted_total == 1 and opt.local_step == 7 and c.pushed_steps == [0]
    assert torch.equal(p.detach(), torch.full((2,), 3.0))


# ----------------------------------------------------------------------------- API edges
def test_overlap_needs_one_backward_per_step(start_psd):
    d = start_psd("-R", 1, "-N", 1, "--init-tokens", 0, "--optimizer", "sgd", "--learning-rate", 1.0)
    with _client(d, "w") as c:
        lin = torch.nn.Linear(2, 1)
        opt = pst.SyncReplicasOptimizer(c, lin.named_parameters(), overlap=True)
        opt.initialize()
        x = torch.ones(1, 2)
        lin(x).sum().backward()
        lin(x).sum().backward()  # gradient accumulation: the first backward's grads already went
        with pytest.raises(RuntimeError, match="one backward per step"):
            opt.step()
        # The wrapper's state was reset (psd may hold the part of that step pushed early): the
        # next steps go through.
        for _ in range(2):
            opt.zero_grad()
            lin(x).sum().backward()
            assert opt.step() is not None
        opt.close()



def test_non_contiguous_parameter_is_staged_and_written_back(start_psd):
    d = start_psd("-R", 1, "-N", 1, "--optimizer", "sgd", "--learning-rate", 1.0)
    with _client(d, "w") as c:
        base = torch.zeros(4, 3)
        p = torch.nn.Parameter(base.t())  # 3 x 4, not contiguous
        assert not p.is_contiguous()
        opt = pst.SyncReplicasOptimizer(c, [("w", p)])
        opt.initialize()
        p.grad = torch.ones(3, 4)
        opt.step()
        assert torch.equal(p.detach(), -torch.ones(3, 4))


def test_errors_are_clear(start_psd):
    d = start_psd("-R", 2, "-N", 2)
    with _client(d, "w") as c:
        p = torch.nn.Parameter(torch.zeros(2))
        with pytest.raises(ValueError, match="replicas_to_aggregate=3"):
            pst.SyncReplicasOptimizer(c, [("w", p)], replicas_to_aggregate=3)
        with pytest.raises(TypeError, match="psd holds"):
            pst.SyncReplicasOptimizer(c, [("i", torch.zeros(2, dtype=torch.int32))])
        with pytest.raises(ValueError, match="at least one"):
            pst.SyncReplicasOptimizer(c, [])
        opt = pst.SyncReplicasOptimizer(c, [("w", p)])
        opt.initialize()
        with pytest.raises(ValueError, match="backward"):
            opt.step()
        assert opt.get_init_tokens() == 2
        with pytest.raises(ValueError, match="Too few tokens"):
            opt.get_init_tokens(-5)


def test_initialize_waits_for_the_chief_and_times_out_with_a_clear_error(start_psd):
    d = start_psd("-R", 2, "-N", 2)
    chief = _client(d, "chief")
    other = _client(d, "other")
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        opt = pst.SyncReplicasOptimizer(other, [("never", p)])
        assert not opt.is_chief
        with pytest.raises(psclient.NotFound, match="chief worker creates the variables"):
            opt.initialize(timeout_ms=200)
    finally:
        other.close()
        chief.close()


def test_cuda_memory_on_a_cpu_build_is_a_clear_unimplemented(start_psd):
    """The CPU-only client answers Unimplemented for device memory; the wrapper says what to do (a CUDA
    build where CUDA sees no device: FailedPrecondition naming CUDA_VISIBLE_DEVICES)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA path is exercised instead")
    d = start_psd("-R", 1, "-N", 1)
    with _client(d, "w") as c:
        host = torch.zeros(4)
        c.create_variable("w", host.numpy())
        fake = psclient.RawTensor(host.data_ptr(), "float32", (4,), device="cuda", stream=0, owner=host)
        with pytest.raises((psclient.Unimplemented, psclient.FailedPrecondition)) as e:
            c.pull("w", fake)
        if isinstance(e.value, psclient.FailedPrecondition):
            # A CUDA build of libpsclient on a machine whose CUDA sees no device says so instead.
            assert "CUDA_VISIBLE_DEVICES" in str(e.value)
            return
        with pytest.raises(psclient.Unimplemented, match="PSD_WITH_CUDA=ON"):
            pst._cuda_hint(e.value, "pull")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (torch.cuda.is_available() is False)")
def test_cuda_parameters_train_like_cpu(start_psd):
    """Where a GPU is at hand: a CUDA model through the wrapper (RawTensor on the current stream)
    ends where the CPU full-batch SGD reference ends; a client built without CUDA answers
    Unimplemented with the hint instead."""
    lr, steps = 0.1, 4
    d = start_psd(*LOCKSTEP, "-R", 1, "-N", 1, "--optimizer", "sgd", "--learning-rate", lr)
    model, batches = _mlp(), _batches(steps, 16)
    ref = _reference(model, batches, lambda ps: torch.optim.SGD(ps, lr=lr))
    m = copy.deepcopy(model).cuda()
    with _client(d, "w") as c:
        opt = pst.SyncReplicasOptimizer(c, m.named_parameters(), timeout_ms=DEADLINE_S * 1000)
        try:
            opt.initialize()
        except psclient.Unimplemented as e:
            assert "PSD_WITH_CUDA=ON" in str(e)
            pytest.skip("psclient built without CUDA: " + str(e))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # the wrapper uses whatever stream is current
            for x, y in batches:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x.cuda()), y.cuda()).backward()
                assert opt.step().stale == 0
        torch.cuda.synchronize()
    _assert_params_close(m.cpu(), ref, atol=1e-5)


def _imported_after_psclient(env_value):
    """Whether `import psclient` alone, in a fresh interpreter, left torch imported."""
    env = dict(os.environ)
    env.pop("PSCLIENT_TORCH_FIRST", None)
    if env_value is not None:
        env["PSCLIENT_TORCH_FIRST"] = env_value
    out = subprocess.run([sys.executable, "-c", "import sys, psclient; print('torch' in sys.modules)"], env=env,
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


def test_psclient_loads_torch_before_its_extension_unless_told_not_to():
    """README "Python": torch first where it is installed (an import order that crashed with PyTorch 2.11's wheel);
    PSCLIENT_TORCH_FIRST=0 leaves it out."""
    assert _imported_after_psclient(None)
    assert _imported_after_psclient("1")
    assert not _imported_after_psclient("0")
