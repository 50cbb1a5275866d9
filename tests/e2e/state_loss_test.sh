#!/usr/bin/env bash
# e2e: a shard that lost its checkpoints never makes the cluster throw the others' away silently
# (README "Losing a shard's checkpoints"). 3 shards, each with its own --checkpoint-dir, 4 workers.
#  A. shard 2 is killed, its newest checkpoint deleted, and it is restarted: the chief refuses to
#     form (logged at error once), psd_admin status and the workers say why, nothing is restored;
#     `psd_admin recover --step <bad>` is refused; `psd_admin recover` forms at the newest common
#     step and training goes on.
#  B. shard 1 is killed, its whole checkpoint directory deleted, and it is restarted: the same
#     refusal; `recover` (no common step) is refused, `recover --empty` starts empty; the workers'
#     chief re-creates the variables from its latest values, the others wait for them, and the job
#     goes on.
#  C. shard 2 loses its whole directory again and is restarted with --allow-state-loss: the chief
#     forms empty without asking (logged at error), the variables come back again, and the job
#     ends (--exit-when-done).
set -euo pipefail
psd=$1 worker=$2 admin=$3
source "$(dirname "$0")/cluster_lib.sh"
begin_e2e

declare -A shard_pid
# Owned ports (tests/e2e/listen.py): every (re)started shard serves on its reserved port.
reserve_cluster 3
launch() { exec timeout 240 "${serve_on[@]}" "$(port_of "$cluster" "$1")" -- "$psd" --listen-fd 3 "${@:2}"; }
flags=(--cluster "$cluster" -R 3 -B 1 --init-tokens 0 --learning-rate 0.5 --exit-when-done --checkpoint-every-steps 10
  --slice-bytes 8192 --summary-interval-s 0)
start_shard() {  # $1: index, $2: log name, then more flags
  launch "$1" "${flags[@]}" --shard-index "$1" --checkpoint-dir "$run/ckpt$1" "${@:3}" 2> "$run/$2.log" &
  shard_pid[$1]=$!
  pids+=($!)
}
admin() { timeout 20 "$admin" --cluster "$cluster" "$@"; }
# Waits (up to $3 s) until the extended regex $2 matches at least $4 lines of file(s) $1.
wait_count() {
  local deadline=$((SECONDS + $3))
  until [ "$(cat $1 | grep -cE "$2")" -ge "$4" ]; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.05
  done
}
start_shard 0 s0 --metrics-port 0 --metrics-port-file "$run/metrics0"
for k in 1 2; do start_shard $k "s$k"; done
wp=()
for w in 0 1 2 3; do
  timeout 240 "$worker" --cluster "$cluster" --worker-name "w$w" --shard "$w" --steps 600 --features 1024 --slow-ms 10 \
    --print-every 10 --retry-s 90 > "$run/w$w.log" 2>&1 &
  wp+=($!); pids+=($!)
done
wait_for "$run/s0.log" "checkpoint at step ([3-9]|[1-9][0-9])0 sealed" 90 || fail "no checkpoint sealed"

# Waits for the chief's refusal after shard $1 came back; checks what everybody is told.
expect_refusal() {  # $1: the shard that lost checkpoints, $2: the chief's log
  wait_for "$2" "refusing to form the cluster" 30 || fail "the chief formed (or waited) without refusing"
  local st rc=0
  st=$(admin status 2>&1) || rc=$?
  [ "$rc" -eq 3 ] || fail "psd_admin status exit $rc while the cluster waits (want 3): $st"
  grep -q "refusing to form the cluster.*shard(s) $1 " <<< "$st" || fail "psd_admin status does not say why: $st"
  wait_for "$run/w*.log" "UNAVAILABLE.*refusing to form the cluster.*psd_admin" 30 || fail "the workers were not told why"
  local ready
  ready=$(curl -s -w ' %{http_code}' "http://127.0.0.1:$(cat "$run/metrics0")/readyz" | tr '\n' ' ')
  grep -q "refusing to form the cluster.* 503$" <<< "$ready" || fail "/readyz does not say why: $ready"
  echo "a worker was told: $(grep -h "refusing to form" "$run"/w*.log | tail -1)"
  # Logged once, however many heartbeats pass.
  local n
  n=$(grep -c "refusing to form the cluster" "$2")
  [ "$n" -eq 1 ] || fail "the refusal was logged $n times"
  grep "refusing to form" "$2" | grep -q "\[error\]" || fail "the refusal is not logged at error level"
}

