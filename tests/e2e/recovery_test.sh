#!/usr/bin/env bash
# e2e: psd checkpoints every few steps; it is killed with SIGKILL mid-training and restarted on
# the same port and directory; it restores the newest good checkpoint, the workers reconnect by
# themselves and the job finishes with the loss target. Then the newest checkpoint is corrupted
# and a restart must fall back to the previous one.
set -euo pipefail
psd=$1 worker=$2
run=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$run"' EXIT
source "$(dirname "$0")/cluster_lib.sh"
ckpt="$run/ckpt"
flags=(-R 2 -B 1 --init-tokens 0 --learning-rate 0.5 --checkpoint-dir "$ckpt" --checkpoint-every-steps 10 --exit-when-done)

# The port is the test's for its whole length (tests/e2e/listen.py): the restarted psd gets it back.
reserve_ports 1 "$run/reserved"
port=$(port_of "$(cat "$run/reserved")" 0)
timeout 120 "${serve_on[@]}" "$port" -- "$psd" --listen-fd 3 --port-file "$run/port" "${flags[@]}" 2> "$run/psd1.log" &
psd1=$!; pids+=($psd1)
for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
wpids=()
for i in 0 1 2; do
  timeout 120 "$worker" --port "$port" --worker-name "w$i" --shard $i --steps 400 --slow-ms 2 --print-every 0 \
    --retry-s 30 > "$run/w$i.log" 2>&1 &
  wpids+=($!); pids+=($!)
done
# Let it checkpoint a few times, then kill it without warning.
for _ in $(seq 400); do grep -q "checkpoint at step [3-9]0 written" "$run/psd1.log" 2>/dev/null && break; sleep 0.02; done
grep -q "checkpoint at step" "$run/psd1.log" || { echo "no checkpoint written"; cat "$run/psd1.log"; exit 1; }
real_psd=$(pgrep -P "$psd1")  # the psd under `timeout`
kill -9 "$real_psd"
wait "$psd1" 2>/dev/null || true
echo "killed psd after: $(grep 'checkpoint at step' "$run/psd1.log" | tail -1 | sed 's/.*checkpoint/checkpoint/')"
sleep 0.3
timeout 120 "${serve_on[@]}" "$port" -- "$psd" --listen-fd 3 "${flags[@]}" 2> "$run/psd2.log" &
psd2=$!; pids+=($psd2)
for p in "${wpids[@]}"; do wait "$p" || { echo "a worker failed"; cat "$run"/w*.log "$run/psd2.log"; exit 1; }; done
wait "$psd2" || { echo "restarted psd did not exit 0"; cat "$run/psd2.log"; exit 1; }
grep -q "restored .* at global step" "$run/psd2.log" || { echo "no restore"; cat "$run/psd2.log"; exit 1; }
grep "restored" "$run/psd2.log" | sed 's/.*restored/restored/'
# The workers, on this host, attached new segments to the restarted psd (their old ones died with it).
grep -q "shared memory attached" "$run/psd2.log" || { echo "no worker re-attached shared memory"; cat "$run/psd2.log"; exit 1; }
for i in 0 1 2; do
  final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\).*/\1/p' "$run/w$i.log")
  awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || { echo "w$i: loss $final"; cat "$run/w$i.log"; exit 1; }
done
echo "training finished after the restart: $(tail -1 "$run/w0.log")"

# Corrupt the newest checkpoint: the next start must use the previous one.
newest=$(ls -d "$ckpt"/ckpt-* | sort | tail -1)
previous=$(ls -d "$ckpt"/ckpt-* | sort | tail -2 | head -1)
printf 'garbage' | dd of="$newest/shard-0-of-1.psdckpt" bs=1 seek=40 conv=notrunc 2>/dev/null
timeout 30 "$psd" --port 0 --port-file "$run/port3" "${flags[@]}" 2> "$run/psd3.log" &
psd3=$!; pids+=($psd3)
for _ in $(seq 200); do grep -q "restored\|listening" "$run/psd3.log" 2>/dev/null && break; sleep 0.05; done
sleep 0.2
kill -TERM "$psd3"; wait "$psd3" || true
grep -q "is unusable" "$run/psd3.log" || { echo "corruption not detected"; cat "$run/psd3.log"; exit 1; }
want=$((10#$(basename "$previous" | sed 's/ckpt-//')))
grep -q "restored .* at global step $want " "$run/psd3.log" || { echo "did not fall back to step $want"; cat "$run/psd3.log"; exit 1; }
echo "corrupt newest checkpoint skipped; restored step $want"
echo "PASS"
