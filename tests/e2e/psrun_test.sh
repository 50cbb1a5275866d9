#!/usr/bin/env bash
# e2e: psrun, the launcher.
#  1. a 2-shard cluster + 3 psd_logreg_worker processes train to the end; psrun exits 0 and psd
#     exits by itself.
#  2. the environment contract reaches a shell-script trainer with the right values, and lines
#     written in pieces come out whole, each with its process's prefix.
#  3. a failing worker: psrun stops the others and exits with its code; a missing command: 127;
#     --timeout-s: 124; a subprocess that outlives its worker is stopped at the end.
#  4. SIGINT to psrun stops everything it started, the trainers' own subprocesses included.
#  5. psrun binds every shard's socket itself (port 0) and hands it over as descriptor 3, so no
#     port is guessed; a psd never ready: named.
#  6. --restart-shards with shard replicas: a shard killed with SIGKILL mid-training is started
#     again on its port, catches up from the copy the next shard keeps (no checkpoint), and the job
#     finishes with exit 0.
set -euo pipefail
psrun=$1 psd=$2 worker=$3
run=$(mktemp -d)
bg=()
trap 'for p in "${bg[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$run"' EXIT
source "$(dirname "$0")/cluster_lib.sh"

# Every PID psrun reported starting ("[psrun] worker 1: pid 123: ...").
started_pids() { sed -n 's/^\[psrun\] [a-z]* [0-9]*: pid \([0-9]*\):.*/\1/p' "$1"; }
# Whether a PID runs (a zombie, left for a container's init to reap, does not).
alive() { kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" | cut -c1)" != Z ]; }
# Fails when any of the given PIDs is still running.
none_alive() {
  local p
  for p in "$@"; do
    if alive "$p"; then fail "pid $p is still running: $(ps -o pid,args= -p "$p" | tail -1)"; fi
  done
}

# --- 1. a cluster and the example trainer ---------------------------------------------------------
rc=0
timeout 120 "$psrun" --psd "$psd" --shards 2 --workers 3 --replicas 2 --auth auto --log-dir "$run/logs" \
  --psd-arg=--learning-rate=0.5 --psd-arg=--slice-bytes=4096 --psd-arg=--summary-interval-s=0 \
  -- "$worker" --steps 200 --features 2048 --print-every 50 > "$run/train.log" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || fail "psrun with 3 logreg workers exited $rc"
for i in 0 1 2; do
  grep -qE "^\[worker $i\] \[worker-$i\] done: .*global step 200" "$run/train.log" || fail "worker $i did not finish"
done
grep -q "^\[psrun\] all 3 workers finished" "$run/train.log" || fail "no summary line"
grep -q "stopping everything" "$run/train.log" && fail "psd was stopped instead of exiting by itself"
for k in 0 1; do
  grep -q "^\[psrun\] psd $k exited with status 0" "$run/train.log" || fail "psd $k did not exit 0"
  grep -q "psd stopped: all workers finished" "$run/logs/psd-$k.log" || fail "psd $k log: no clean exit"
done
grep -q "\-\-auth-token-file" "$run/train.log" || fail "--auth auto did not give psd a token"
grep -q "\-\-cluster-secret-file" "$run/train.log" || fail "psrun did not give the shards a cluster secret"
for k in 0 1; do
  grep -q "shard links: each end proves the cluster secret" "$run/logs/psd-$k.log" ||
    fail "psd $k: its links are not proven by a cluster secret"
done
echo "1. 2 shards + 3 logreg workers: exit 0; $(grep -h 'done:' "$run/train.log" | head -1)"

