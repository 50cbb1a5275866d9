#!/usr/bin/python3
"""psd example worker in Python: an MLP classifier trained through psd with psclient.torch.

A generated, learnable dataset (no downloads): points around 12 Gaussian centres in 16
dimensions, 3 centres per class, 4 classes (every worker draws the same centres, seed 1234, and
its own samples, seed 1000 + its data shard). The model is a plain torch MLP
(16 -> --hidden -> 4, ReLU); the loop is torch's (zero_grad, forward, backward, step) with
psclient.torch.SyncReplicasOptimizer: the daemon averages the workers' gradients and applies its
optimizer (psd --optimizer / --learning-rate).

One worker process of a psd job. Under psrun (README "Launching your trainer (psrun)"), with no
--host/--port/--cluster, it reads the launcher's environment (PSD_CLUSTER, PSD_WORKER_NAME,
PSD_WORKER_INDEX as its data shard, PSD_AUTH_TOKEN_FILE, PSD_TLS_*):

    psrun --workers 3 --replicas 2 --psd-arg=--learning-rate=0.2 -- \
        /usr/bin/python3 client/python/examples/mlp_classifier.py --steps 300

Prints one line per --print-every steps (global step, loss, accepted/stale pushes) and the held-out
accuracy every --eval-every steps; at the end the test accuracy of the trained model (the values
psd holds). With --min-accuracy A it exits 3 when the final accuracy is below A. With the defaults
(300 global steps of 2 x 64 rows, psd sgd at lr 0.2) the model reaches >= 0.95 on the held-out set.
"""

import argparse
import os
import sys
import time

import torch

import psclient
import psclient.torch as pst

FEATURES, CLASSES, CENTRES_PER_CLASS = 16, 4, 3


def make_data(rows, seed, spread=1.2):
    """rows points around the class centres (the same centres for every worker)."""
    g = torch.Generator().manual_seed(1234)
    centres = torch.randn(CLASSES * CENTRES_PER_CLASS, FEATURES, generator=g) * spread
    gs = torch.Generator().manual_seed(seed)
    c = torch.randint(0, CLASSES * CENTRES_PER_CLASS, (rows,), generator=gs)
    x = centres[c] + torch.randn(rows, FEATURES, generator=gs)
    return x, c % CLASSES


