#!/usr/bin/env bash
# Slurm: psd on the first node of the allocation, one worker per task on all nodes.
#   sbatch --nodes=3 --ntasks-per-node=2 deploy/slurm/psd_job.sh
#SBATCH --job-name=psd-train
#SBATCH --time=01:00:00
set -euo pipefail
build=${PSD_BUILD:-$PWD/build}
workers=$SLURM_NTASKS
backup=${PSD_BACKUP:-1}
replicas=$((workers - backup))
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
port=${PSD_PORT:-7070}
ckpt=${PSD_CHECKPOINTS:-$PWD/psd-checkpoints-$SLURM_JOB_ID}

srun --nodes=1 --ntasks=1 -w "$head" --exact \
  "$build/server/psd" --host 0.0.0.0 --port "$port" -R "$replicas" -B "$backup" --init-tokens 0 \
  --checkpoint-dir "$ckpt" --checkpoint-every-s 600 --exit-when-done &
psd_step=$!
# Workers connect with retries (libpsclient keeps trying for connect_timeout_ms).
srun --ntasks="$workers" --exact bash -c \
  "exec '$build/client/psd_logreg_worker' --host '$head' --port $port --worker-name worker-\$SLURM_PROCID \
   --shard \$SLURM_PROCID --steps 5000 --retry-s 120"
wait "$psd_step"
