# Helpers of the shard-replica e2e tests (replica_failover_test.sh, takeover_test.sh), sourced
# after cluster_lib.sh. The caller sets $psd, $worker, $steps, $cluster (reserve_cluster) and
# $flags (psd's flags but --shard-index and --listen-fd).

# A millisecond time from a log line's timestamp.
log_ms() { date -d "$(echo "$1" | cut -c 1-23)" +%s%3N; }

declare -A shard_pid
start_shard() {  # $1: index, $2: log name; its pid in shard_pid[$1]
  timeout 600 "${serve_on[@]}" "$(port_of "$cluster" "$1")" -- "$psd" "${flags[@]}" --shard-index "$1" --listen-fd 3 \
    2> "$run/$2.log" &
  shard_pid[$1]=$!
  pids+=($!)
}

# 3 workers that read the minibatch of each global step by its number (--data-by-step).
declare -a wpid
start_workers() {  # $1: run name
  for w in 0 1 2; do
    timeout 600 "$worker" --cluster "$cluster" --worker-name "w$w" --shard "$w" --steps "$steps" --data-by-step \
      --features 64 --slow-ms 2 --print-every 0 --retry-s 120 > "$run/$1-w$w.log" 2>&1 &
    wpid[$w]=$!
    pids+=($!)
  done
}
wait_workers() {  # $1: run name
  for w in 0 1 2; do
    wait "${wpid[$w]}" || fail "$1: worker $w exited $?"
  done
}
# Worker $2's parameter hash at the end of run $1.
hash_of() { sed -n 's/.*parameter hash \([0-9a-f]*\)$/\1/p' "$run/$1-w$2.log"; }

# Run 1 of each test: undisturbed; sets $want to the final parameter hash (every worker's).
undisturbed_run() {
  for k in 0 1 2; do start_shard "$k" "s$k-a"; done
  start_workers a
  wait_workers a
  for k in 0 1 2; do wait "${shard_pid[$k]}" 2> /dev/null; done
  want=$(hash_of a 0)
  [ -n "$want" ] || fail "run 1: worker 0 printed no parameter hash"
  for w in 1 2; do [ "$(hash_of a $w)" = "$want" ] || fail "run 1: worker $w ended with other parameters"; done
  echo "run 1 (undisturbed): $steps steps, parameter hash $want"
  rm -f "$run"/s*-a.log
}

# min/median/max of the numbers given.
stats() { printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END { printf "min %d, median %d, max %d ms", a[1], a[int((NR + 1) / 2)], a[NR] }'; }

# Formations so far ("running at epoch" lines, oldest first) and how many.
formations() { cat "$run"/s*.log 2> /dev/null | grep "running at epoch" | sort; }
running() { formations | wc -l; }
# The chief now: the newest election line of any log.
chief_of() { grep -h "is the chief for term\|is the chief (term" "$run"/s*.log | sort | tail -1 | sed 's/.*shard \([0-9]\) is the chief.*/\1/'; }

# Kills with SIGKILL kill number $2 of kind $1 (chief, or other: a non-chief, alternating): sets
# $k (the shard), $formed (formations before) and $kill_ms.
kill_victim() {
  local chief
  chief=$(chief_of)
  k=$chief
  [ "$1" = other ] && k=$(((chief + 1 + $2 % 2) % 3))
  formed=$(running)
  kill_ms=$(date +%s%3N)
  kill -9 "$(real_pid "${shard_pid[$k]}")"
  wait "${shard_pid[$k]}" 2> /dev/null
}

# The end of run 2 of each test: the workers finish, no formation fell back to a checkpoint, and
# every worker's parameters equal run 1's ($want; none to compare with when it is empty), and no
# copy a shard was sent was unusable for what it holds (a difference from the copy before that does
# not rebuild its owner's state, or does not fit it; a base lost with a restart is another matter).
check_run2() {
  wait_workers b
  if cat "$run"/s*.log | grep -q "from checkpoint step\|no live copy"; then fail "run 2: a formation fell back"; fi
  if grep -h "is unusable: .*\(malformed\|layout\|does not match\|checksum\)" "$run"/s*.log; then
    fail "run 2: a shard could not use a copy it was sent"
  fi
  for w in 0 1 2; do
    [ -n "$want" ] || break
    got=$(hash_of b $w)
    [ "$got" = "$want" ] || fail "run 2: worker $w ended with parameter hash $got, the undisturbed run $want"
  done
  [ ${#times_chief[@]} -gt 0 ] && [ ${#times_other[@]} -gt 0 ] || fail "run 2: the workers finished before a kill of each kind"
}