# --- 2. the environment contract and whole lines --------------------------------------------------
printf 'secret-token\n' > "$run/token"
cat > "$run/trainer.sh" <<'EOF'
echo "env index=$PSD_WORKER_INDEX n=$PSD_NUM_WORKERS name=$PSD_WORKER_NAME chief=$PSD_CHIEF_ELIGIBLE cluster=$PSD_CLUSTER token=${PSD_AUTH_TOKEN_FILE-unset}"
for n in $(seq 50); do
  printf '%s' "$PSD_WORKER_INDEX-start-"; printf '%0300d' 0; printf '%s\n' "-end-$PSD_WORKER_INDEX"
  printf 'err %s' "$PSD_WORKER_INDEX" >&2; printf ' line\n' >&2
done
printf 'no newline at the end'
EOF
rc=0
PSD_WORKER_INDEX=99 timeout 60 "$psrun" --psd "$psd" --shards 2 --workers 4 --replicas 3 \
  --auth-token-file "$run/token" -- sh "$run/trainer.sh" > "$run/env.out" 2> "$run/env.err" || rc=$?
cat "$run/env.out" "$run/env.err" > "$run/env.log"
[ "$rc" -eq 0 ] || fail "the shell trainer under psrun exited $rc"
cluster=$(sed -n 's/^\[psrun\] psd cluster of 2 shards serves on \(.*\)$/\1/p' "$run/env.err")
[[ "$cluster" =~ ^127\.0\.0\.1:[0-9]+,127\.0\.0\.1:[0-9]+$ ]] || fail "no cluster line: '$cluster'"
for i in 0 1 2 3; do
  chief=0
  [ $i -eq 0 ] && chief=1
  want="[worker $i] env index=$i n=4 name=worker-$i chief=$chief cluster=$cluster token=$run/token"
  grep -qxF "$want" "$run/env.out" || fail "worker $i: expected '$want', got '$(grep "^\[worker $i\] env" "$run/env.out")'"
  [ "$(grep -c "^\[worker $i\] " "$run/env.out")" -eq 52 ] || fail "worker $i: expected 52 stdout lines"
  [ "$(grep -cxE "\[worker $i\] $i-start-0{300}-end-$i" "$run/env.out")" -eq 50 ] || fail "worker $i: a line was cut or mixed"
  [ "$(grep -cxF "[worker $i] err $i line" "$run/env.err")" -eq 50 ] || fail "worker $i: stderr lines were cut or mixed"
  grep -qxF "[worker $i] no newline at the end" "$run/env.out" || fail "worker $i: the last partial line was lost"
done
grep -cE '^\[psd [01]\] ' "$run/env.err" > /dev/null || fail "no prefixed psd output"
echo "2. the contract reached 4 shell workers: $(grep -F '[worker 0] env' "$run/env.out" | cut -c 12-)"

# --- 3. a failing worker, a missing command, --timeout-s ------------------------------------------
rc=0
timeout 60 "$psrun" --psd "$psd" --shards 2 --workers 3 --grace-s 5 -- sh -c \
  'if [ "$PSD_WORKER_INDEX" = 1 ]; then sleep 0.5; echo failing; exit 7; fi; sleep 300 & echo "child $!"; wait' \
  > "$run/fail.log" 2>&1 || rc=$?
[ "$rc" -eq 7 ] || fail "psrun exited $rc with a worker failing with 7"
grep -q "^\[psrun\] worker 1 exited with status 7" "$run/fail.log" || fail "the failure was not reported"
grep -q "worker 1 failed (--on-failure stop): stopping everything" "$run/fail.log" || fail "the others were not stopped"
# shellcheck disable=SC2046
none_alive $(started_pids "$run/fail.log") $(sed -n 's/^\[worker [0-9]\] child \([0-9]*\)$/\1/p' "$run/fail.log")
rc=0
timeout 60 "$psrun" --psd "$psd" --workers 3 --on-failure continue -- sh -c \
  'if [ "$PSD_WORKER_INDEX" = 1 ]; then exit 5; fi; sleep 0.3; echo ok' > "$run/continue.log" 2>&1 || rc=$?
