#!/usr/bin/env bash
# Slurm: a psd cluster, one shard per node on the first PSD_SHARDS nodes of the allocation (all of
# them by default), and one trainer per task on every node.
#   sbatch --job-name=my-model --nodes=3 --ntasks-per-node=2 deploy/slurm/psd_job.sh
#   sbatch --job-name=my-model --nodes=3 --ntasks-per-node=2 deploy/slurm/psd_job.sh python3 train.py
# Arguments, when given, are your trainer: each task runs it with the environment contract
# (PSD_CLUSTER, PSD_WORKER_INDEX = $SLURM_PROCID, PSD_NUM_WORKERS, PSD_WORKER_NAME,
# PSD_AUTH_TOKEN_FILE; README "Deploying"); without them, the example logistic-regression worker.
#
# Resubmitting a job under the same --job-name resumes it: the checkpoints live in
# $PSD_CHECKPOINTS (default ./psd-checkpoints/<job name>/shard-K), keyed by the job NAME and the
# shard index, never by the job id or the node. That directory must be on a filesystem every node
# sees (so does the build and the token written next to it).
# Environment: PSD_BUILD (./build), PSD_SHARDS (nodes), PSD_PORT (7070), PSD_BACKUP (1),
# PSD_STEPS (5000), PSD_CHECKPOINTS, PSD_METRICS_PORT (9090; empty: off).
#SBATCH --job-name=psd-train
#SBATCH --time=01:00:00
# SIGUSR1 to this script 5 min before the time limit: it asks the cluster for a checkpoint
# (psd_admin checkpoint; a shard stopped by a signal writes none of its own in a cluster), so the
# resubmitted job loses at most the steps of those last minutes.
#SBATCH --signal=B:USR1@300
# shellcheck disable=SC2016,SC2317  # single-quoted scripts expand in the tasks; traps call functions
set -euo pipefail
build=${PSD_BUILD:-$PWD/build}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
shards=${PSD_SHARDS:-${#nodes[@]}}
if [ "$shards" -lt 1 ] || [ "$shards" -gt "${#nodes[@]}" ]; then
  echo "psd_job.sh: PSD_SHARDS=$shards, but the allocation has ${#nodes[@]} node(s); use 1..${#nodes[@]}" >&2
  exit 2
fi
port=${PSD_PORT:-7070}
workers=$SLURM_NTASKS
backup=${PSD_BACKUP:-1}
replicas=$((workers - backup))
steps=${PSD_STEPS:-5000}
metrics_port=${PSD_METRICS_PORT-9090}
ckpt=${PSD_CHECKPOINTS:-$PWD/psd-checkpoints/$SLURM_JOB_NAME}

# The shards: node K of the allocation is shard K, the same list for every shard and worker.
cluster="" shard_nodes=""
for ((k = 0; k < shards; k++)); do
  cluster+="${cluster:+,}${nodes[k]}:$port"
  shard_nodes+="${shard_nodes:+,}${nodes[k]}"
done
mkdir -p "$ckpt"
# A fresh shared secret per run, readable by this user only (the job's tasks run as this user).
token=$ckpt/token
(umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$token")
export PSD_CLUSTER=$cluster PSD_NUM_WORKERS=$workers PSD_AUTH_TOKEN_FILE=$token
# The shards' own secret (--cluster-secret-file: they prove it to each other on every link; the
# workers are not told where it is), fresh per run as well.
cluster_secret=$ckpt/cluster-secret
(umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$cluster_secret")

psd_flags=(-R "$replicas" -B "$backup" --init-tokens 0 --checkpoint-every-s 600 --exit-when-done
           --auth-token-file "$token" --cluster-secret-file "$cluster_secret")
# One shard listens on all interfaces; in a cluster each shard listens on its own entry's port.
[ "$shards" -eq 1 ] && psd_flags+=(--host 0.0.0.0 --port "$port")
[ -n "$metrics_port" ] && psd_flags+=(--metrics-host 0.0.0.0 --metrics-port "$metrics_port")

# --overlap on both steps: the worker step shares the nodes' CPUs with the shard step instead of
# waiting for resources the shard step holds until the end. Each shard finds its index by its
# node name in the list (not by task order), so the checkpoint directory follows the index.
srun --overlap --nodes="$shards" --ntasks="$shards" --ntasks-per-node=1 --nodelist="$shard_nodes" \
  bash -c 'i=0
    for e in ${PSD_CLUSTER//,/ }; do [ "${e%:*}" = "$SLURMD_NODENAME" ] && break; i=$((i + 1)); done
    psd=$1 ckpt=$2; shift 2
    exec "$psd" --cluster "$PSD_CLUSTER" --shard-index "$i" --checkpoint-dir "$ckpt/shard-$i" "$@"' \
  psd-shard "$build/server/psd" "$ckpt" "${psd_flags[@]}" &
psd_step=$!

if [ $# -gt 0 ]; then
  trainer=("$@")
else
  # The example trainer, given the contract as flags; --retry-s: the shards may still be restoring.
  trainer=(sh -c 'exec "$0" --cluster "$PSD_CLUSTER" --worker-name "$PSD_WORKER_NAME" \
    --shard "$PSD_WORKER_INDEX" --auth-token-file "$PSD_AUTH_TOKEN_FILE" --steps "$1" --retry-s 300' \
    "$build/client/psd_logreg_worker" "$steps")
fi
# The worker step runs in the background so that the signal traps below run at once (bash runs a
# trap only when the foreground command returns; `wait` returns early for it).
srun --overlap --ntasks="$workers" \
  bash -c 'export PSD_WORKER_INDEX=$SLURM_PROCID PSD_WORKER_NAME=worker-$SLURM_PROCID; exec "$@"' \
  psd-worker "${trainer[@]}" &
worker_step=$!
checkpoint_now() {
  echo "psd_job.sh: time limit near; requesting a checkpoint" >&2
  "$build/client/psd_admin" --cluster "$PSD_CLUSTER" --auth-token-file "$token" checkpoint || true
}
stop_steps() {
  kill -TERM "$worker_step" "$psd_step" 2>/dev/null || true
}
trap checkpoint_now USR1
trap stop_steps TERM INT
status=0
while :; do
  wait "$worker_step" && status=0 || status=$?
  kill -0 "$worker_step" 2>/dev/null || break
done
trap - USR1 TERM INT
# --exit-when-done: the shards write a last checkpoint and exit once every worker has finished.
# If the workers failed (or never connected), stop the shards by SIGTERM instead.
if [ "$status" -eq 0 ]; then
  for _ in $(seq 300); do kill -0 "$psd_step" 2>/dev/null || break; sleep 1; done
fi
kill -TERM "$psd_step" 2>/dev/null || true
wait "$psd_step" || true
exit "$status"
