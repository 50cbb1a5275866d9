#!/usr/bin/env bash
# Starts P local psd shards (one daemon, or a cluster) and W worker processes on 127.0.0.1, trains
# the example logistic-regression model, prints per-step progress and a summary, and stops
# everything. Every process is bounded in time; only the processes started here are stopped, by
# PID.
#
#   deploy/local_cluster.sh [--build DIR] [--shards P] [--workers W] [--replicas R] [--backup B]
#                           [--steps S] [--features F] [--straggler-ms MS] [--lr LR]
#                           [-- extra psd flags]
#
# With --shards P > 1 the shards listen on P consecutive free ports from a random base; variables
# over --slice-bytes (psd's flag, default 64 MiB) are split over several shards.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
build="$here/build"
workers=3 replicas=2 backup="" steps=1000 straggler_ms=3 lr=0.5 features=128 batch=256 shards=1
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
    --) shift; break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
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

psd="$build/server/psd"
worker="$build/client/psd_logreg_worker"
[ -x "$psd" ] && [ -x "$worker" ] || { echo "build first: $psd / $worker missing" >&2; exit 1; }

run=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$run"
}
trap cleanup EXIT

psd_flags=(--replicas-to-aggregate "$replicas" --backup-replicas "$backup" --init-tokens 0 --learning-rate "$lr"
  --exit-when-done --summary-interval-s 2)
psd_pids=()
if [ "$shards" -le 1 ]; then
  timeout 600 "$psd" --port 0 --port-file "$run/port" "${psd_flags[@]}" "$@" 2> >(sed 's/^/[psd] /' >&2) &
  psd_pids+=($!)
  pids+=($!)
  for _ in $(seq 100); do [ -s "$run/port" ] && break; sleep 0.05; done
  target=(--port "$(cat "$run/port")")
  echo "psd listening on 127.0.0.1:$(cat "$run/port") (replicas_to_aggregate=$replicas, backup replicas=$backup, $workers workers)"
else
  base=$((20000 + RANDOM % 30000))
  cluster=$(seq -s, -f "127.0.0.1:%g" "$base" $((base + shards - 1)))
  for k in $(seq 0 $((shards - 1))); do
    timeout 600 "$psd" --cluster "$cluster" --shard-index "$k" "${psd_flags[@]}" "$@" \
      2> >(sed "s/^/[psd $k] /" >&2) &
    psd_pids+=($!)
    pids+=($!)
  done
  target=(--cluster "$cluster")
  echo "psd cluster of $shards shards on $cluster (replicas_to_aggregate=$replicas, backup replicas=$backup, $workers workers)"
fi

worker_pids=()
# The straggler (the last worker) starts first, so it takes part from the first step.
for i in $((workers - 1)) $(seq 0 $((workers - 2))); do
  slow=0
  # The last worker is an artificial straggler when there are backups: its gradients arrive late.
  if [ "$backup" -gt 0 ] && [ "$i" -eq $((workers - 1)) ]; then slow=$straggler_ms; fi
  timeout 600 "$worker" "${target[@]}" --worker-name "worker-$i" --shard "$i" --steps "$steps" \
    --features "$features" --batch "$batch" --slow-ms "$slow" --print-every 50 &
  worker_pids+=($!)
  pids+=($!)
done
status=0
for p in "${worker_pids[@]}"; do wait "$p" || status=1; done
for p in "${psd_pids[@]}"; do wait "$p" || status=1; done
[ $status -eq 0 ] && echo "local cluster finished: all workers done, psd exited cleanly" || echo "local cluster FAILED" >&2
exit $status
