#!/usr/bin/env bash
# Takeover with real processes: a shard killed with SIGKILL and NOT restarted is served by a
# stand-in that the next shard runs from the copy it keeps (--replicas-per-shard 2
# --takeover-after-ms), and the job goes on; when the shard's own process is started again later,
# it takes its part back from the live copies. The final parameters must be bit-identical to an
# undisturbed run's.
#
# 3 psd shards (--deterministic) train the example model with 3 workers reading the minibatch of
# each global step by its number (--data-by-step), so the model after S steps depends on nothing
# but S. Run 1 is undisturbed. In run 2, ROUNDS times: the chief and then a non-chief are killed;
# each time the cluster must serve again from a stand-in (logged "is served by a stand-in"),
# formed from the live copies, and the kill-to-serving time is printed; then the shard's own
# process is started again and must take its part back (again from the live copies), and be handed
# the copies of the part before it that the stand-in kept (from the stand-in's host). Then a
# non-chief hangs (SIGSTOP: no close, no heartbeat) and must be served by a stand-in too, and take
# its part back when it runs again (SIGCONT). At the end every worker's parameter hash must equal
# run 1's.
#
# MODE async or ssp: the same kills and hang with --mode MODE (no --deterministic); each formation
# must be from each part's newest live copy, the hung shard must take the stand-in's newer copy
# when it runs again (not its own older one), and there is no run 1 to compare with (async
# parameters depend on timing): the workers must finish, and no formation may fall back.
#
# Usage: takeover_test.sh PSD WORKER [ROUNDS (default 1)] [STEPS (default 6000)] [MODE (default sync)]
set -u -o pipefail
psd=$1 worker=$2 rounds=${3:-1} steps=${4:-6000} mode=${5:-sync}
source "$(dirname "$0")/cluster_lib.sh"
source "$(dirname "$0")/replica_lib.sh"
begin_e2e
reserve_cluster 3
flags=(--cluster "$cluster" -R 3 -N 3 --init-tokens 0 --learning-rate 0.3 --replicas-per-shard 2 --deterministic
  --summary-interval-s 0 --exit-when-done --heartbeat-ms 100 --election-timeout-ms 1000 --takeover-after-ms 1000)
[ "$mode" = sync ] || flags=("${flags[@]/--deterministic/--mode=$mode}")
# Waits for a formation after the $1-th, from the live copies; sets $line to its log line. $2: what for.
wait_formation() {
  local deadline=$((SECONDS + 60))
  while [ "$(running)" -le "$1" ]; do
    [ $SECONDS -lt $deadline ] || fail "$2: the cluster did not serve again within 60 s"
    sleep 0.02
  done
  line=$(formations | tail -1)
  echo "$line" | grep -q "from the live copies of step\|from each part's newest live copy" ||
    fail "$2: the cluster did not form from the live copies: $line"
  # The global step never goes back (async: the chief's count goes on from the highest part's).
  local at
  at=$(step_of "$line")
  [ "$at" -ge "$last_step" ] || fail "$2: the cluster formed at step $at, after serving at step $last_step"
  last_step=$at
}
last_step=0
# The step a formation line names (sync: the live copies' step; async: the chief's count).
step_of() { echo "$1" | sed 's/.*live copies of step \([0-9]*\).*/\1/; s/.*newest live copy (step \([0-9]*\) on the chief).*/\1/'; }

# --- run 1: undisturbed ---------------------------------------------------------------------------
want=""
[ "$mode" = sync ] && undisturbed_run

