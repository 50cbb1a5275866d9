#!/usr/bin/env bash
# e2e: psd --help documents the flags; contradictory flags are refused at start with a message
# naming the flag (config-file mistakes name the line; protected mode refuses listening beyond
# loopback without a secret unless --insecure); SIGTERM and SIGINT stop a running psd cleanly with status 0; psd_admin reads
# the status and asks for a checkpoint without joining the job as a worker.
set -euo pipefail
psd=$1 admin=$2
run=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$run"' EXIT

help=$(timeout 10 "$psd" --help)
for flag in --host --port --replicas-to-aggregate --backup-replicas --total-replicas --init-tokens \
            --optimizer --learning-rate --log-level --max-frame-bytes --exit-when-done --token-timeout-ms \
            --listen-fd LISTEN_FDS; do
  grep -q -- "$flag" <<< "$help" || { echo "--help does not document $flag"; exit 1; }
done

if out=$(timeout 10 "$psd" -R 2 -B 1 -N 5 2>&1); then echo "contradictory flags accepted"; exit 1; fi
grep -q -- "--total-replicas" <<< "$out" || { echo "unclear message: $out"; exit 1; }
if out=$(timeout 10 "$psd" -R 4 -N 2 --init-tokens 1 2>&1); then echo "too few tokens accepted"; exit 1; fi
grep -q "Too few tokens to finish the first step: 1 (given) vs 2 (needed)" <<< "$out" || { echo "unclear: $out"; exit 1; }
if out=$(timeout 10 "$psd" --optimizer nope 2>&1); then echo "bad optimizer accepted"; exit 1; fi
grep -q -- "--optimizer" <<< "$out" || { echo "unclear: $out"; exit 1; }

# Refused at start, each with a message naming the flag (or the config file's line) and what to do.
refused() {  # refused "expected text" psd-args...
  local want=$1 out
  shift
  if out=$(timeout 10 "$psd" "$@" 2>&1); then echo "accepted: $*"; exit 1; fi
  grep -qF -- "$want" <<< "$out" || { echo "psd $*: unclear message: $out"; exit 1; }
}
# Two ports of this test's own (tests/e2e/listen.py), for cluster lists and passed sockets.
listen_py=$(dirname "$0")/listen.py
/usr/bin/python3 "$listen_py" reserve 2 "$run/ports" &
holder=$!
for _ in $(seq 100); do [ -s "$run/ports" ] && break; sleep 0.05; done
p0=$(cut -d, -f1 "$run/ports" | sed 's/.*://') p1=$(cut -d, -f2 "$run/ports" | sed 's/.*://')
refused "-B/--backup-replicas must be >= 0, got -1" -B -1
refused "--summary-interval-s must be in [0, " --summary-interval-s -5
refused "--cluster entry 0 '127.0.0.1:x' is not host:port" --cluster 127.0.0.1:x
refused "lists '127.0.0.1:$p0' twice" --cluster "127.0.0.1:$p0,127.0.0.1:$p0" --shard-index 1
refused "--shard-index 2 is outside the --cluster list of 2 shard(s)" --cluster "127.0.0.1:$p0,127.0.0.1:$p1" --shard-index 2
refused "--max-frame-bytes '64X' is not a size" --max-frame-bytes 64X
refused "--max-frame-bytes must be in [4 KiB, 16 GiB], got 1 KiB" --max-frame-bytes 1K
touch "$run/a-file"
refused "--checkpoint-dir $run/a-file/ckpt cannot be created" --port 0 --checkpoint-dir "$run/a-file/ckpt"
# --max-connections against the process's file descriptor limit (both numbers named).
out=$(ulimit -n 256; timeout 10 "$psd" --port 0 --max-connections 1000 2>&1) && { echo "fd limit ignored"; exit 1; }
grep -qF "needs 1192 file descriptors" <<< "$out" && grep -qF "at most 256" <<< "$out" || { echo "fd: $out"; exit 1; }
# A passed socket (--listen-fd, systemd's LISTEN_FDS) must be a listening TCP socket where psd is
# to listen (tests/e2e/listen.py binds one, on ports this test reserved).
refused "--listen-fd 5: descriptor 5 is not a socket" --listen-fd 5 5< "$run/a-file"
refused "--listen-fd 9: descriptor 9 is not open in psd" --listen-fd 9
if out=$(sh -c 'LISTEN_PID=$$ LISTEN_FDS=2 exec "$0" --port 0' "$psd" 2>&1); then echo "2 sockets accepted"; exit 1; fi
grep -qF "give the .socket unit a single ListenStream=" <<< "$out" || { echo "LISTEN_FDS=2: unclear: $out"; exit 1; }
served_refused() {  # served_refused "expected text" listen.py-serve-args -- psd-args...
  local want=$1 out
  shift
  if out=$(timeout 10 /usr/bin/python3 "$listen_py" serve "$@" 2>&1); then echo "accepted: $*"; exit 1; fi
  grep -qF -- "$want" <<< "$out" || { echo "$*: unclear message: $out"; exit 1; }
}
served_refused "--listen-fd 3 is bound to 127.0.0.1:$p0, but psd is to listen on 127.0.0.1:$p1" \
  "$p0" -- "$psd" --cluster "127.0.0.1:$p0,127.0.0.1:$p1" --shard-index 1 --listen-fd 3