def make_model(hidden):
    torch.manual_seed(7)  # the chief's initial values are psd's; the others' are overwritten
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def connect(args):
    """Explicit flags win; otherwise psrun's environment (PSD_CLUSTER ...)."""
    shard, name = args.shard, args.worker_name
    if args.host is None and args.port is None and args.cluster is None and os.environ.get("PSD_CLUSTER"):
        client = psclient.Client.from_environment()
        env = psclient.read_launch_environment()
        if shard is None and env.worker_index >= 0:
            shard = env.worker_index
        return client, shard or 0, name or os.environ.get("PSD_WORKER_NAME", "worker")
    kw = {}
    if args.cluster:
        kw["cluster"] = [args.cluster]
    if args.worker_name:
        kw["worker_name"] = args.worker_name
    client = psclient.Client(args.host or "127.0.0.1", args.port or 7070, **kw)
    return client, shard or 0, name or "worker"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--cluster", help="every shard's host:port, comma-separated (instead of --port)")
    ap.add_argument("--worker-name")
    ap.add_argument("--shard", type=int, help="which slice of the generated data this worker trains on")
    ap.add_argument("--steps", type=int, default=300, help="train until the global step reaches this")
    ap.add_argument("--batch", type=int, default=64, help="rows per gradient (per worker)")
    ap.add_argument("--rows", type=int, default=8192, help="rows of training data per worker")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--print-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--slow-ms", type=int, default=0, help="sleep this long per step (an artificial straggler)")
    ap.add_argument("--token-timeout-ms", type=int, default=30000)
    ap.add_argument("--retry-s", type=float, default=60, help="keep retrying this long while psd is unavailable")
    ap.add_argument("--min-accuracy", type=float, default=0.0, help="exit 3 if the final test accuracy is below")
    ap.add_argument("--overlap", action="store_true", help="push each gradient as backward produces it")
    args = ap.parse_args()
    torch.set_num_threads(1)

    client, shard, me = connect(args)
    x, y = make_data(args.rows, 1000 + shard)
    x_test, y_test = make_data(4096, 999)
    model = make_model(args.hidden)
    opt = pst.SyncReplicasOptimizer(client, model.named_parameters(), prefix="mlp/", timeout_ms=args.token_timeout_ms,
                                    overlap=args.overlap)
    opt.initialize()
    acc0 = accuracy(model, x_test, y_test)
    print("[%s] %s; model initialised at global step %d, test accuracy %.3f"
          % (me, "chief: created the variables" if opt.is_chief else "pulled the chief's variables",
             opt.local_step, acc0), flush=True)

    gen = torch.Generator().manual_seed(99 + shard)
    loss_fn = torch.nn.CrossEntropyLoss()
    t0 = time.monotonic()
    my_steps, loss = 0, float("nan")
    unavailable_since = None
    while opt.local_step < args.steps:
        rows = torch.randint(0, args.rows, (args.batch,), generator=gen)
        opt.zero_grad()
        out_loss = loss_fn(model(x[rows]), y[rows])
        out_loss.backward()
        if args.slow_ms > 0:
            time.sleep(args.slow_ms / 1000.0)
        try:
            out = opt.step()
        except psclient.OutOfRange:
            break  # training is over
        except (psclient.Unavailable, psclient.DeadlineExceeded) as e:
            # psd restarting: the client reconnects by itself; retry, bounded in time.
            now = time.monotonic()
            unavailable_since = unavailable_since or now
            if now - unavailable_since > args.retry_s:
                raise
            print("[%s] %s; retrying" % (me, e), file=sys.stderr, flush=True)
            time.sleep(0.1)
            continue
        unavailable_since = None
        if out is None:
            print("[%s] psd restored a checkpoint: parameters re-pulled at global step %d" % (me, opt.local_step),
                  flush=True)
            continue
        my_steps += 1
        loss = out_loss.item()
        if args.print_every > 0 and my_steps % args.print_every == 0:
            print("[%s] global step %4d  loss %.4f  pushes accepted %d stale %d%s"
                  % (me, opt.local_step, loss, out.accepted, out.stale, "  (chief)" if out.is_chief else ""),
                  flush=True)
        if args.eval_every > 0 and my_steps % args.eval_every == 0:
            print("[%s] global step %4d  test accuracy %.3f" % (me, opt.local_step, accuracy(model, x_test, y_test)),
                  flush=True)
    secs = time.monotonic() - t0
    # The trained model: psd's values (the last token's pull already wrote them; pull again in case
    # the last push was stale or the loop ended on OutOfRange).
    try:
        opt.resync()
    except psclient.Error as e:
        print("[%s] final pull: %s" % (me, e), file=sys.stderr, flush=True)
    acc = accuracy(model, x_test, y_test)
    print("[%s] done: %d local steps in %.2f s (%.1f steps/s), global step %d, pushes accepted %d stale %d, "
          "last loss %.4f, test accuracy %.3f -> %.3f"
          % (me, my_steps, secs, my_steps / max(secs, 1e-9), opt.local_step, opt.accepted_total, opt.stale_total,
             loss, acc0, acc), flush=True)
    try:
        client.finish()
    except psclient.Error as e:
        print("[%s] finish: %s" % (me, e), file=sys.stderr, flush=True)
    opt.close()
    client.close()
    if acc < args.min_accuracy:
        print("[%s] test accuracy %.3f is below --min-accuracy %.3f" % (me, acc, args.min_accuracy),
              file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
