#!/usr/bin/env bash
# The status page of a shard that stands in for another, in headless Chromium: 3 psd shards with
# replicas and takeover (--replicas-per-shard 2 --takeover-after-ms 1000), each with a status page
# (--metrics-port), train the example model with 3 workers; a non-chief shard k that holds a
# variable is killed with SIGKILL and not restarted. Once the cluster serves again with shard k on
# a stand-in run by shard k + 1, that shard's page must show the stand-in ("standing in for: shard
# k: serving, step N, V variables, ..." with V > 0), with a step that moves between two loads, and
# the chief's page must show the cluster running with nothing missing. A screenshot of the
# stand-in's host page is taken (kept in the build tree, for a look at the layout).
#   status_page_stand_in_test.sh PSD WORKER [SCREENSHOT_DIR]
set -u -o pipefail
psd=$1 worker=$2 shots=${3:-} steps=1000000
source "$(dirname "$0")/cluster_lib.sh"
source "$(dirname "$0")/replica_lib.sh"
source "$(dirname "$0")/chrome_lib.sh"
begin_e2e
need_chromium
reserve_cluster 3
start_shard() {  # replica_lib's, with a status page whose port goes to $run/mport-$1
  timeout 300 "${serve_on[@]}" "$(port_of "$cluster" "$1")" -- "$psd" "${flags[@]}" --shard-index "$1" --listen-fd 3 \
    --metrics-port 0 --metrics-port-file "$run/mport-$1" 2> "$run/$2.log" &
  shard_pid[$1]=$!
  pids+=($!)
}
flags=(--cluster "$cluster" -R 3 -N 3 --init-tokens 0 --learning-rate 0.3 --replicas-per-shard 2
  --summary-interval-s 0 --exit-when-done --heartbeat-ms 100 --election-timeout-ms 1000 --takeover-after-ms 1000)
for k in 0 1 2; do start_shard "$k" "s$k"; done
start_workers b
wait_for "$run/s*.log" "running at epoch" 30 || fail "the cluster did not start serving"
for k in 0 1 2; do wait_for "$run/mport-$k" . 10 || fail "shard $k wrote no status page port"; done
sleep 0.5
# A non-chief that holds a variable (its stand-in then serves something).
chief=$(chief_of)
for k in $(((chief + 1) % 3)) $(((chief + 2) % 3)); do
  grep -q "created variable" "$run/s$k.log" && break
done
grep -q "created variable" "$run/s$k.log" || fail "no non-chief shard holds a variable"
formed=$(running)
kill -9 "$(real_pid "${shard_pid[$k]}")"
wait "${shard_pid[$k]}" 2> /dev/null
host=$(((k + 1) % 3))
wait_for "$run/s*.log" "shard $k .* is served by a stand-in at" 60 || fail "no stand-in served shard $k"
deadline=$((SECONDS + 60))
while [ "$(running)" -le "$formed" ]; do
  [ $SECONDS -lt $deadline ] || fail "the cluster did not serve again within 60 s of shard $k's kill"
  sleep 0.05
done
chief=$(chief_of)
echo "shard $k killed; shard $host stands in for it; shard $chief is the chief"

page() { echo "http://127.0.0.1:$(cat "$run/mport-$1")/"; }
# The stand-in's row: "shard K: serving, step N, ..." (the page polls /status.json every second).
stand_in_step() { sed -n "s/.*<th>standing in for<\/th><td>shard $k: serving, step \([0-9][0-9]*\), [1-9][0-9]* variables\{0,1\},.*/\1/p" | head -1; }
chrome 1 --virtual-time-budget=3000 --dump-dom "$(page "$host")" > "$run/host1.html" ||
  fail "chromium failed: $(tail -5 "$run/chrome.log")"
sleep 2
chrome 2 --virtual-time-budget=3000 --dump-dom "$(page "$host")" > "$run/host2.html" || fail "chromium failed"
grep -q 'data-updates="[1-9]' "$run/host1.html" || fail "shard $host's page never rendered /status.json"
s1=$(stand_in_step < "$run/host1.html")
s2=$(stand_in_step < "$run/host2.html")
[ -n "$s1" ] && [ -n "$s2" ] ||
  fail "shard $host's page shows no serving stand-in for shard $k: $(grep -o '<tbody id="cluster">.*</tbody>' "$run/host2.html" | head -c 1500)"
[ "$s2" -gt "$s1" ] || fail "the stand-in's step did not move between two loads ($s1 then $s2)"
chrome 3 --virtual-time-budget=3000 --dump-dom "$(page "$chief")" > "$run/chief.html" || fail "chromium failed"
grep -q "<th>chief shard</th><td>$chief</td>" "$run/chief.html" || fail "the chief's page does not name it the chief"
grep -q "<th>state</th><td>running</td>" "$run/chief.html" || fail "the chief's page does not show the cluster running"
grep -q "<th>missing</th><td>none</td>" "$run/chief.html" || fail "the chief's page shows a shard missing"
echo "status page of shard $host: standing in for shard $k, serving, step $s1 then $s2; the chief's page: running, none missing"

screenshot "$(page "$host")" status_page_stand_in.png "$shots"
echo "PASS: status page of a stand-in"
