#!/usr/bin/env bash
# e2e: a single psd comes back from nothing (README "Losing a shard's checkpoints").
#  1. psd is killed with SIGKILL mid-training, its checkpoint directory deleted, and it is
#     restarted on the same port: the SyncReplicasOptimizer trainers go on — the workers' chief
#     re-creates the variables from its latest values, the others wait for them (no NOT_FOUND),
#     the loss goes on from where it was, and the job ends (--exit-when-done).
#  2. A job whose workers all gave up (killed; none finished) still ends with --exit-when-done
#     once they are counted as gone (--worker-grace-s).
set -euo pipefail
psd=$1 worker=$2
source "$(dirname "$0")/cluster_lib.sh"
begin_e2e
ckpt="$run/ckpt"
flags=(-R 2 -B 1 --init-tokens 0 --learning-rate 0.5 --checkpoint-dir "$ckpt" --checkpoint-every-steps 10 --exit-when-done
  --summary-interval-s 0)

# Owned port (tests/e2e/listen.py): the restarted psd gets it back.
reserve_ports 1 "$run/reserved"
port=$(port_of "$(cat "$run/reserved")" 0)
launch() { exec timeout 120 "${serve_on[@]}" "$port" -- "$psd" --listen-fd 3 "$@"; }
launch "${flags[@]}" 2> "$run/psd1.log" &
psd1=$!; pids+=($psd1)
wait_for "$run/psd1.log" "listening" 10 || fail "psd did not start"

# --- 1. psd restarted without its checkpoints --------------------------------------------------
wpids=()
for i in 0 1 2; do
  timeout 120 "$worker" --port "$port" --worker-name "w$i" --shard $i --steps 300 --slow-ms 10 --print-every 5 \
    --retry-s 60 > "$run/w$i.log" 2>&1 &
  wpids+=($!); pids+=($!)
done
wait_for "$run/psd1.log" "checkpoint at step [3-9]0 written" 60 || fail "no checkpoint written"
kill -9 "$(real_pid "$psd1")"
wait "$psd1" 2>/dev/null || true
rm -rf "$ckpt"
before=$(grep -h "global step" "$run"/w*.log | tail -1)
echo "psd killed and its checkpoints deleted; last step seen: $before"
launch "${flags[@]}" 2> "$run/psd2.log" &
psd2=$!; pids+=($psd2)
for p in "${wpids[@]}"; do wait "$p" || fail "a worker failed"; done
wait "$psd2" || fail "the restarted psd did not exit 0"
grep -q "restored" "$run/psd2.log" && fail "the restarted psd restored something"
if grep -h "NOT_FOUND" "$run"/w*.log; then fail "a worker saw NOT_FOUND"; fi
line=$(grep -h "re-created them from this worker's latest values" "$run"/w*.log | head -1)
[ -n "$line" ] || fail "nobody re-created the variables"
echo "$line"
# The loss goes on from the trained values: well below the initial model's ln 2 = 0.693.
after=$(echo "$line" | sed -n 's/.*loss \([0-9.]*\)$/\1/p')
awk -v a="$after" 'BEGIN { exit !(a != "" && a < 0.6) }' || fail "the loss after the restart is $after: not the trained values"
for i in 0 1 2; do
  final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\).*/\1/p' "$run/w$i.log")
  awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || fail "w$i: final loss $final"
done
echo "training finished after the empty restart: $(grep done: "$run/w0.log")"

# --- 2. every worker gives up: the job still ends ----------------------------------------------
timeout 60 "$psd" --port 0 --port-file "$run/port3" -R 2 --init-tokens 0 --exit-when-done --worker-grace-s 1 \
  --summary-interval-s 0 2> "$run/psd3.log" &
psd3=$!; pids+=($psd3)
wait_for "$run/port3" . 10 || fail "psd did not start"
gp=()
for i in 0 1; do
  timeout 60 "$worker" --port "$(cat "$run/port3")" --worker-name "g$i" --shard $i --steps 100000 --slow-ms 10 \
    --print-every 1 > "$run/g$i.log" 2>&1 &
  gp+=($!); pids+=($!)
done
wait_for "$run/g0.log $run/g1.log" "global step +5 " 30 || fail "the workers did not train"
for p in "${gp[@]}"; do kill -9 "$(pgrep -P "$p")" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
rc=0
wait "$psd3" || rc=$?
[ "$rc" -eq 0 ] || fail "psd did not end after every worker gave up (exit $rc)"
grep -q "every worker is gone without finishing" "$run/psd3.log" || fail "psd did not say why it ended"
echo "every worker gave up: $(grep -h "every worker is gone" "$run/psd3.log" | sed 's/.*\] //')"
echo "PASS"
