#!/usr/bin/env bash
# Operations with real processes:
#  1. readiness through a restore: psd restoring a 192 MB checkpoint answers /healthz, says why it
#     is not ready on /readyz, and writes --port-file only after the restore (a log line says when
#     it starts and how long it took); psd_admin answers during it;
#  2. /metrics parses with the Prometheus client library's own parser (when Debian's
#     python3-prometheus-client is installed), histograms are consistent;
#  3. psd_admin's exit status: 3 while a cluster shard is missing (JSON says which), 0 once the
#     cluster serves, 1 when nothing answers.
#   ops_test.sh PSD PSD_ADMIN PSD_BENCH
set -euo pipefail
psd=$1 admin=$2 bench=$3
run=$(mktemp -d)
pids=()
source "$(dirname "$0")/cluster_lib.sh"
trap stop_all EXIT
wait_file() {  # wait_file PATH TENTHS
  for _ in $(seq "$2"); do [ -s "$1" ] && return 0; sleep 0.1; done
  return 1
}
get() { curl -s -o "$run/body" -w '%{http_code}' --max-time 5 "http://127.0.0.1:$1$2" || echo 000; }

# --- 1. readiness through a restore ----------------------------------------------------------
timeout 60 "$psd" --port 0 --port-file "$run/port1" --checkpoint-dir "$run/ckpt" 2> "$run/psd1.log" &
pid=$!
pids+=($pid)
wait_file "$run/port1" 100 || fail "psd did not start"
timeout 60 "$bench" --connect "127.0.0.1:$(cat "$run/port1")" --model-bytes 192M --variables 3 --steps 2 \
  --workers 1 > "$run/bench.log" 2>&1 || fail "psd_bench failed"
kill -TERM "$pid"
wait "$pid" || fail "psd did not stop cleanly"
ls "$run/ckpt" | grep -q ckpt- || fail "no checkpoint written at exit"

timeout 60 "$psd" --port 0 --port-file "$run/port2" --checkpoint-dir "$run/ckpt" --metrics-port 0 \
  --metrics-port-file "$run/mport2" 2> "$run/psd2.log" &
pid=$!
pids+=($pid)
wait_file "$run/mport2" 100 || fail "no metrics port"
mport=$(cat "$run/mport2")
saw_not_ready=0
for _ in $(seq 600); do
  if [ -s "$run/port2" ]; then
    # The port file exists only once the restore is done.
    grep -q "restored 3 variable(s) at global step" "$run/psd2.log" || fail "port file written before the restore ended"
    break
  fi
  code=$(get "$mport" /readyz)
  if [ "$code" = 503 ]; then
    saw_not_ready=1
    grep -q "restoring" "$run/body" || fail "/readyz 503 without saying why: $(cat "$run/body")"
    [ "$(get "$mport" /healthz)" = 200 ] || fail "/healthz must answer during a restore"
  fi
  sleep 0.02
done
[ -s "$run/port2" ] || fail "psd never became ready"
grep -q "restoring the newest good checkpoint" "$run/psd2.log" || fail "no log line when the restore starts"
[ "$(get "$mport" /readyz)" = 200 ] || fail "/readyz not 200 once ready"
json=$(timeout 10 "$admin" --port "$(cat "$run/port2")" --json status) || fail "psd_admin status failed when ready"
grep -q '"serving":true' <<< "$json" && grep -q '"ready":true' <<< "$json" || fail "psd_admin JSON: $json"
grep -q '"version":"' <<< "$json" && grep -q '"uptime_s":' <<< "$json" || fail "no version/uptime: $json"
echo "restore: /readyz said not ready during it: $saw_not_ready; $(grep -o 'restored .*' "$run/psd2.log")"

# --- 2. the metrics parse ---------------------------------------------------------------------
[ "$(get "$mport" /metrics)" = 200 ] || fail "/metrics"
cp "$run/body" "$run/metrics.txt"
grep -q '^psd_restore_duration_seconds{shard="0"} ' "$run/metrics.txt" || fail "no restore duration"
grep -q '^psd_model_bytes{shard="0"} ' "$run/metrics.txt" || fail "no model bytes"
if /usr/bin/python3 -c 'import prometheus_client' 2> /dev/null; then
  /usr/bin/python3 - "$run/metrics.txt" << 'EOF' || fail "the metrics do not parse"
import sys
from prometheus_client.parser import text_string_to_metric_families
families = list(text_string_to_metric_families(open(sys.argv[1]).read()))
names = {f.name for f in families}
for want in ("psd_global_step", "psd_step_duration_seconds", "psd_token_wait_seconds", "psd_pushes_accepted",
             "process_resident_memory_bytes", "psd_checkpoint_write_duration_seconds"):
    assert want in names, (want, sorted(names))
for f in families:
    if f.type != "histogram":
        continue
    buckets = [s.value for s in f.samples if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets), (f.name, buckets)
    count = [s.value for s in f.samples if s.name.endswith("_count")][0]
    assert buckets[-1] == count, (f.name, buckets[-1], count)
print(f"metrics: {len(families)} families parsed by prometheus_client")
EOF
else
  echo "note: python3-prometheus-client missing: format checked by the unit tests only"
fi
kill -TERM "$pid"
wait "$pid" || fail "psd did not stop cleanly"

# --- 3. psd_admin's exit status ---------------------------------------------------------------
# Three ports of the test's own (tests/e2e/listen.py): two shards, and one nobody listens on.
reserve_ports 3 "$run/ports"
cluster=$(cut -d, -f1,2 "$run/ports")
silent=$(port_of "$(cat "$run/ports")" 2)
timeout 60 "${serve_on[@]}" "$(port_of "$cluster" 0)" -- "$psd" --cluster "$cluster" --shard-index 0 --listen-fd 3 \
  --port-file "$run/c0.port" --metrics-port 0 --metrics-port-file "$run/c0.mport" --election-timeout-ms 300 \
  2> "$run/c0.log" &
pids+=($!)
wait_file "$run/c0.mport" 100 || fail "shard 0 did not start"
sleep 1
set +e
out=$(timeout 10 "$admin" --cluster "$cluster" --json status)
rc=$?
set -e
[ "$rc" = 3 ] || fail "psd_admin exit $rc with a shard missing (want 3): $out"
grep -q '"serving":false' <<< "$out" || fail "JSON does not say not serving: $out"
grep -q '"shard":1,"reachable":false' <<< "$out" || fail "JSON does not say shard 1 is unreachable: $out"
[ ! -e "$run/c0.port" ] || fail "shard 0 wrote its port file before the cluster formed"
[ "$(get "$(cat "$run/c0.mport")" /readyz)" = 503 ] || fail "/readyz of a lone shard"
timeout 60 "${serve_on[@]}" "$(port_of "$cluster" 1)" -- "$psd" --cluster "$cluster" --shard-index 1 --listen-fd 3 \
  --port-file "$run/c1.port" --election-timeout-ms 300 2> "$run/c1.log" &
pids+=($!)
wait_file "$run/c0.port" 200 && wait_file "$run/c1.port" 200 || fail "the cluster did not become ready"
out=$(timeout 10 "$admin" --cluster "$cluster" --json status) || fail "psd_admin exit $? once the cluster serves: $out"
grep -q '"serving":true' <<< "$out" && grep -q '"shards":2' <<< "$out" || fail "JSON: $out"
set +e
timeout 10 "$admin" --port "$silent" status > /dev/null 2>&1
rc=$?
set -e
[ "$rc" = 1 ] || fail "psd_admin exit $rc when nothing answers (want 1)"
echo "PASS: ops"
