#!/usr/bin/env bash
# e2e: a real psd process and three real worker processes (2 to aggregate + 1 backup, the last a
# straggler) train the example model; the loss must fall, stale pushes must be reported, and
# psd must exit 0 by itself once all workers finished (--exit-when-done).
set -euo pipefail
psd=$1 worker=$2
run=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$run"' EXIT

timeout 120 "$psd" --port 0 --port-file "$run/port" -R 2 -B 1 --init-tokens 0 --learning-rate 0.5 \
  --exit-when-done --log-level info 2> "$run/psd.log" &
psd_pid=$!; pids+=($psd_pid)
for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
port=$(cat "$run/port")

wpids=()
# The straggler starts first and is connected before the others start, so it takes part from the
# first step whatever the machine's load (a late straggler could otherwise find the job done).
for i in 2 0 1; do
  slow=0; [ $i -eq 2 ] && slow=10
  timeout 120 "$worker" --port "$port" --worker-name "w$i" --shard $i --steps 400 --slow-ms $slow \
    --print-every 10 > "$run/w$i.log" 2>&1 &
  wpids+=($!); pids+=($!)
  if [ $i -eq 2 ]; then
    for _ in $(seq 200); do grep -q "worker 'w2'.*connected" "$run/psd.log" && break; sleep 0.05; done
  fi
done
for p in "${wpids[@]}"; do wait "$p" || { echo "a worker failed"; cat "$run"/w*.log; exit 1; }; done
wait "$psd_pid" || { echo "psd did not exit 0"; cat "$run/psd.log"; exit 1; }

cat "$run/w0.log" | tail -3
grep -q "all workers finished" "$run/psd.log" || { echo "psd did not report the end of the job"; exit 1; }
# Every worker reports "loss A -> B"; B must be well below A (ln 2 = 0.693 for the initial model).
for i in 0 1 2; do
  final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\).*/\1/p' "$run/w$i.log")
  echo "w$i final loss: $final"
  awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || { echo "w$i: loss did not fall"; cat "$run/w$i.log"; exit 1; }
done
# The straggler's late gradients were dropped and reported to it.
stale=$(sed -n 's/.*stale \([0-9]*\), loss.*/\1/p' "$run/w2.log")
echo "straggler stale pushes: $stale"
[ "${stale:-0}" -gt 0 ] || { echo "the straggler saw no stale pushes"; cat "$run/w2.log"; exit 1; }
echo "PASS"
