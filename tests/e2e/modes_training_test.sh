#!/usr/bin/env bash
# e2e: the example model trained by a real psd and three real workers in every consistency mode
# (and with a slotted optimizer) must reach a loss target; psd must exit 0 by itself.
set -euo pipefail
psd=$1 worker=$2
run=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$run"' EXIT

train() {  # name, psd flags...
  local name=$1; shift
  rm -f "$run/port"
  timeout 120 "$psd" --port 0 --port-file "$run/port" --exit-when-done "$@" 2> "$run/psd-$name.log" &
  local psd_pid=$!; pids+=($psd_pid)
  for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
  local port; port=$(cat "$run/port")
  local wpids=()
  for i in 0 1 2; do
    local slow=0; [ $i -eq 2 ] && slow=5
    timeout 120 "$worker" --port "$port" --worker-name "w$i" --shard $i --steps 240 --slow-ms $slow \
      --print-every 0 > "$run/$name-w$i.log" 2>&1 &
    wpids+=($!); pids+=($!)
  done
  for p in "${wpids[@]}"; do wait "$p" || { echo "$name: a worker failed"; cat "$run/$name"-w*.log; exit 1; }; done
  wait "$psd_pid" || { echo "$name: psd did not exit 0"; cat "$run/psd-$name.log"; exit 1; }
  for i in 0 1 2; do
    local final; final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\).*/\1/p' "$run/$name-w$i.log")
    awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || { echo "$name w$i: loss $final"; cat "$run/$name-w$i.log"; exit 1; }
  done
  echo "$name: $(tail -1 "$run/$name-w0.log")"
}

train async --mode async --learning-rate 0.3 -R 1 -N 3
train ssp --mode ssp --staleness 2 --learning-rate 0.3 -R 1 -N 3
train soft-sync -R 3 -N 3 --init-tokens 0 --soft-sync-fraction 0.6 --step-deadline-ms 50 --learning-rate 0.5
train adam -R 2 -B 1 --init-tokens 0 --optimizer adam --learning-rate 0.05
grep -q "committed by the step deadline\|a step now needs" "$run/psd-soft-sync.log" || true
echo "PASS"