[ "$rc" -eq 5 ] || fail "--on-failure continue: psrun exited $rc (expected the failure's 5)"
[ "$(grep -c '^\[worker [02]\] ok$' "$run/continue.log")" -eq 2 ] || fail "--on-failure continue stopped the others"
grep -q "^\[psrun\] 2 of 3 workers finished, 1 failed" "$run/continue.log" || fail "no summary of the failures"
echo "3. a worker exiting 7: psrun stopped the others and exited 7; --on-failure continue: the others finished, exit 5"
rc=0
timeout 60 "$psrun" --psd "$psd" --workers 2 -- /nonexistent/trainer > "$run/missing.log" 2>&1 || rc=$?
[ "$rc" -eq 127 ] || fail "a missing command: psrun exited $rc"
grep -qE "^\[worker [01]\] psrun: cannot run '/nonexistent/trainer': No such file or directory" "$run/missing.log" ||
  fail "no clear error for a missing command"
rc=0
timeout 60 "$psrun" --psd "$psd" --workers 1 --timeout-s 1 -- sleep 300 > "$run/timeout.log" 2>&1 || rc=$?
[ "$rc" -eq 124 ] || fail "--timeout-s: psrun exited $rc"
none_alive $(started_pids "$run/timeout.log")
rc=0
timeout 60 "$psrun" --psd "$psd" --workers 1 --grace-s 5 -- sh -c \
  'sleep 300 & echo "child $!"; exec "$0" --steps 20 --print-every 0' "$worker" > "$run/linger.log" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || fail "a worker leaving a subprocess behind: psrun exited $rc"
# (psd normally exits by itself first; on a very slow machine psrun may stop it, and the group, first)
grep -qE "^\[psrun\] (worker 0: its subprocesses outlived it: stopping its process group|.*: stopping everything)" \
  "$run/linger.log" || fail "the subprocess that outlived its worker was not stopped"
none_alive $(sed -n 's/^\[worker 0\] child \([0-9]*\)$/\1/p' "$run/linger.log")
echo "   a missing command: 127 with the reason; --timeout-s 1: 124, nothing left; a leftover subprocess: stopped"

# --- 4. SIGINT stops everything -----------------------------------------------------------------------
"$psrun" --psd "$psd" --shards 2 --workers 3 --grace-s 5 -- sh -c 'sleep 300 & echo "child $!"; wait' \
  > "$run/int.log" 2>&1 &
launcher=$!
bg+=($launcher)
for _ in $(seq 600); do
  [ "$(grep -c '^\[worker [0-9]\] child ' "$run/int.log")" -eq 3 ] && break
  sleep 0.05
done
[ "$(grep -c '^\[worker [0-9]\] child ' "$run/int.log")" -eq 3 ] || fail "the workers did not start"
pids=$(started_pids "$run/int.log")
children=$(sed -n 's/^\[worker [0-9]\] child \([0-9]*\)$/\1/p' "$run/int.log")
[ "$(echo "$pids" | wc -w)" -eq 5 ] || fail "expected 5 started processes, saw: $pids"
# shellcheck disable=SC2086
none_alive_before() { for p in $pids $children; do alive "$p" || fail "pid $p died early"; done; }
none_alive_before
kill -INT "$launcher"
rc=0
# psrun SIGKILLs what SIGTERM did not stop after --grace-s 5: bounded.
wait "$launcher" || rc=$?
[ "$rc" -eq 130 ] || fail "psrun exited $rc after SIGINT (expected 130)"
grep -q "got Interrupt: stopping everything psrun started" "$run/int.log" || fail "SIGINT was not reported"
# shellcheck disable=SC2086
none_alive $pids $children
echo "4. SIGINT: psrun exited 130, its 5 processes and the trainers' subprocesses are gone"

