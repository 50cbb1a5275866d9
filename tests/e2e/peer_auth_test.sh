#!/usr/bin/env bash
# e2e: shard links with --cluster-secret-file, real processes on 127.0.0.1.
#  1. a shard started with another cluster secret never joins: each side refuses the other's proof
#     on the link it dials (logged), and the cluster does not serve (no --port-file);
#  2. restarted with the right secret, it joins, the cluster forms and a worker trains to the end.
set -euo pipefail
psd=$1 worker=$2
source "$(dirname "$0")/cluster_lib.sh"
begin_e2e

# Two ports of this test's own (tests/e2e/listen.py): a restarted shard serves on its port again.
reserve_cluster 2
(umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$run/secret" &&
  od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$run/other")
common=(--cluster "$cluster" -R 1 -N 1 --init-tokens 0 --exit-when-done --summary-interval-s 0 --heartbeat-ms 50
        --election-timeout-ms 500)
shard() {  # $1: index, $2: secret file, $3: log name
  timeout 120 "${serve_on[@]}" "$(port_of "$cluster" "$1")" -- "$psd" --listen-fd 3 "${common[@]}" --shard-index "$1" \
    --cluster-secret-file "$2" --port-file "$run/$3.port" 2> "$run/$3.log" &
  pids+=($!)
}

# --- 1. a wrong secret: no link is trusted, nothing serves --------------------------------------
shard 0 "$run/secret" psd0
s0=${pids[-1]}
shard 1 "$run/other" bad1
bad=${pids[-1]}
wait_for "$run/psd0.log" "the link to shard 1 .* is not trusted: its proof is wrong" 20 ||
  fail "shard 0 did not refuse shard 1's proof"
wait_for "$run/bad1.log" "the link to shard 0 .* is not trusted: its proof is wrong" 20 ||
  fail "shard 1 did not refuse shard 0's proof"
[ ! -e "$run/psd0.port" ] && [ ! -e "$run/bad1.port" ] || fail "a cluster formed with two different secrets"
echo "wrong secret: refused both ways, the cluster does not serve"
kill -TERM "$bad"
wait "$bad" || true

# --- 2. the right secret: the cluster forms and trains --------------------------------------------
shard 1 "$run/secret" psd1
s1=${pids[-1]}
wait_for "$run/psd0.port" . 30 || fail "the cluster did not form with the right secret"
timeout 120 "$worker" --cluster "$cluster" --worker-name w0 --steps 20 --features 64 --batch 32 --print-every 0 \
  --retry-s 30 > "$run/w0.log" 2>&1 || fail "the worker failed"
grep -q "done: 20 local steps" "$run/w0.log" || fail "the worker did not finish its steps"
for p in "$s0" "$s1"; do wait "$p" || fail "a shard did not exit 0"; done
echo "right secret: the cluster formed and trained 20 steps; both shards exited 0"
