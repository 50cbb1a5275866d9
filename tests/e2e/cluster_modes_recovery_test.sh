#!/usr/bin/env bash
# e2e: async and ssp on a cluster of 3 real psd processes survive losing a shard: the chief orders
# the checkpoints (a cut of every shard under its count of pushes); kill -9 a shard mid-training
# (a non-chief in async, the chief in ssp), start it again: the cluster restores the newest such
# checkpoint as one, the workers retry, the job finishes at the loss target and every shard exits 0.
# With --replicas-per-shard 2 (the chief killed in async, a non-chief in ssp) the cluster forms from
# each part's newest live copy instead, and no checkpoint is read.
set -euo pipefail
psd=$1 worker=$2
source "$(dirname "$0")/cluster_lib.sh"
begin_e2e

reserve_cluster 3

declare -A shard_pid
recover() {  # $1: tag, $2: victim ("chief" or "other"), then psd flags
  local tag=$1 victim=$2; shift 2
  local flags=(--cluster "$cluster" --exit-when-done --checkpoint-dir "$run/$tag-ckpt" --checkpoint-every-steps 100
    --slice-bytes 4096 --summary-interval-s 0 --learning-rate 0.3 -R 1 -N 3 "$@")
  start_shard() {  # $1: index, $2: log name
    timeout 240 "${serve_on[@]}" "$(port_of "$cluster" "$1")" -- "$psd" "${flags[@]}" --shard-index "$1" --listen-fd 3 \
      2> "$run/$2.log" &
    shard_pid[$1]=$!
    pids+=($!)
  }
  for k in 0 1 2; do start_shard $k "$tag-s$k"; done
  local wp=()
  for w in 0 1 2; do
    timeout 240 "$worker" --cluster "$cluster" --worker-name "w$w" --shard "$w" --steps 3000 --features 1100 --rows 8192 \
      --slow-ms 2 --print-every 0 --retry-s 60 > "$run/$tag-w$w.log" 2>&1 &
    wp+=($!); pids+=($!)
  done
  wait_for "$run/$tag-s0.log" "checkpoint at step [0-9]+ sealed" 60 || fail "$tag: no checkpoint sealed"
  local chief k
  chief=$(grep -l "is the chief for term" "$run/$tag"-s?.log | head -1 | sed 's/.*-s\([0-9]\)\.log/\1/')
  k=$chief
  [ "$victim" = other ] && k=$(((chief + 1) % 3))
  kill -9 "$(real_pid "${shard_pid[$k]}")"
  echo "$tag: shard $k killed (the chief is shard $chief)"
  sleep 0.5
  start_shard "$k" "$tag-s${k}b"
  for p in "${wp[@]}"; do wait "$p" || fail "$tag: a worker failed"; done
  for s in 0 1 2; do wait "${shard_pid[$s]}" || fail "$tag: shard $s did not exit 0"; done
  local restored from="checkpoint step [0-9]+"
  [[ " $* " == *" --replicas-per-shard 2 "* ]] && from="each part's newest live copy"
  restored=$(grep -hE "running at epoch .* from $from" "$run/$tag"-s*.log | tail -1 | sed 's/.*cluster: //')
  [ -n "$restored" ] || fail "$tag: the cluster did not form from $from"
  echo "$tag: $restored"
  for w in 0 1 2; do
    local final
    final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\),.*/\1/p' "$run/$tag-w$w.log")
    awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || fail "$tag w$w: final loss '$final'"
  done
  echo "$tag: $(grep done: "$run/$tag-w0.log")"
}

recover async other --mode async
recover ssp chief --mode ssp --staleness 2
recover async-replicas chief --mode async --replicas-per-shard 2
recover ssp-replicas other --mode ssp --staleness 2 --replicas-per-shard 2
echo "PASS"
