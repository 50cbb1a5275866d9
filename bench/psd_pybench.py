#!/usr/bin/python3
"""psd_pybench: push/pull GB/s from Python (numpy arrays, torch CPU tensors, bfloat16 gradients into
float32 variables) against the C++ host-memory figure measured in the same run (README "Python bench").

Every measurement gets a fresh psd (R = N = 1, --init-tokens 0, sgd) on 127.0.0.1:0 and one worker
running the same loop: push the gradient of every variable tagged with the local step, wait for the
token and pull the new values, in one round trip per step (psd_bench --fused --pull-in-push; in
Python Client.push(wait_token=True, pull_after=...)). GB/s is psd_bench's: bytes of one direction
over the wall time of the measured steps (GB = 1e9 B).

  mode        what moves
  cpp         build/bench/psd_bench --connect (libpsclient from C++, host memory): the reference
  numpy       psclient.Client.push/pull_after on numpy float32 arrays (zero-copy views)
  torch       psclient.torch.SyncReplicasOptimizer.step() on a float32 nn.Parameter (.grad pushed,
              values pulled straight into the parameter)
  torch-bf16  the same with a bfloat16 parameter: bf16 gradients summed by psd into a float32
              variable, values pulled back converted to bf16 -- half the bytes each way
  torch-shared  torch with shared_buffers=True: the parameter and its .grad in the client's shared
              buffers, read and written in place by psd (README "Zero-copy shared buffers")
  torch-cuda  torch with the parameter and its .grad on the GPU (cuda:0): pushed and pulled on
              torch's current stream through the client's pinned staging (a CUDA build of
              libpsclient; skipped where torch sees no GPU)

Modes run interleaved (cpp, numpy, torch, torch-bf16, then again) for --rounds rounds; the table
shows each mode's median and the ratio to cpp's median at that size.

  /usr/bin/python3 bench/psd_pybench.py --build build --sizes 4M,64M --rounds 3 [--json]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("cpp", "numpy", "torch", "torch-bf16", "torch-shared", "torch-cuda")


def parse_size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


class Psd:
    """A psd on 127.0.0.1:0 for one measurement; killed by PID."""

    def __init__(self, binary, timeout_s=30):
        self.dir = tempfile.TemporaryDirectory(prefix="psd-pybench-")
        port_file = os.path.join(self.dir.name, "port")
        self.log = open(os.path.join(self.dir.name, "psd.log"), "w+")
        self.proc = subprocess.Popen([binary, "--port", "0", "--port-file", port_file, "-R", "1", "--init-tokens", "0",
                                      "--optimizer", "sgd", "--learning-rate", "0.01", "--log-level", "warn",
                                      "--max-frame-bytes", str(1 << 30)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                self.stop()
                raise RuntimeError("psd did not start: " + self.log.read())
            time.sleep(0.01)
        self.port = int(open(port_file).read().strip())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()
        self.dir.cleanup()


def run_cpp(args, psd, nbytes, steps):
    cmd = [args.psd_bench, "--connect", "127.0.0.1:%d" % psd.port, "--workers", "1", "--model-bytes", str(nbytes),
           "--steps", str(steps), "--warmup", str(args.warmup), "--fused", "--pull-in-push", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.timeout_s)
    r = json.loads(out.stdout)
    return {"push_gb_s": r["push_gb_per_s"], "pull_gb_s": r["pull_gb_per_s"], "step_ms_p50": r["step_ms_p50"],
            "push_bytes": nbytes, "pull_bytes": nbytes, "command": " ".join(cmd[:1] + ["--connect", "HOST:PORT"] +
                                                                           cmd[3:])}


def _timed(loop, nbytes, push_bytes, pull_bytes, steps, warmup):
    for _ in range(warmup):
        loop()
    times = []
    t0 = time.perf_counter()
    for _ in range(steps):
        s = time.perf_counter()
        loop()
        times.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    return {"push_gb_s": push_bytes * steps / wall / 1e9, "pull_gb_s": pull_bytes * steps / wall / 1e9,
            "step_ms_p50": statistics.median(times) * 1e3, "push_bytes": push_bytes, "pull_bytes": pull_bytes}


def run_numpy(args, psd, nbytes, steps):
    import numpy as np
    import psclient
    n = nbytes // 4
    with psclient.Client("127.0.0.1", psd.port, worker_name="pybench", max_frame_bytes=1 << 30) as c:
        value = np.zeros(n, np.float32)
        c.create_variable("bench/v0", value)
        grad = np.full(n, 1e-3, np.float32)
        state = {"step": c.global_step()}
        grads, after = [("bench/v0", grad)], [("bench/v0", value)]

        def loop():
            o = c.push(state["step"], grads, wait_token=True, pull_after=after)
            if o.token_status is not None:
                raise o.token_status
            state["step"] = o.token

        return _timed(loop, nbytes, nbytes, nbytes, steps, args.warmup)


def run_torch(args, psd, nbytes, steps, dtype_name="float32", shared=False, device="cpu"):
    import psclient
    import psclient.torch as pst
    import torch
    torch.set_num_threads(1)  # torch's idle OpenMP threads would spin on the cores psd needs
    dtype = getattr(torch, dtype_name)
    n = nbytes // 4  # the float32 variable's elements: the same model as the other modes
    with psclient.Client("127.0.0.1", psd.port, worker_name="pybench", max_frame_bytes=1 << 30) as c:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype, device=device))
        opt = pst.SyncReplicasOptimizer(c, [("bench/v0", p)], timeout_ms=int(args.timeout_s * 1000),
                                        shared_buffers=shared)
        opt.initialize()
        if shared:
            p.grad.fill_(1e-3)  # the shared gradient, written in place
        else:
            p.grad = torch.full((n,), 1e-3, dtype=dtype, device=device)
        moved = n * p.element_size()
        step = opt.step
        if device != "cpu":
            def step():  # a step ends when its values are on the GPU
                opt.step()
                torch.cuda.synchronize()
        return _timed(step, nbytes, moved, moved, steps, args.warmup)


def _cuda_available():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def measure(args, mode, nbytes, steps):
    psd = Psd(args.psd)
    try:
        if mode == "cpp":
            return run_cpp(args, psd, nbytes, steps)
        if mode == "numpy":
            return run_numpy(args, psd, nbytes, steps)
        if mode == "torch":
            return run_torch(args, psd, nbytes, steps)
        if mode == "torch-shared":
            return run_torch(args, psd, nbytes, steps, shared=True)
        if mode == "torch-cuda":
            return run_torch(args, psd, nbytes, steps, device="cuda")
        return run_torch(args, psd, nbytes, steps, "bfloat16")
    finally:
        psd.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"), help="the build tree (psd, psd_bench, python/)")
    ap.add_argument("--psd", help="psd binary (default BUILD/server/psd)")
    ap.add_argument("--psd-bench", help="psd_bench binary (default BUILD/bench/psd_bench)")
    ap.add_argument("--sizes", default="4M,64M", help="model sizes (one float32 variable), comma-separated")
    ap.add_argument("--steps", default="", help="measured steps per size, comma-separated (default: ~0.5 s of data)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every mode")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    args.psd = args.psd or os.path.join(args.build, "server", "psd")
    args.psd_bench = args.psd_bench or os.path.join(args.build, "bench", "psd_bench")
    sys.path.insert(0, os.path.join(args.build, "python"))
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    steps = [int(s) for s in args.steps.split(",")] if args.steps else [max(20, min(100, (512 << 20) // s))
                                                                       for s in sizes]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error("unknown mode %r (%s)" % (m, ", ".join(MODES)))

    results = {}  # (size, mode) -> [runs]
    skipped = {}
    for size, nsteps in zip(sizes, steps):
        for _ in range(args.rounds):
            for mode in modes:
                if (size, mode) in skipped:
                    continue
                if mode == "torch-cuda" and not _cuda_available():
                    skipped[(size, mode)] = "torch sees no CUDA device"
                    continue
                try:
                    r = measure(args, mode, size, nsteps)
                except Exception as e:  # noqa: BLE001 - reported, the other modes go on
                    import psclient
                    # A psd (or client) without half precision refuses the bf16 mode one way or another.
                    if mode == "torch-bf16" and isinstance(e, psclient.Error):
                        skipped[(size, mode)] = "this psd does not take bf16 yet: " + str(e)
                        continue
                    raise
                results.setdefault((size, mode), []).append(r)

    rows = []
    for size, nsteps in zip(sizes, steps):
        cpp = results.get((size, "cpp"))
        cpp_gb = statistics.median(r["push_gb_s"] for r in cpp) if cpp else None
        for mode in modes:
            runs = results.get((size, mode))
            row = {"size_bytes": size, "mode": mode, "steps": nsteps, "rounds": len(runs or [])}
            if not runs:
                row["skipped"] = skipped.get((size, mode), "not run")
                rows.append(row)
                continue
            gb = statistics.median(r["push_gb_s"] for r in runs)
            row.update({"push_gb_s": gb, "pull_gb_s": statistics.median(r["pull_gb_s"] for r in runs),
                        "gb_s_runs": [round(r["push_gb_s"], 3) for r in runs],
                        "step_ms_p50": statistics.median(r["step_ms_p50"] for r in runs),
                        "push_bytes_per_step": runs[0]["push_bytes"], "pull_bytes_per_step": runs[0]["pull_bytes"],
                        # model elements updated per second: bf16 moves half the bytes for the same model
                        "params_per_s": (size // 4) * 1000.0 / statistics.median(r["step_ms_p50"] for r in runs)})
            row["best_push_gb_s"] = max(r["push_gb_s"] for r in runs)
            if cpp_gb:
                row["ratio_vs_cpp"] = gb / cpp_gb
                row["best_ratio_vs_cpp"] = row["best_push_gb_s"] / max(r["push_gb_s"] for r in cpp)
                row["step_ratio_vs_cpp"] = statistics.median(r["step_ms_p50"] for r in cpp) / row["step_ms_p50"]
            if mode == "cpp":
                row["command"] = runs[0]["command"]
            rows.append(row)

    if args.json:
        print(json.dumps({"tool": "psd_pybench", "rows": rows}))
        return 0
    print("psd_pybench: one worker, R = N = 1, push + token + pull in one round trip per step; "
          "GB/s one direction (GB = 1e9 B); median of %d interleaved rounds" % args.rounds)
    print("%-8s %-12s %6s %10s %9s %9s %7s %9s %9s %17s  %s" % (
        "size", "mode", "steps", "GB/s med", "vs cpp", "GB/s best", "vs cpp", "step p50", "steps vs", "bytes/step",
        "GB/s of each run"))
    for r in rows:
        size = "%d MiB" % (r["size_bytes"] >> 20) if r["size_bytes"] >= 1 << 20 else "%d B" % r["size_bytes"]
        if "skipped" in r:
            print("%-8s %-12s skipped: %s" % (size, r["mode"], r["skipped"]))
            continue
        print("%-8s %-12s %6d %10.3f %9s %9.3f %7s %7.2fms %9s %17s  %s" % (
            size, r["mode"], r["steps"], r["push_gb_s"], "%.2f" % r["ratio_vs_cpp"] if "ratio_vs_cpp" in r else "-",
            r["best_push_gb_s"], "%.2f" % r["best_ratio_vs_cpp"] if "best_ratio_vs_cpp" in r else "-",
            r["step_ms_p50"], "%.2f" % r["step_ratio_vs_cpp"] if "step_ratio_vs_cpp" in r else "-",
            "%d+%d" % (r["push_bytes_per_step"], r["pull_bytes_per_step"]), r["gb_s_runs"]))
    print("GB/s: one direction (push = pull in this loop); vs cpp: over psd_bench's (the C++ client, host memory) at "
          "the same size, of the medians and of the best runs; steps vs: C++ step p50 / this step p50 (for torch-bf16, "
          "which moves half the bytes for the same model, the figure to read).")
    cmd = next((r["command"] for r in rows if "command" in r), None)
    if cmd:
        print("cpp command: " + cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
