#!/usr/bin/env bash
# Starts P local psd shards (one daemon, or a cluster) and W worker processes on 127.0.0.1 through
# psrun (the launcher: README "Launching your trainer (psrun)"), trains the example
# logistic-regression model, prints per-step progress and a summary, and stops everything. psrun
# bounds the run in time and stops only the processes it started, by process group.
#
#   deploy/local_cluster.sh [--build DIR] [--shards P] [--workers W] [--replicas R] [--backup B]
#                           [--steps S] [--features F] [--straggler-ms MS] [--lr LR] [--python]
#                           [--timeout-s S] [-- extra psd flags]
#
# --timeout-s S: psrun stops everything after S seconds and the script exits 124 (default 600;
# 0: no limit, Ctrl-C stops the run). Raise it for long runs (--steps 100000).
#
# --python: the workers are the Python example instead (client/python/examples/mlp_classifier.py:
# an MLP classifier in PyTorch through psclient.torch; Debian's /usr/bin/python3 with python3-torch,
# the package from the build's python/ directory); it checks a held-out accuracy of 0.93 at the end.
#
# With --shards P > 1 the shards listen on P free ports that psrun picks; variables over
# --slice-bytes (psd's flag, default 64 MiB) are split over several shards; psrun gives the shards
# a fresh cluster secret (--cluster-secret-file) for their links. The same job with
# your own trainer: `psrun --shards P --workers W --replicas R --backup B -- ./my_trainer`.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
build="$here/build"
workers=3 replicas=2 backup="" steps="" straggler_ms=3 lr="" features=128 batch=256 shards=1 python=0
timeout_s=600
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --shards) shards=$2; shift 2 ;;
    --features) features=$2; shift 2 ;;
    --replicas) replicas=$2; shift 2 ;;
    --backup) backup=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --straggler-ms) straggler_ms=$2; shift 2 ;;
    --lr) lr=$2; shift 2 ;;
    --python) python=1; shift ;;
    --timeout-s) timeout_s=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

# psd admits N = R + B workers and refuses the others: without --backup, the workers beyond
# --replicas are the backups.
if [ -z "$backup" ]; then backup=$((workers > replicas ? workers - replicas : 0)); fi
if [ "$workers" -ne $((replicas + backup)) ]; then
  echo "--workers $workers must equal --replicas $replicas + --backup $backup (psd runs N = R + B workers):" \
    "change --workers, or leave --backup out to make every worker beyond R a backup" >&2
  exit 2
fi

psrun="$build/client/psrun"
psd="$build/server/psd"
if [ "$python" -eq 1 ]; then
  steps=${steps:-600} lr=${lr:-0.2}
  py=/usr/bin/python3
  [ -d "$build/python/psclient" ] || { echo "build first: $build/python/psclient missing (cmake --build $build --target psclient_python)" >&2; exit 1; }
  "$py" -c "import torch" 2>/dev/null || { echo "--python needs torch for $py: apt-get install python3-torch" >&2; exit 1; }
  export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
  trainer=("$py" "$here/client/python/examples/mlp_classifier.py" --steps "$steps" --print-every 50
    --eval-every 200 --min-accuracy 0.93)
  for f in "$psrun" "$psd"; do
    [ -x "$f" ] || { echo "build first: $f missing" >&2; exit 1; }
  done
else
  steps=${steps:-1000} lr=${lr:-0.5}
  worker="$build/client/psd_logreg_worker"
  trainer=("$worker" --steps "$steps" --features "$features" --batch "$batch" --print-every 50)
  for f in "$psrun" "$psd" "$worker"; do
    [ -x "$f" ] || { echo "build first: $f missing" >&2; exit 1; }
  done
fi

# Every shard serves its status page and /metrics on a free port (the log names it).
psd_args=(--psd-arg=--learning-rate="$lr" --psd-arg=--summary-interval-s=2 --psd-arg=--metrics-port=0)
for f in "$@"; do psd_args+=("--psd-arg=$f"); done
if [ "$shards" -le 1 ]; then
  echo "one psd (replicas_to_aggregate=$replicas, backup replicas=$backup, $workers workers)"
else
  echo "psd cluster of $shards shards (replicas_to_aggregate=$replicas, backup replicas=$backup, $workers workers)"
fi
# Each worker learns its name, data shard and the cluster from psrun's environment
# (PSD_WORKER_INDEX, PSD_CLUSTER, ...). With backups, the last worker is an artificial straggler:
# its gradients arrive late.
straggler='slow=0
if [ "$1" -gt 0 ] && [ "$PSD_WORKER_INDEX" -eq $((PSD_NUM_WORKERS - 1)) ]; then slow=$2; fi
shift 2
exec "$@" --slow-ms "$slow"'
status=0
"$psrun" --psd "$psd" --shards "$shards" --workers "$workers" --replicas "$replicas" --backup "$backup" \
  --timeout-s "$timeout_s" "${psd_args[@]}" -- sh -c "$straggler" straggler "$backup" "$straggler_ms" \
  "${trainer[@]}" || status=$?
[ $status -eq 0 ] && echo "local cluster finished: all workers done, psd exited cleanly" || echo "local cluster FAILED (psrun exited $status)" >&2
exit $status