# --- 5. the shards' sockets come from psrun; a psd that never gets ready ----------------------------
# A wrapper records what each shard inherits as descriptor 3: the socket psrun bound for it.
cat > "$run/fd_psd.sh" <<EOF
#!/bin/sh
echo "\$* fd3=\$(readlink /proc/self/fd/3)" >> "$run/fd3.txt"
exec "$psd" "\$@"
EOF
chmod +x "$run/fd_psd.sh"
rc=0
timeout 120 "$psrun" --psd "$run/fd_psd.sh" --shards 2 --workers 2 -- "$worker" --steps 50 --print-every 0 \
  > "$run/fds.log" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || fail "psrun exited $rc with 2 shards"
[ "$(grep -c "done: " "$run/fds.log")" -eq 2 ] || fail "the workers did not finish"
[ "$(grep -cE -- "--listen-fd 3 --cluster 127\.0\.0\.1:[0-9]+,127\.0\.0\.1:[0-9]+ .* fd3=socket:" "$run/fd3.txt")" -eq 2 ] ||
  fail "the shards did not get their listening sockets as descriptor 3: $(cat "$run/fd3.txt")"
printf '#!/bin/sh\necho "restoring for a long time"\nexec sleep 300\n' > "$run/slow_psd.sh"
chmod +x "$run/slow_psd.sh"
rc=0
timeout 60 "$psrun" --psd "$run/slow_psd.sh" --start-timeout-s 1 --grace-s 2 -- true > "$run/slow.log" 2>&1 || rc=$?
[ "$rc" -eq 1 ] || fail "psrun exited $rc when psd never got ready"
grep -q "psd shard 0 was not ready within --start-timeout-s 1 (no .*psd-0.port): read its output above (\[psd 0\] lines)" \
  "$run/slow.log" || fail "no clear error for a psd that never got ready"
# shellcheck disable=SC2046
none_alive $(started_pids "$run/slow.log")
echo "5. the shards served on the sockets psrun bound for them; a psd never ready: exit 1, named"
# --- 6. a shard killed mid-training, started again, catching up from the live copies ---------------
rc=0
timeout 200 "$psrun" --psd "$psd" --shards 3 --workers 3 --restart-shards 2 --log-dir "$run/logs6" \
  --psd-arg=--replicas-per-shard=2 --psd-arg=--learning-rate=0.5 --psd-arg=--slice-bytes=4096 \
  --psd-arg=--summary-interval-s=0 \
  -- "$worker" --steps 1500 --features 2048 --print-every 100 --slow-ms 2 > "$run/restart.log" 2>&1 &
psrun_pid=$!
bg+=("$psrun_pid")
for _ in $(seq 600); do
  grep -qE "^\[worker 0\] .*global step +[2-9]00 " "$run/restart.log" && break
  sleep 0.1
done
victim=$(sed -n 's/^\[psrun\] psd 1: pid \([0-9]*\):.*/\1/p' "$run/restart.log" | head -1)
[ -n "$victim" ] || fail "no pid for psd 1 in psrun's output"
kill -9 "$victim"
wait "$psrun_pid" || rc=$?
[ "$rc" -eq 0 ] || { tail -30 "$run/restart.log"; fail "psrun with a shard killed and restarted exited $rc"; }
grep -q "^\[psrun\] psd 1 was killed by signal 9.*starting it again on the same port (restart 1 of --restart-shards 2)" \
  "$run/restart.log" || fail "psrun did not say it started psd 1 again"
for i in 0 1 2; do
  grep -qE "^\[worker $i\] \[worker-$i\] done: .*global step 1500" "$run/restart.log" || fail "worker $i did not finish"
done
grep -q "running at epoch .* from the live copies of step" "$run/restart.log" ||
  fail "the cluster did not form again from the live copies"
grep -q "from checkpoint step" "$run/restart.log" && fail "the cluster restored a checkpoint"
echo "6. psd 1 killed at $(grep -m1 -o 'running at epoch .* from the live copies of step [0-9]*' "$run/restart.log"); started again by psrun; exit 0"
echo "PASS"
