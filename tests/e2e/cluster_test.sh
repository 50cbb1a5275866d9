#!/usr/bin/env bash
# e2e: a psd cluster of real processes on 127.0.0.1.
#  1. 3 shards x 4 workers train to the same parameters as 1 shard (same model and data order;
#     equal within float tolerance: only the order of additions differs).
#  2. kill -9 the chief mid-training: the survivors elect a new chief (the failover time is
#     printed), workers are told which shard is missing; the killed shard is restarted, the
#     cluster restores its newest common checkpoint as one, and training goes on.
#  3. kill -9 a non-chief shard and restart it: the same, and the job finishes.
#  4. corrupt the newest checkpoint: a restarted cluster restores the previous one.
set -euo pipefail
psd=$1 worker=$2
source "$(dirname "$0")/cluster_lib.sh"
begin_e2e

# The 3 shards' ports, the test's until it ends: every cluster below (and every restarted shard)
# serves on them, each shard on a socket bound for it (serve_on, --listen-fd).
reserve_cluster 3
# Milliseconds since the epoch of a psd log line's timestamp.
log_ms() { date -d "$(echo "$1" | cut -c 1-23)" +%s%3N; }

# --- 1. 3 shards give the parameters of 1 shard -------------------------------------------------
train() {  # $1: shards, $2: tag
  local target wp=() sp=()
  local common=(-R 4 --init-tokens 0 --learning-rate 0.5 --exit-when-done --slice-bytes 8192 --summary-interval-s 0)
  if [ "$1" -eq 1 ]; then
    timeout 120 "$psd" --port 0 --port-file "$run/$2.port" "${common[@]}" 2> "$run/$2-psd.log" &
    sp+=($!); pids+=($!)
    wait_for "$run/$2.port" . 10 || fail "psd did not start"
    target=(--port "$(cat "$run/$2.port")")
  else
    for k in $(seq 0 $(($1 - 1))); do
      timeout 120 "${serve_on[@]}" "$(port_of "$cluster" "$k")" -- "$psd" --cluster "$cluster" --shard-index "$k" --listen-fd 3 \
        "${common[@]}" 2> "$run/$2-psd$k.log" &
      sp+=($!); pids+=($!)
    done
    target=(--cluster "$cluster")
  fi
  for w in 0 1 2 3; do
    timeout 120 "$worker" "${target[@]}" --worker-name "w$w" --shard "$w" --steps 60 --features 4096 --batch 64 \
      --print-every 0 --retry-s 30 > "$run/$2-w$w.log" 2>&1 &
    wp+=($!); pids+=($!)
  done
  for p in "${wp[@]}"; do wait "$p" || fail "$2: a worker failed"; done
  for p in "${sp[@]}"; do wait "$p" || fail "$2: a shard did not exit 0"; done
  # Tokens are shared (TF semantics): a fast worker may take two tokens of one step and push twice
  # while another skips that step. Then the runs differ by design; only lockstep runs compare.
  if [ "$(grep -l "done: 60 local steps" "$run/$2"-w*.log | wc -l)" -ne 4 ]; then
    echo "uneven"
    return
  fi
  sed -n 's/.*parameter sum \([-0-9.e+]*\),.*/\1/p' "$run/$2-w0.log"
}
lockstep() {  # $1: shards, $2: tag
  local got
  for try in 1 2 3 4 5; do
    got=$(train "$1" "$2-$try")
    [ "$got" != uneven ] && { echo "$got"; return; }
  done
  fail "$2: no run in lockstep in 5 tries"
}
one=$(lockstep 1 single)
three=$(lockstep 3 sharded)
echo "parameter sum: 1 shard $one, 3 shards $three"
awk -v a="$one" -v b="$three" 'BEGIN { d = a - b; if (d < 0) d = -d; m = a < 0 ? -a : a; exit !(a != "" && b != "" && d <= 1e-4 * (m + 1)) }' ||
  fail "3 shards trained to $three, 1 shard to $one"
grep -q "created variable 'logreg/w' float32 \[2048\]" "$run"/sharded-*psd*.log || fail "logreg/w was not sliced over two shards"

# --- 2-3. kill -9 the chief, then a non-chief shard ----------------------------------------------
ckpt="$run/ckpt"
flags=(--cluster "$cluster" -R 3 -B 1 --init-tokens 0 --learning-rate 0.5 --exit-when-done --checkpoint-dir "$ckpt"
  --checkpoint-every-steps 10 --slice-bytes 8192 --summary-interval-s 0)
