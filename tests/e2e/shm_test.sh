#!/usr/bin/env bash
# e2e: same-host shared memory with real processes.
#  1. psd and three workers on this host: every worker attaches a segment (psd logs it). One
#     worker is killed with SIGKILL mid-training, while its gradients may be half written into
#     its segment: psd goes on, the two others finish with the loss target, psd exits 0.
#  2. psd --no-shared-memory: the same job trains over TCP; no segment is attached.
# (A restarted psd and re-attaching workers: recovery_test.sh checks that; workers in another
# network namespace fall back to TCP: cluster_netns_test.sh.)
set -euo pipefail
psd=$1 worker=$2
run=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$run"' EXIT

start_psd() {  # $1: log file; the rest: extra flags
  local log=$1; shift
  rm -f "$run/port"
  timeout 120 "$psd" --port 0 --port-file "$run/port" -R 2 -B 1 --init-tokens 0 --learning-rate 0.5 \
    --exit-when-done --log-level info "$@" 2> "$log" &
  psd_pid=$!; pids+=($psd_pid)
  for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
  port=$(cat "$run/port")
}
check_loss() {  # $1: worker log
  local final
  final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\).*/\1/p' "$1")
  awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || { echo "$1: loss $final"; cat "$1"; exit 1; }
}

# 1. Shared memory, and a worker killed mid-step.
start_psd "$run/psd1.log"
timeout 120 "$worker" --port "$port" --worker-name victim --shard 2 --steps 100000 --slow-ms 1 --print-every 10 \
  > "$run/victim.log" 2>&1 &
victim=$!; pids+=($victim)
wpids=()
for i in 0 1; do
  timeout 120 "$worker" --port "$port" --worker-name "w$i" --shard $i --steps 600 --slow-ms 1 --print-every 0 \
    > "$run/w$i.log" 2>&1 &
  wpids+=($!); pids+=($!)
done
# Once all three are attached and the job is under way, SIGKILL the victim (no goodbye).
for _ in $(seq 400); do [ "$(grep -c 'shared memory attached' "$run/psd1.log")" -ge 3 ] && break; sleep 0.05; done
[ "$(grep -c 'shared memory attached' "$run/psd1.log")" -ge 3 ] || { echo "not every worker attached shared memory"; cat "$run/psd1.log"; exit 1; }
# The victim prints every 10 of its steps: kill it once it is 50 steps in (the others need 600).
for _ in $(seq 1000); do [ "$(grep -c 'global step' "$run/victim.log")" -ge 5 ] && break; sleep 0.01; done
[ "$(grep -c 'global step' "$run/victim.log")" -ge 5 ] || { echo "the victim did not train"; cat "$run/victim.log"; exit 1; }
kill -9 "$(pgrep -P "$victim")"
wait "$victim" 2>/dev/null || true
for p in "${wpids[@]}"; do wait "$p" || { echo "a worker failed"; cat "$run"/w*.log "$run/psd1.log"; exit 1; }; done
# psd is still serving after the kill: it finishes the job (the victim never said goodbye, so
# --exit-when-done waits for it; end it with SIGTERM) and stops cleanly.
kill -0 "$psd_pid" || { echo "psd died"; cat "$run/psd1.log"; exit 1; }
kill -TERM "$(pgrep -P "$psd_pid")"
wait "$psd_pid" || { echo "psd did not stop cleanly"; cat "$run/psd1.log"; exit 1; }
for i in 0 1; do check_loss "$run/w$i.log"; done
echo "shared memory: $(grep -c 'shared memory attached' "$run/psd1.log") segments attached; a worker killed mid-step; the others finished: $(tail -1 "$run/w0.log")"

# 2. --no-shared-memory: TCP only, same result.
start_psd "$run/psd2.log" --no-shared-memory
wpids=()
for i in 0 1 2; do
  timeout 120 "$worker" --port "$port" --worker-name "w$i" --shard $i --steps 400 --print-every 0 \
    > "$run/tcp$i.log" 2>&1 &
  wpids+=($!); pids+=($!)
done
for p in "${wpids[@]}"; do wait "$p" || { echo "a worker failed"; cat "$run"/tcp*.log "$run/psd2.log"; exit 1; }; done
wait "$psd_pid" || { echo "psd did not exit 0"; cat "$run/psd2.log"; exit 1; }
! grep -q "shared memory attached" "$run/psd2.log" || { echo "a segment was attached with --no-shared-memory"; exit 1; }
for i in 0 1 2; do check_loss "$run/tcp$i.log"; done
echo "--no-shared-memory: trained over TCP: $(tail -1 "$run/tcp0.log")"
echo "PASS"