# --- A. shard 2 loses its newest checkpoint ----------------------------------------------------
kill -9 "$(real_pid "${shard_pid[2]}")"
wait "${shard_pid[2]}" 2>/dev/null || true
# The newest step shard 0 sealed (so shard 2 wrote its part of it), and any newer part shard 2
# wrote: deleted. Not merely shard 2's newest directory: that may be a step nobody sealed, whose
# loss loses nothing (the chief then rightly forms without asking).
lost=$(grep -oE "checkpoint at step [0-9]+ sealed" "$run/s0.log" | tail -1 | grep -oE "[0-9]+")
newest=
for d in "$run"/ckpt2/ckpt-*; do
  s=$((10#$(basename "$d" | sed 's/ckpt-//')))
  [ "$s" -eq "$lost" ] && newest=$d
  [ "$s" -lt "$lost" ] || rm -rf "$d"
done
[ -n "$newest" ] || fail "shard 2 has no directory of the sealed step $lost"
previous=$((10#$(ls -d "$run"/ckpt2/ckpt-* | sort | tail -1 | xargs basename | sed 's/ckpt-//')))
echo "shard 2 killed; its checkpoint step $lost deleted (it still has step $previous)"
formed_before=$(grep -c "running at epoch" "$run/s0.log")
start_shard 2 s2b
expect_refusal 2 "$run/s0.log"
[ "$(grep -c "running at epoch" "$run/s0.log")" -eq "$formed_before" ] || fail "the cluster formed without a decision"
[ -d "$run/ckpt0/$(basename "$newest")" ] || fail "shard 0's checkpoint step $lost is gone"
out=$(admin recover --step 999999 2>&1) && fail "recover --step 999999 was accepted: $out"
grep -q "cannot be restored by every shard; those that can: $previous" <<< "$out" || fail "bad refusal: $out"
admin recover > "$run/recover-a.out" 2>&1 || fail "psd_admin recover: $(cat "$run/recover-a.out")"
wait_for "$run/s0.log" "running at epoch .* from checkpoint step $previous " 30 || fail "no formation at step $previous"
grep -q "by an operator's decision" "$run/s0.log" || fail "the decision was not logged"
echo "psd_admin recover: $(grep -h "running at epoch" "$run/s0.log" | tail -1 | sed 's/.*cluster: //')"

# --- B. shard 1 loses its whole checkpoint directory --------------------------------------------
wait_for "$run/s2b.log" "checkpoint at step [0-9]+ sealed" 60 || fail "no checkpoint after the first recovery"
kill -9 "$(real_pid "${shard_pid[1]}")"
wait "${shard_pid[1]}" 2>/dev/null || true
rm -rf "$run/ckpt1"
echo "shard 1 killed; its checkpoint directory deleted"
formed_before=$(grep -c "running at epoch" "$run/s0.log")
start_shard 1 s1b
# A new refusal (another shard): logged again, once.
wait_for "$run/s0.log" "refusing to form the cluster.*shard\(s\) 1 " 30 || fail "no refusal for shard 1"
[ "$(grep -c "refusing to form the cluster.*shard(s) 1 " "$run/s0.log")" -eq 1 ] || fail "the refusal was logged more than once"
st=$(admin status 2>&1) && fail "psd_admin status exit 0 while the cluster waits"
grep -q "refusing to form the cluster.*shard(s) 1 " <<< "$st" || fail "psd_admin status does not say why: $st"
[ "$(grep -c "running at epoch" "$run/s0.log")" -eq "$formed_before" ] || fail "the cluster formed without a decision"
out=$(admin recover 2>&1) && fail "recover without a common step was accepted: $out"
grep -q "recover --empty" <<< "$out" || fail "bad refusal: $out"
admin recover --empty > "$run/recover-b.out" 2>&1 || fail "psd_admin recover --empty: $(cat "$run/recover-b.out")"
wait_for "$run/s0.log" "running at epoch .* from an empty state" 30 || fail "no empty formation"
echo "psd_admin recover --empty: $(grep -h "running at epoch" "$run/s0.log" | tail -1 | sed 's/.*cluster: //')"
wait_for "$run/w*.log" "re-created them from this worker's latest values" 60 || fail "nobody re-created the variables"
echo "$(grep -h "re-created them" "$run"/w*.log | head -1)"

# --- C. decided in advance: --allow-state-loss ---------------------------------------------------
wait_for "$run/s1b.log" "checkpoint at step [0-9]+ sealed" 60 || fail "no checkpoint after the second recovery"
kill -9 "$(real_pid "${shard_pid[2]}")"
wait "${shard_pid[2]}" 2>/dev/null || true
rm -rf "$run/ckpt2"
start_shard 2 s2c --allow-state-loss
wait_for "$run/s0.log" "forming empty at step 0 with --allow-state-loss, losing checkpoint" 30 ||
  fail "--allow-state-loss did not let the chief form"
grep "with --allow-state-loss" "$run/s0.log" | grep -q "\[error\]" || fail "the loss is not logged at error level"
wait_count "$run/s0.log" "running at epoch .* from an empty state" 30 2 || fail "no second empty formation"
wait_count "$run/w*.log" "re-created them from this worker's latest values" 60 2 || fail "nobody re-created them again"
echo "--allow-state-loss: $(grep -h "forming empty at step 0 with --allow-state-loss" "$run/s0.log" | sed 's/.*cluster: //' | cut -c 1-120)..."
for p in "${wp[@]}"; do wait "$p" || fail "a worker failed"; done
for k in 0 1 2; do wait "${shard_pid[$k]}" || fail "shard $k did not exit 0"; done
if grep -h "NOT_FOUND" "$run"/w*.log; then fail "a worker saw NOT_FOUND"; fi
for w in 0 1 2 3; do
  final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\),.*/\1/p' "$run/w$w.log")
  awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || fail "w$w: final loss '$final'"
done
echo "training finished after the three losses: $(grep done: "$run/w0.log")"
echo "PASS"
