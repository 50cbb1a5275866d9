# Helpers shared by the e2e tests (sourced; the caller sets $run, its log directory, and lists the
# processes it started in the array $pids).

# Ends the test's own processes (by PID) and removes $run: the EXIT trap.
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$run"
}

# Prints what failed, any sanitizer report, and the tail of every log; exits 1.
fail() {
  echo "FAIL: $*"
  # A sanitizer report's first lines say what and where; the tails below may not reach them.
  grep -h -A40 "ERROR: AddressSanitizer\|runtime error:" "$run"/*.log 2>/dev/null | head -60 || true
  for f in "$run"/*.log; do echo "== $f"; tail -n 30 "$f"; done
  exit 1
}

# Waits (up to $3 s) for a line matching the extended regex $2 in file(s) $1.
wait_for() {
  local deadline=$((SECONDS + $3))
  while [ $SECONDS -lt $deadline ]; do
    grep -qE "$2" $1 2>/dev/null && return 0
    sleep 0.05
  done
  return 1
}