served_refused "--listen-fd and systemd's LISTEN_FDS both pass a socket" --systemd "$p0" -- "$psd" --listen-fd 3
# systemd's way: a single daemon serves on the socket, at its address.
timeout 30 /usr/bin/python3 "$listen_py" serve --systemd "$p1" -- "$psd" --port-file "$run/sd.port" 2> "$run/sd.log" &
sd=$!
for _ in $(seq 200); do [ -s "$run/sd.port" ] && break; sleep 0.05; done
[ "$(cat "$run/sd.port" 2>/dev/null)" = "$p1" ] || { echo "LISTEN_FDS: not serving on $p1"; cat "$run/sd.log"; exit 1; }
timeout 10 "$admin" --port "$p1" status > /dev/null || { echo "LISTEN_FDS: psd_admin got no answer"; exit 1; }
kill -TERM "$sd"; wait "$sd" || { echo "psd on a systemd socket did not stop cleanly"; exit 1; }
kill "$holder"; wait "$holder" 2>/dev/null || true
# Config files are strict: the line is named, with a suggestion.
printf '# psd\nlearning-rate = 0.1\nreplicas-to-agregate = 4\n' > "$run/typo.conf"
refused "typo.conf:3: unknown key 'replicas-to-agregate' (did you mean replicas-to-aggregate?)" --config "$run/typo.conf"
printf '[server]\nport = 0\n' > "$run/section.conf"
refused "section.conf:1: section [server] is not supported" --config "$run/section.conf"
printf 'backup_replicas = 1\n' > "$run/snake.conf"
refused "snake.conf:1: key 'backup_replicas' is spelled 'backup-replicas'" --config "$run/snake.conf"
# Protected mode: beyond loopback needs --auth-token-file (or --insecure, deliberately).
refused "protected mode: psd would listen on --host 0.0.0.0" --host 0.0.0.0 --port 0
refused "pass --insecure to allow it deliberately" --metrics-host 0.0.0.0 --metrics-port 0 --port 0
printf 'host = "0.0.0.0"\n' > "$run/open.conf"
refused "protected mode" --config "$run/open.conf" --port 0
printf 's3cret\n' > "$run/token"
# A token that protects a listener beyond loopback is held to 16 characters (a short one is guessed).
refused "--auth-token-file holds 6 characters, too few to protect a daemon reachable beyond this host (--host 0.0.0.0)" \
  --host 0.0.0.0 --port 0 --auth-token-file "$run/token"
printf 'a-long-enough-workers-token\n' > "$run/long-token"
# A cluster beyond loopback needs the shards' own secret: the workers' token does not vouch for a shard.
refused "protected mode: the --cluster list has 10.0.0.2:7070, beyond loopback, and no cluster secret" \
  --cluster 127.0.0.1:7070,10.0.0.2:7070 --auth-token-file "$run/token"
refused "has psd-1.example:7070, beyond loopback" --cluster 127.0.0.1:7070,psd-1.example:7070
refused "--cluster-secret-file holds 6 characters; use at least 32" \
  --cluster 127.0.0.1:7070,10.0.0.2:7070 --cluster-secret-file "$run/token"
refused "--cluster-secret-file: cannot read the secret file $run/none" --cluster-secret-file "$run/none"
for allowed in "--auth-token-file $run/long-token" "--insecure"; do
  rm -f "$run/port"
  # shellcheck disable=SC2086 # the words of $allowed are flags
  timeout 30 "$psd" --host 0.0.0.0 --port 0 --port-file "$run/port" --max-frame-bytes 64M $allowed 2> "$run/psd.log" &
  pid=$!
  for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
  [ -s "$run/port" ] || { echo "psd $allowed did not start"; cat "$run/psd.log"; exit 1; }
  kill -TERM "$pid"; wait "$pid"; pid=""
done

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
for _ in $(seq 100); do grep -q '"last_checkpoint_step":0' <<< "$(timeout 10 "$admin" --port "$port" --json status)" && break; sleep 0.05; done
grep -q '"last_checkpoint_step":0' <<< "$(timeout 10 "$admin" --port "$port" --json status)" || { echo "no checkpoint"; exit 1; }
kill -TERM "$pid"; wait "$pid"; pid=""
echo "PASS"
