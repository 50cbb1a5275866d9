#!/usr/bin/env bash
# e2e: the example model trained by a real psd and three real workers in every consistency mode
# (and with a slotted optimizer) must reach a loss target; psd must exit 0 by itself. Then the
# same on a cluster of 3 shards (the weights sliced over two, the bias on the third): async, ssp
# and soft sync, whose step deadline must have forced steps there.
set -euo pipefail
psd=$1 worker=$2
source "$(dirname "$0")/cluster_lib.sh"
begin_e2e

reserve_cluster 3

train() {  # name, shards (1 or 3), psd flags...
  local name=$1 shards=$2; shift 2
  local sp=() target=() data=()
  if [ "$shards" -eq 1 ]; then
    rm -f "$run/port"
    timeout 120 "$psd" --port 0 --port-file "$run/port" --exit-when-done "$@" 2> "$run/psd-$name.log" &
    sp+=($!); pids+=($!)
    for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
    target=(--port "$(cat "$run/port")")
  else
    for k in $(seq 0 $((shards - 1))); do
      timeout 120 "${serve_on[@]}" "$(port_of "$cluster" "$k")" -- "$psd" --cluster "$cluster" --shard-index "$k" \
        --listen-fd 3 --exit-when-done --slice-bytes 4096 --summary-interval-s 0 "$@" 2> "$run/psd-$name-$k.log" &
      sp+=($!); pids+=($!)
    done
    target=(--cluster "$cluster" --retry-s 30)
    data=(--features 1100 --rows 8192)  # 4400 bytes of weights: two slices, the bias on the third shard
  fi
  local wpids=()
  for i in 0 1 2; do
    local slow=0; [ $i -eq 2 ] && slow=${straggler_ms:-5}
    timeout 120 "$worker" "${target[@]}" "${data[@]}" --worker-name "w$i" --shard $i --steps 240 --slow-ms $slow \
      --print-every 0 > "$run/$name-w$i.log" 2>&1 &
    wpids+=($!); pids+=($!)
  done
  for p in "${wpids[@]}"; do wait "$p" || { echo "$name: a worker failed"; cat "$run/$name"-w*.log; exit 1; }; done
  for p in "${sp[@]}"; do wait "$p" || { echo "$name: psd did not exit 0"; cat "$run/psd-$name"*.log; exit 1; }; done
  for i in 0 1 2; do
    local final; final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\).*/\1/p' "$run/$name-w$i.log")
    awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || { echo "$name w$i: loss $final"; cat "$run/$name-w$i.log"; exit 1; }
  done
  echo "$name: $(tail -1 "$run/$name-w0.log")"
}

train async 1 --mode async --learning-rate 0.3 -R 1 -N 3
train ssp 1 --mode ssp --staleness 2 --learning-rate 0.3 -R 1 -N 3
train soft-sync 1 -R 3 -N 3 --init-tokens 0 --soft-sync-fraction 0.6 --step-deadline-ms 50 --learning-rate 0.5
train adam 1 -R 2 -B 1 --init-tokens 0 --optimizer adam --learning-rate 0.05

# A cluster: the global step is the chief's count of pushes (async/ssp), the ssp barrier the
# chief's, and a step deadline passed on one shard forces the step on all of them.
train cluster-async 3 --mode async --learning-rate 0.3 -R 1 -N 3
train cluster-ssp 3 --mode ssp --staleness 2 --learning-rate 0.3 -R 1 -N 3
# The straggler sleeps 30 ms a step, past the 20 ms deadline: steps commit without it.
straggler_ms=30 train cluster-soft-sync 3 -R 3 -N 3 --init-tokens 0 --step-deadline-ms 20 --learning-rate 0.5
grep -q "committed by the step deadline" "$run"/psd-cluster-soft-sync-*.log || { echo "no step was forced"; exit 1; }
echo "PASS"
