"""psclient.torch: TensorFlow's SyncReplicasOptimizer over psd, for a PyTorch training loop.

The C++ ``psclient::SyncReplicasOptimizer`` (client/include/psclient/sync_replicas_optimizer.h)
in the shape a PyTorch trainer expects: wrap the model's parameters, keep the loop::

    client = psclient.Client.from_environment()          # under psrun; or Client(host, port)
    opt = psclient.torch.SyncReplicasOptimizer(client, model.named_parameters())
    opt.initialize()             # the chief creates the variables; everyone pulls them
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        out = opt.step()         # push grads tagged with the local step, wait for the token,
                                 # the new values land in the parameters' memory
        if out is None: continue # psd restored a checkpoint: parameters re-pulled, batch dropped

What the daemon does: the accumulators (mean over the fresh gradients), the optimizer (psd
--optimizer: sgd, adam, ...; the wrapper never updates a parameter itself), the global step and
the tokens. What stays here: the worker's local step, the push -> token -> pull loop, and the
variables' initial values (the chief's parameters).

Parameters and gradients:
  * CPU parameters, float32/float64/float16: pulled straight into the parameter's storage when it
    is contiguous (numpy view of the tensor, no copy); a non-contiguous one goes through one
    contiguous staging tensor and a copy_.
  * bfloat16 (and any dtype numpy cannot hold) goes as a psclient.RawTensor over the tensor's
    memory (data_ptr), never through numpy.
  * CUDA parameters: psclient.RawTensor(device="cuda", stream=torch.cuda.current_stream().cuda_stream):
    the client copies on the caller's current stream through its pinned staging buffers. A psd
    client built without CUDA answers Unimplemented; this wrapper turns that into a
    psclient.Unimplemented saying to rebuild with -DPSD_WITH_CUDA=ON or move the model to the CPU.
  * Sparse gradients (nn.Embedding(sparse=True)) go as IndexedSlices: coalesced, indices int64 and
    the rows' values. psd averages each row over the gradients that contained it (TF's
    SparseConditionalAccumulator) and applies the optimizer to the touched rows only.
  * Half precision (master weights): a float16/bfloat16 parameter gets a float32 variable on psd by
    default (``variable_dtype``); its gradients are pushed in the parameter's dtype (half the
    bytes), psd sums them in float32, and the pull asks for the values converted to the
    parameter's dtype (round to nearest even), so both directions carry half the bytes.
    ``grad_dtype=torch.bfloat16`` pushes float32 parameters' gradients as bfloat16 as well.

Thread-safety: none; one optimizer per worker thread, over its own Client.
"""

import time as _time

import torch as _torch

import psclient as _ps

__all__ = ["SyncReplicasOptimizer", "SyncReplicasHook", "StepOutcome", "torch_dtype_name", "raw_tensor"]

_DTYPE_NAMES = {
    _torch.float32: "float32",
    _torch.float64: "float64",
    _torch.float16: "float16",
    _torch.bfloat16: "bfloat16",
}
# dtypes numpy can view without a copy (bfloat16 cannot: it goes as a RawTensor).
_NUMPY_OK = (_torch.float32, _torch.float64, _torch.float16)


