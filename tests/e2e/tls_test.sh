#!/usr/bin/env bash
# e2e: TLS with certificates made by deploy/make_tls_certs.sh.
#  1. psrun --tls-dir: a 2-shard cluster (peer links over TLS) and 2 workers with mutual TLS train
#     to the end.
#  2. a single psd with TLS: psd_admin status works over TLS, fails clearly without it or with a
#     CA that did not sign psd's certificate; psd keeps serving.
set -euo pipefail
psrun=$1 psd=$2 worker=$3 admin=$4
here=$(cd "$(dirname "$0")" && pwd)
run=$(mktemp -d)
bg=()
trap 'for p in "${bg[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$run"' EXIT
source "$here/cluster_lib.sh"
command -v openssl >/dev/null || { echo "SKIP: openssl is missing (deploy/install_deps.sh installs it)"; exit 77; }
bash "$here/../../deploy/make_tls_certs.sh" "$run/certs" >/dev/null
bash "$here/../../deploy/make_tls_certs.sh" "$run/other" >/dev/null

# --- 1. a TLS cluster through psrun -----------------------------------------------------------------
rc=0
timeout 120 "$psrun" --psd "$psd" --shards 2 --workers 2 --tls-dir "$run/certs" --log-dir "$run/logs" \
  --psd-arg=--summary-interval-s=0 -- "$worker" --steps 40 --print-every 20 > "$run/train.log" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || { cat "$run/train.log"; fail "psrun --tls-dir exited $rc"; }
grep -q -- "--tls-require-client-cert" "$run/train.log" || fail "psrun did not ask psd for mutual TLS"
for i in 0 1; do
  grep -qE "^\[worker $i\] \[worker-$i\] done: .*global step 40" "$run/train.log" || fail "worker $i did not finish"
done
grep -q "TLS handshake failed" "$run/train.log" && fail "a TLS handshake failed in the cluster"

# --- 2. psd_admin over TLS --------------------------------------------------------------------------
timeout 60 "$psd" --port 0 --port-file "$run/port" --summary-interval-s 0 \
  --tls-cert-file "$run/certs/server.pem" --tls-key-file "$run/certs/server.key" > "$run/psd.log" 2>&1 &
bg+=($!)
for _ in $(seq 1 200); do [ -s "$run/port" ] && break; sleep 0.05; done
port=$(cat "$run/port")
"$admin" --port "$port" --tls-ca-file "$run/certs/ca.pem" status > "$run/status.txt" ||
  fail "psd_admin status over TLS failed: $(cat "$run/status.txt")"
rc=0
"$admin" --port "$port" --tls-ca-file "$run/other/ca.pem" status > "$run/bad.txt" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "psd_admin accepted a certificate its CA did not sign"
grep -q "certificate verify failed" "$run/bad.txt" || fail "the CA mismatch is not named: $(cat "$run/bad.txt")"
rc=0
timeout 30 "$admin" --port "$port" status > "$run/plain.txt" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "psd_admin without TLS was served by a TLS psd"
grep -q "one side speaks TLS" "$run/psd.log" || fail "psd did not say why the plaintext client was refused"
"$admin" --port "$port" --tls-ca-file "$run/certs/ca.pem" status > /dev/null || fail "psd stopped serving"
echo "PASS"
