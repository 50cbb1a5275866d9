#!/usr/bin/env bash
# e2e: psd --help documents the flags; contradictory flags are refused at start with a message
# naming the flag; SIGTERM and SIGINT stop a running psd cleanly with status 0; psd_admin reads
# the status and asks for a checkpoint without joining the job as a worker.
set -euo pipefail
psd=$1 admin=$2
run=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$run"' EXIT

help=$(timeout 10 "$psd" --help)
for flag in --host --port --replicas-to-aggregate --backup-replicas --total-replicas --init-tokens \
            --optimizer --learning-rate --log-level --max-frame-bytes --exit-when-done --token-timeout-ms; do
  grep -q -- "$flag" <<< "$help" || { echo "--help does not document $flag"; exit 1; }
done

if out=$(timeout 10 "$psd" -R 2 -B 1 -N 5 2>&1); then echo "contradictory flags accepted"; exit 1; fi
grep -q -- "--total-replicas" <<< "$out" || { echo "unclear message: $out"; exit 1; }
if out=$(timeout 10 "$psd" -R 4 -N 2 --init-tokens 1 2>&1); then echo "too few tokens accepted"; exit 1; fi
grep -q "Too few tokens to finish the first step: 1 (given) vs 2 (needed)" <<< "$out" || { echo "unclear: $out"; exit 1; }
if out=$(timeout 10 "$psd" --optimizer nope 2>&1); then echo "bad optimizer accepted"; exit 1; fi
grep -q -- "--optimizer" <<< "$out" || { echo "unclear: $out"; exit 1; }

for sig in TERM INT; do
  rm -f "$run/port"
  timeout 30 "$psd" --port 0 --port-file "$run/port" 2> "$run/psd.log" &
  pid=$!
  for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
  [ -s "$run/port" ] || { echo "psd did not start"; cat "$run/psd.log"; exit 1; }
  kill -s "$sig" "$pid"
  if wait "$pid"; then echo "SIG$sig: clean exit"; else echo "SIG$sig: psd exited $?"; cat "$run/psd.log"; exit 1; fi
  pid=""
done
# A config file: keys are flags without dashes; the command line wins.
printf 'replicas-to-aggregate = 3\nbackup-replicas = 1\nlearning-rate = 0.2\n' > "$run/psd.conf"
rm -f "$run/port"
timeout 30 "$psd" --config "$run/psd.conf" --learning-rate 0.3 --port 0 --port-file "$run/port" 2> "$run/psd.log" &
pid=$!
for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
out=$(timeout 10 "$admin" --port "$(cat "$run/port")" status)
grep -q "R=3 of N=4" <<< "$out" && grep -q "learning rate 0.3" <<< "$out" || { echo "--config not applied: $out"; exit 1; }
kill -TERM "$pid"; wait "$pid"; pid=""

# psd_admin against a live daemon with a checkpoint directory.
rm -f "$run/port"
timeout 30 "$psd" --port 0 --port-file "$run/port" --checkpoint-dir "$run/ckpt" 2> "$run/psd.log" &
pid=$!
for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
port=$(cat "$run/port")
out=$(timeout 10 "$admin" --host localhost --port "$port" status)  # a name, resolved
grep -q "global step          0" <<< "$out" || { echo "psd_admin status: $out"; exit 1; }
grep -q "workers              0 connected" <<< "$out" || { echo "psd_admin counted as a worker: $out"; exit 1; }
timeout 10 "$admin" --port "$port" checkpoint | grep -q "checkpoint requested"
for _ in $(seq 100); do timeout 10 "$admin" --port "$port" --json status | grep -q '"last_checkpoint_step":0' && break; sleep 0.05; done
timeout 10 "$admin" --port "$port" --json status | grep -q '"last_checkpoint_step":0' || { echo "no checkpoint"; exit 1; }
kill -TERM "$pid"; wait "$pid"; pid=""
echo "PASS"