# --- run 2: the chief and a non-chief killed, served by stand-ins, then back ------------------------
for k in 0 1 2; do start_shard "$k" "s$k-0"; done
start_workers b
wait_for "$run/s*.log" "running at epoch" 30 || fail "run 2: the cluster did not start serving"
times_chief=() times_other=() times_back=()
n=0
for round in $(seq 1 "$rounds"); do
  for victim in chief other; do
    n=$((n + 1))
    sleep 0.5  # training goes on
    kill -0 "${wpid[0]}" 2> /dev/null || break 2
    kill_victim "$victim" "$n"
    wait_formation "$formed" "kill $n ($victim, shard $k)"
    grep -q "shard $k .* is served by a stand-in at" "$run"/s*.log ||
      fail "kill $n ($victim, shard $k): no stand-in served it"
    took=$(($(log_ms "$line") - kill_ms))
    echo "kill $n: $victim (shard $k), not restarted: a stand-in serves it after $took ms, $(echo "$line" | sed 's/.*from //')"
    if [ "$victim" = chief ]; then times_chief+=("$took"); else times_other+=("$took"); fi
    # The shard's own process again: it takes its part back from the live copies.
    sleep 0.5
    kill -0 "${wpid[0]}" 2> /dev/null || break 2
    formed=$(running)
    back_ms=$(date +%s%3N)
    start_shard "$k" "s$k-$n"
    wait_formation "$formed" "shard $k back"
    took=$(($(log_ms "$line") - back_ms))
    echo "        shard $k started again: serving its part again after $took ms, $(echo "$line" | sed 's/.*from //')"
    times_back+=("$took")
    # The stand-in was the next shard of shard k - 1's part too: its host hands the copies of that
    # part it kept to shard k's own process (else the move back leaves that part one copy).
    wait_for "$run/s$k-$n.log" "keeps the copy of shard .* that its stand-in kept" 10 ||
      fail "shard $k back: it was not handed the copies its stand-in kept of shard $(((k + 2) % 3))'s part"
  done
done
# A hung shard (SIGSTOP: its links stay open, it sends nothing): noticed after the election timeout,
# then served by a stand-in, and the workers go on (their replies from the hung process are given
# up once the cluster serves it elsewhere); when it runs again (SIGCONT) it takes its part back.
times_hung=()
if kill -0 "${wpid[0]}" 2> /dev/null; then
  sleep 0.5
  chief=$(chief_of)
  # A non-chief that holds a variable (so that workers wait on it).
  for k in $(((chief + 1) % 3)) $(((chief + 2) % 3)); do
    grep -q "created variable" "$run"/s$k-*.log && break
  done
  grep -q "created variable" "$run"/s$k-*.log || fail "no non-chief shard holds a variable"
  formed=$(running)
  stop_ms=$(date +%s%3N)
  kill -STOP "$(real_pid "${shard_pid[$k]}")"
  wait_formation "$formed" "shard $k hung"
  took=$(($(log_ms "$line") - stop_ms))
  times_hung+=("$took")
  hung_step=$(step_of "$line")
  echo "shard $k hung (SIGSTOP): a stand-in serves it after $took ms, $(echo "$line" | sed 's/.*from //')"
  sleep 8  # a worker waiting on the hung process gives its reply up, then its shared buffers (5 s)
  formed=$(running)
  going=0
  kill -0 "${wpid[0]}" 2> /dev/null && going=1
  kill -CONT "$(real_pid "${shard_pid[$k]}")"
  if [ $going = 1 ]; then
    wait_formation "$formed" "shard $k running again"
    back_step=$(step_of "$line")
    echo "        shard $k running again (SIGCONT): serving its part again, $(echo "$line" | sed 's/.*from //')"
    [ "$back_step" -gt $((hung_step + 10)) ] ||
      fail "the workers did not go on while shard $k was hung (steps $hung_step to $back_step)"
    # Async/ssp: its own copies are older than the stand-in's: it must take the stand-in's newest.
    if [ "$mode" != sync ]; then
      grep -q "shard $k restores the newer copy of its part" "$run"/s$k-*.log ||
        fail "shard $k, running again, did not take the stand-in's newer copy of its part"
    fi
  fi
fi
check_run2
echo "chief killed ${#times_chief[@]} times: kill-to-serving (stand-in) $(stats "${times_chief[@]}")"
echo "non-chief killed ${#times_other[@]} times: kill-to-serving (stand-in) $(stats "${times_other[@]}")"
echo "shard started again ${#times_back[@]} times: start-to-serving $(stats "${times_back[@]}")"
[ ${#times_hung[@]} -gt 0 ] && echo "shard hung ${#times_hung[@]} time(s): stop-to-serving $(stats "${times_hung[@]}")"
if [ "$mode" = sync ]; then
  echo "run 2: $n kills, each served by a stand-in and taken back; final parameters bit-identical to the undisturbed run ($want)"
else
  echo "run 2 ($mode): $n kills, each served by a stand-in from each part's newest live copy and taken back"
fi
echo "PASS"