def torch_dtype_name(dtype):
    """psd's name for a torch dtype ("float32", "float64", "float16", "bfloat16")."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError("psd holds float32, float64, float16 and bfloat16 tensors; got %s "
                        "(convert the parameter, e.g. model.float())" % (dtype,)) from None


def raw_tensor(t):
    """A psclient.RawTensor over a contiguous tensor's memory (CPU or CUDA; no copy).

    CUDA tensors carry torch's current stream, so psd's copies are ordered after the work already
    queued on it. The tensor must stay alive for the call (it is the RawTensor's owner)."""
    if not t.is_contiguous():
        raise ValueError("raw_tensor needs a contiguous tensor (use .contiguous())")
    name = torch_dtype_name(t.dtype)
    if t.is_cuda:
        stream = _torch.cuda.current_stream(t.device).cuda_stream
        return _ps.RawTensor(t.data_ptr(), name, tuple(t.shape), device="cuda", stream=stream, owner=t)
    return _ps.RawTensor(t.data_ptr(), name, tuple(t.shape), device="cpu", owner=t)


def _view(t):
    """What the binding takes for a contiguous tensor: a numpy view (CPU, numpy dtypes) or a
    RawTensor (bfloat16, CUDA). Both share the tensor's memory."""
    if t.device.type == "cpu" and t.dtype in _NUMPY_OK:
        return t.numpy()
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError("psd moves CPU and CUDA tensors; this one is on %s" % (t.device,))
    return raw_tensor(t)


def _cuda_hint(err, what, cuda=True):
    """The CPU-only build's answer to a device view, with what to do about it."""
    if cuda and isinstance(err, _ps.Unimplemented):
        raise _ps.Unimplemented(
            "%s: this psclient was built without CUDA, so it cannot move CUDA tensors (%s). Rebuild "
            "psd with -DPSD_WITH_CUDA=ON on a machine with the CUDA toolkit, or keep the model on the "
            "CPU (model.cpu())" % (what, getattr(err, "message", str(err)))) from err
    raise err


class _Param:
    """One parameter as psd sees it."""

    __slots__ = ("name", "param", "var_dtype", "grad_dtype")

    def __init__(self, name, param, var_dtype, grad_dtype):
        self.name = name
        self.param = param
        self.var_dtype = var_dtype    # the variable's dtype on psd
        self.grad_dtype = grad_dtype  # what its gradients are pushed as


class SyncReplicasOptimizer:
    """TF's SyncReplicasOptimizer over psd for torch parameters (see the module docstring).

    client: a connected psclient.Client (one per worker thread/process).
    named_parameters: iterable of (name, torch.nn.Parameter), e.g. model.named_parameters(); the
      variable on psd is ``prefix + name``.
    replicas_to_aggregate / total_num_replicas: must match psd's (-1: take psd's), as in TF.
    timeout_ms: the token wait's deadline per step (0: psd's --token-timeout-ms).
    grad_dtype: push gradients converted to this dtype (e.g. torch.bfloat16) when it is narrower
      than the parameter's; None: the parameter's dtype.
    variable_dtype: the variables' dtype on psd; None: the parameter's, except float32 for
      float16/bfloat16 parameters (master weights kept by psd).
    variables_timeout_ms: how long initialize() waits for the chief to create the variables, and
      how long a worker waits for the chief to re-create variables psd lost.
    overlap: push each gradient as soon as autograd has accumulated it (a hook on the parameter's
      AccumulateGrad node, as Horovod/DDP do), on a background thread while backward goes on; the
      last one goes with the token wait and the pull in step() (one fused round trip). step() then
      returns a StepOutcome summing every push. One backward per step: a gradient accumulated twice
      before step() is a RuntimeError from step() (the first part went already: psd may hold it in
      that step's accumulators).
    shared_buffers: move each CPU parameter (float32/64/16, pushed in its own dtype) and its
      gradient into the client's shared buffers (client.allocate_shared; README "Zero-copy shared
      buffers"): a psd on this host then adds the gradients and writes the new values in place,
      with no copy on either side. Autograd accumulates into the shared .grad as long as it is
      zeroed in place (this optimizer's zero_grad(), the default); a gradient set to None is
      pushed with a copy. Elsewhere the buffers are plain memory. shared_parameters says how many
      moved.
    """

    def __init__(self, client, named_parameters, *, prefix="", timeout_ms=0, grad_dtype=None,
                 variable_dtype=None, replicas_to_aggregate=-1, total_num_replicas=-1,
                 variables_timeout_ms=60000, overlap=False, shared_buffers=False):
        self.client = client
        self.timeout_ms = int(timeout_ms)
        self.variables_timeout_ms = int(variables_timeout_ms)
        cfg = client.config
        r = cfg.replicas_to_aggregate if replicas_to_aggregate == -1 else replicas_to_aggregate
        # TF: total_num_replicas defaults to replicas_to_aggregate.
        if total_num_replicas == -1:
            n = cfg.total_replicas if replicas_to_aggregate == -1 else r
        else:
            n = total_num_replicas
        if r != cfg.replicas_to_aggregate or n != cfg.total_replicas:
            raise ValueError(
                "this trainer asks for replicas_to_aggregate=%d total_num_replicas=%d but psd runs with "
                "%d and %d (psd --replicas-to-aggregate / --total-replicas)"
                % (r, n, cfg.replicas_to_aggregate, cfg.total_replicas))
        self.replicas_to_aggregate = r
        self.total_num_replicas = n
        self._params = []
        seen = set()
        for name, p in named_parameters:
            if not isinstance(p, _torch.Tensor):
                raise TypeError("named_parameters must yield (name, torch.nn.Parameter); %r is a %s"
                                % (name, type(p).__name__))
            full = prefix + name
            if full in seen:
                raise ValueError("parameter name %r appears twice" % full)
            seen.add(full)
            torch_dtype_name(p.dtype)
            if variable_dtype is not None:
                vd = variable_dtype
            elif p.dtype in (_torch.float16, _torch.bfloat16):
                vd = _torch.float32
            else:
                vd = p.dtype
            torch_dtype_name(vd)
            gd = p.dtype
            if grad_dtype is not None and grad_dtype != p.dtype:
                torch_dtype_name(grad_dtype)
                if _torch.finfo(grad_dtype).bits < _torch.finfo(p.dtype).bits:
                    gd = grad_dtype
            self._params.append(_Param(full, p, vd, gd))
        if not self._params:
            raise ValueError("Must supply at least one variable")
        self._any_cuda = any(p.param.is_cuda for p in self._params)
        self._shared = []  # (value, gradient) tensors in shared buffers, per moved parameter
        if shared_buffers:
            self._share_memory()
        self.shared_parameters = len(self._shared)
        self._overlap = bool(overlap)
        self._early_pushed = set()  # indices whose gradient went before step() (overlap)
        self._early = []            # (future, keep-alive) of those pushes
        self._held = None           # the latest ready gradient, held back for step()'s fused push
        self._overlap_error = None
        self._hooks = []
        self._pool = None
        if self._overlap:
            self._install_hooks()
        self.local_step = client.initial_global_step
        self.last_push = None
        self.accepted_total = 0
        self.stale_total = 0
        self.aborted_total = 0
        self.recreated_total = 0
        self.last_loss = None
        self._initialized = False
        self._epoch = None

    def _share_memory(self):
        """Moves the parameters that can (CPU; numpy dtypes; pushed in their own dtype) and their
        gradients into shared buffers (kept in self._shared)."""
        for p in self._params:
            t = p.param
            if t.is_cuda or t.dtype not in _NUMPY_OK or p.grad_dtype != t.dtype:
                continue
            name = torch_dtype_name(t.dtype)
            value = _torch.from_numpy(self.client.allocate_shared(tuple(t.shape), name))
            grad = _torch.from_numpy(self.client.allocate_shared(tuple(t.shape), name))
            with _torch.no_grad():
                value.copy_(t.data)
                if t.grad is not None:
                    grad.copy_(t.grad)
            t.data = value
            t.grad = grad
            self._shared.append((value, grad))

    # ---------------------------------------------------------------- the chief and readiness
    @property
    def is_chief(self):
        """psd's chief (the first worker to say hello): it creates the variables."""
        return self.client.is_chief

    @property
    def param_names(self):
        return [p.name for p in self._params]

    def _create(self, p):
        """Create-or-get the variable from the parameter's current value (idempotent)."""
        with _torch.no_grad():
            init = p.param.detach().to("cpu", p.var_dtype).contiguous()
        info = self.client.create_variable(p.name, _view(init))
        return info

    def initialize(self, timeout_ms=None, chief_init_fn=None):
        """TF's chief init + local_step_init_op (the C++ hook's after_create_session).

        The chief (client.is_chief) calls chief_init_fn(self) first, if given (set the initial
        values, the learning rate, ...), then creates every variable from its parameter's value;
        every worker then waits until all variables exist (up to timeout_ms, default
        variables_timeout_ms), pulls them into its parameters and sets its local step to psd's
        global step. Returns the local step."""
        timeout_ms = self.variables_timeout_ms if timeout_ms is None else int(timeout_ms)
        if self.is_chief:
            if chief_init_fn is not None:
                chief_init_fn(self)
            for p in self._params:
                self._create(p)
        deadline = _time.monotonic() + timeout_ms / 1000.0
        backoff = 0.01
        while True:
            try:
                self._pull_all()
                break
            except _ps.NotFound as e:
                if _time.monotonic() >= deadline:
                    raise _ps.NotFound(
                        "Init operations did not make model ready for SyncReplicasOptimizer local_init "
                        "within %d ms (the chief worker creates the variables: is one running?): %s"
                        % (timeout_ms, e.message)) from e
                # A condition we cannot be told about: the chief's create.
                _time.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
        self.local_step = self.client.global_step()
        self._epoch = self.client.connection_epoch
        self._initialized = True
        return self.local_step

    def get_init_tokens(self, num_tokens=-1):
        """TF's get_init_tokens_op rule (psd queues the init tokens itself: psd --init-tokens)."""
        needed = self.replicas_to_aggregate - self.total_num_replicas
        if num_tokens == -1:
            return self.replicas_to_aggregate
        if num_tokens < needed:
            raise ValueError("Too few tokens to finish the first step: %d (given) vs %d (needed)"
                             % (num_tokens, needed))
        return num_tokens

    def make_session_run_hook(self, is_chief=None, num_tokens=-1):
        """TF's SyncReplicasHook: hook.begin(); hook.after_create_session() (= initialize)."""
        return SyncReplicasHook(self, self.is_chief if is_chief is None else is_chief, num_tokens)

    # ---------------------------------------------------------------- pulls
    def _pull_targets(self):
        """(pull list, staging copies): views over the parameters' memory where it allows it,
        staging tensors (copied in after the pull) where it does not."""
        outs, staged = [], []
        for p in self._params:
            t = p.param.data
            if t.is_contiguous():
                v = _view(t)
            else:
                s = _torch.empty(t.shape, dtype=t.dtype, device=t.device)
                staged.append((t, s))
                v = _view(s)
            outs.append((p.name, v))
        return outs, staged

    @staticmethod
    def _copy_staged(staged):
        with _torch.no_grad():
            for dst, src in staged:
                dst.copy_(src)

    def _pull_all(self):
        outs, staged = self._pull_targets()
        try:
            step = self.client.pull_many(outs)
        except _ps.Unimplemented as e:
            _cuda_hint(e, "pull", self._any_cuda)
        self._copy_staged(staged)
        return step

    def _recreate(self):
        for p in self._params:
            info = self._create(p)
            if getattr(info, "created", False):
                self.recreated_total += 1

    def _pull_after_loss(self):
        """psd came back without the variables (restarted without its checkpoints): the chief
        re-creates them from the parameters' values, the others wait for them (bounded)."""
        deadline = _time.monotonic() + self.variables_timeout_ms / 1000.0
        backoff = 0.02
        while True:
            try:
                if self.is_chief:
                    self._recreate()
                return self._pull_all()
            except (_ps.NotFound, _ps.Unavailable) as e:
                if _time.monotonic() >= deadline:
                    raise type(e)(
                        "psd lost the variables (it came back without its checkpoints) and the chief "
                        "worker did not re-create them within %d ms (variables_timeout_ms): %s"
                        % (self.variables_timeout_ms, e.message)) from e
            _time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    def resync(self):
        """Re-pull every parameter and take psd's global step as the local step (after psd
        restored a checkpoint, or to drop a batch). Returns the local step."""
        try:
            self._pull_all()
        except _ps.NotFound:
            if not self._initialized:
                raise
            self._pull_after_loss()
        self.local_step = self.client.global_step()
        self._epoch = self.client.connection_epoch
        return self.local_step

    def state_dict(self):
        """What psd holds now: {parameter name: a CPU tensor of the variable's value}."""
        out = {}
        pulls = []
        for p in self._params:
            t = _torch.empty(tuple(p.param.shape), dtype=p.var_dtype)
            out[p.name] = t
            pulls.append((p.name, _view(t)))
        self.client.pull_many(pulls)
        return out

    def get_slot(self, name, slot):
        """Optimizer slot `slot` (psd's slot_names, e.g. Adam's "m"/"v") of parameter `name`
        (prefixed as on psd) as a CPU tensor; None when the optimizer has no such slot."""
        if slot not in list(self.client.slot_names):
            return None
        p = next((q for q in self._params if q.name == name), None)
        if p is None:
            raise KeyError(name)
        t = _torch.empty(tuple(p.param.shape), dtype=p.var_dtype)
        self.client.get_slot(name, slot, _view(t))
        return t

    # ---------------------------------------------------------------- overlap (gradient hooks)
    def _install_hooks(self):
        import concurrent.futures
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="psd-push")
        for i, p in enumerate(self._params):
            if not p.param.requires_grad:
                continue
            with _torch.enable_grad():
                acc = p.param.expand_as(p.param).grad_fn.next_functions[0][0]
            acc.register_hook(self._make_hook(i))
            self._hooks.append(acc)  # the node must outlive this call for its hook to stay

    def _make_hook(self, i):
        def hook(*_):
            # Runs in autograd's thread once param i's .grad is final for this backward.
            if i in self._early_pushed or i == self._held:
                self._overlap_error = ("parameter %r got a gradient twice before step(): overlap=True "
                                       "pushes each gradient as soon as it is ready, so it needs one "
                                       "backward per step (use overlap=False to accumulate)"
                                       % self._params[i].name)
                return
            if self._held is not None:
                self._push_early(self._held)
            self._held = i
        return hook

    def _push_early(self, i):
        dense, sparse, keep = self._gradients([self._params[i]])
        self._early_pushed.add(i)
        if not dense and not sparse:
            return
        fut = self._pool.submit(self.client.push, self.local_step, dense, sparse=sparse)
        self._early.append((fut, keep))

    def _collect_early_pushes(self):
        """(outcomes of the pushes made during backward, the parameter indices they covered); the
        held-back gradient goes with step()'s token. Outcomes None when one met Aborted/NotFound
        (psd restored / lost the variables). The overlap state is reset whatever happens."""
        self._held = None
        early, self._early = self._early, []
        pushed, self._early_pushed = self._early_pushed, set()
        error, self._overlap_error = self._overlap_error, None
        outs, lost, failure = [], False, None
        for fut, _keep in early:  # wait for every one, even after a failure: none is left running
            try:
                outs.append(fut.result())
            except (_ps.Aborted, _ps.NotFound):
                lost = True
            except BaseException as e:  # noqa: B902 - re-raised below, after the others finished
                failure = failure or e
        if error is not None:
            raise RuntimeError(error)
        if failure is not None:
            if isinstance(failure, _ps.Unimplemented):
                _cuda_hint(failure, "push", self._any_cuda)
            raise failure
        return (None if lost else outs), pushed

    def close(self):
        """Stops the overlap pusher thread (if any); the client stays open."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---------------------------------------------------------------- the step
    def zero_grad(self, set_to_none=False):
        """Like torch.optim.Optimizer.zero_grad; sparse gradients are always set to None."""
        for p in self._params:
            g = p.param.grad
            if g is None:
                continue
            if set_to_none or g.is_sparse:
                p.param.grad = None
            else:
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()

    def _gradients(self, params=None):
        """(dense [(name, view)], sparse [(name, indices, values)], keep-alive tensors)."""
        dense, sparse, keep = [], [], []
        for p in self._params if params is None else params:
            g = p.param.grad
            if g is None:
                continue  # TF's None gradient: no accumulator, the variable passes through
            with _torch.no_grad():
                if g.is_sparse:
                    g = g.coalesce()
                    idx = g._indices()
                    if idx.shape[0] != 1:
                        raise ValueError("sparse gradient of %r is indexed by %d dimensions; psd takes "
                                         "row-sparse gradients (nn.Embedding(sparse=True))"
                                         % (p.name, idx.shape[0]))
                    indices = idx[0].to("cpu", _torch.int64).contiguous().numpy()
                    values = g._values()
                    if values.dtype != p.grad_dtype:
                        values = values.to(p.grad_dtype)
                    values = values.contiguous()
                    keep.append(values)
                    sparse.append((p.name, indices, _view(values)))
                else:
                    if g.dtype != p.grad_dtype:
                        g = g.to(p.grad_dtype)
                    g = g.contiguous()
                    keep.append(g)
                    dense.append((p.name, _view(g)))
        return dense, sparse, keep

    def step(self, closure=None):
        """Push every parameter's .grad tagged with the local step, wait for the token and write the
        new values into the parameters (one round trip). Returns the PushOutcome (accepted / stale
        per gradient; .stale > 0: this worker's gradients came too late and were dropped), or None
        when psd had restored a checkpoint or lost the variables: the parameters were re-pulled
        and the local step reset; this batch's gradients are dropped, compute the next ones.

        closure (optional, as torch's): re-evaluates the model and returns the loss; it is called
        before the push and its loss is kept in .last_loss.

        A failed token wait raises its error (OutOfRange: the job is over; DeadlineExceeded:
        the token did not come within timeout_ms), after the outcome is counted."""
        loss = None
        if closure is not None:
            with _torch.enable_grad():
                loss = closure()
        early, pushed = self._collect_early_pushes() if self._overlap else ([], set())
        if not self._initialized or self._epoch != self.client.connection_epoch:
            # No initialize(), or the client reconnected (psd may have restarted from a
            # checkpoint): TF's local_step_init_op, so the gradients are tagged fresh.
            self.local_step = self.client.global_step()
            self._epoch = self.client.connection_epoch
            self._initialized = True
        if early is None:  # an early push met Aborted / NotFound
            self.aborted_total += 1
            self.resync()
            return None
        rest = [p for i, p in enumerate(self._params) if i not in pushed] if pushed else None
        dense, sparse, keep = self._gradients(rest)
        if not dense and not sparse and not early:
            raise ValueError("Must supply at least one variable (no parameter has a .grad: call "
                             "loss.backward() before step())")
        outs, staged = self._pull_targets()
        try:
            out = self.client.push(self.local_step, dense, sparse=sparse, wait_token=True,
                                   timeout_ms=self.timeout_ms, pull_after=outs)
        except _ps.Unimplemented as e:
            _cuda_hint(e, "push", self._any_cuda)
        except (_ps.Aborted, _ps.NotFound):
            # Aborted: the cluster restored a checkpoint; NotFound: psd lost the variables.
            # These gradients were computed on values psd no longer has: drop them, re-pull.
            self.aborted_total += 1
            self.resync()
            return None
        finally:
            del keep
        if early:
            out = StepOutcome(early + [out])
        self.last_push = out
        self.accepted_total += out.accepted
        self.stale_total += out.stale
        if out.token_status is not None:
            err = out.token_status
            if isinstance(err, BaseException):
                raise err
            raise _ps.Error("token wait failed: %s" % (err,))
        self.local_step = out.token
        if out.pulled_step >= 0:
            self._copy_staged(staged)
        else:
            self._pull_all()
        self.last_loss = loss
        return out


class StepOutcome:
    """step()'s outcome with overlap=True: the pushes made during backward and step()'s fused
    push + token + pull, summed (the attributes of psclient.PushOutcome)."""

    def __init__(self, outcomes):
        last = outcomes[-1]
        self.pushes = len(outcomes)
        self.results = [r for o in outcomes for r in o.results]
        self.accepted = sum(o.accepted for o in outcomes)
        self.stale = sum(o.stale for o in outcomes)
        self.waited = last.waited
        self.token_status = last.token_status
        self.token = last.token
        self.is_chief = last.is_chief
        self.step_gradients = last.step_gradients
        self.pulled_step = last.pulled_step

    def __repr__(self):
        return "StepOutcome(pushes=%d, accepted=%d, stale=%d, token=%d, token_status=%r)" % (
            self.pushes, self.accepted, self.stale, self.token, self.token_status)


class SyncReplicasHook:
    """TF's SyncReplicasHook (the C++ make_session_run_hook): begin() then after_create_session()."""

    def __init__(self, opt, is_chief, num_tokens):
        self._opt = opt
        self._is_chief = is_chief
        self._num_tokens = num_tokens

    def begin(self):
        return None

    def after_create_session(self, timeout_ms=60000, chief_init_fn=None):
        """The chief checks the init tokens against psd's (psd --init-tokens) and creates the
        variables; every worker waits for them, pulls them and sets its local step."""
        if self._is_chief:
            tokens = self._opt.get_init_tokens(self._num_tokens)
            daemon_tokens = self._opt.client.config.init_tokens
            if self._num_tokens != -1 and tokens != daemon_tokens:
                raise ValueError("num_tokens=%d but psd queued %d init tokens; start psd with "
                                 "--init-tokens %d" % (tokens, daemon_tokens, tokens))
        return self._opt.initialize(timeout_ms, chief_init_fn=chief_init_fn)