declare -A shard_pid
start_shard() {  # $1: index, $2: log name
  timeout 240 "${serve_on[@]}" "$(port_of "$cluster" "$1")" -- "$psd" "${flags[@]}" --shard-index "$1" --listen-fd 3 2> "$run/$2.log" &
  shard_pid[$1]=$!
  pids+=($!)
}
for k in 0 1 2; do start_shard $k "s$k"; done
wp=()
for w in 0 1 2 3; do
  timeout 240 "$worker" --cluster "$cluster" --worker-name "w$w" --shard "$w" --steps 700 --features 1024 --slow-ms 2 \
    --print-every 0 --retry-s 60 > "$run/w$w.log" 2>&1 &
  wp+=($!); pids+=($!)
done
wait_for "$run/s0.log" "checkpoint at step ([2-9]|[1-9][0-9])0 sealed" 90 || fail "no checkpoint sealed"
kill_ms=$(date +%s%3N)
kill -9 "$(real_pid "${shard_pid[0]}")"
wait_for "$run/s1.log $run/s2.log" "is the chief for term" 10 || fail "no new chief"
elected=$(grep -h "is the chief for term" "$run/s1.log" "$run/s2.log" | head -1)
echo "chief shard 0 killed; $(echo "$elected" | sed 's/.*cluster: //'); failover $(($(log_ms "$elected") - kill_ms)) ms"
wait_for "$run/w*.log" "waiting for shard 0" 20 || fail "workers were not told which shard is missing"
echo "a worker was told: $(grep -h "waiting for shard 0" "$run"/w*.log | head -1 | sed 's/; retrying.*//')"
sleep 0.5
start_shard 0 s0b
wait_for "$run/s1.log $run/s2.log" "running at epoch .* from (checkpoint step [0-9]+|an empty state)" 30 ||
  fail "the cluster did not form again"
echo "$(grep -hE "running at epoch" "$run/s1.log" "$run/s2.log" | tail -1 | sed 's/.*cluster: //')"
rolled=$(sed -n 's/.*from checkpoint step \([0-9]*\).*/\1/p' "$run/s1.log" "$run/s2.log" | tail -1)
[ -n "$rolled" ] || fail "the cluster did not restore a checkpoint"
# Then a non-chief shard, once the cluster has checkpointed again.
wait_for "$run/s0b.log" "checkpoint at step [0-9]+ sealed" 60 || fail "no checkpoint after the first recovery"
victim=2
grep -q "is the chief for term" "$run/s2.log" && victim=1
kill -9 "$(real_pid "${shard_pid[$victim]}")"
echo "non-chief shard $victim killed"
sleep 0.5
start_shard $victim "s${victim}b"
for p in "${wp[@]}"; do wait "$p" || fail "a worker failed"; done
for k in 0 1 2; do wait "${shard_pid[$k]}" || fail "shard $k did not exit 0"; done
restores=$(cat "$run"/s*.log | grep -c "forming epoch .*: restoring checkpoint step" || true)
[ "$restores" -ge 2 ] || fail "expected two restores, saw $restores"
for w in 0 1 2 3; do
  final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\),.*/\1/p' "$run/w$w.log")
  awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || fail "w$w: final loss '$final'"
done
echo "training finished after both recoveries: $(grep done: "$run/w0.log")"

# --- 4. a corrupt newest checkpoint is never loaded ----------------------------------------------
newest=$(ls -d "$ckpt"/ckpt-* | sort | tail -1)
previous=$(ls -d "$ckpt"/ckpt-* | sort | tail -2 | head -1)
printf 'garbage' | dd of="$newest/shard-1-of-3.psdckpt" bs=1 seek=40 conv=notrunc 2>/dev/null
kept=()
for f in "${flags[@]}"; do [ "$f" = --exit-when-done ] || kept+=("$f"); done
flags=("${kept[@]}")
for k in 0 1 2; do start_shard $k "c$k"; done
wait_for "$run/c0.log" "running at epoch" 30 || fail "the restarted cluster did not form"
for k in 0 1 2; do kill -TERM "$(real_pid "${shard_pid[$k]}")" 2>/dev/null || true; done
for k in 0 1 2; do wait "${shard_pid[$k]}" || true; done
want=$((10#$(basename "$previous" | sed 's/ckpt-//')))
grep -q "unusable for shard 1" "$run/c1.log" || fail "the corrupt part was not detected"
grep -q "running at epoch .* from checkpoint step $want " "$run/c0.log" || fail "did not fall back to step $want"
echo "corrupt newest checkpoint skipped; the cluster restored step $want"
echo "PASS"
