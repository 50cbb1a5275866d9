# Helpers shared by the e2e tests (sourced; the caller sets $run, its log directory, and lists the
# processes it started in the array $pids).

# The usual start of a test: $run (a fresh log directory), $pids (the processes it starts) and an
# EXIT trap that kills -9 each of them and the process under it (a psd under `timeout`), then
# removes $run.
begin_e2e() {
  run=$(mktemp -d)
  pids=()
  trap 'for p in "${pids[@]}"; do kill -9 $(pgrep -P "$p") "$p" 2>/dev/null || true; done; rm -rf "$run"' EXIT
}
real_pid() { pgrep -P "$1"; }  # the psd under `timeout` (its only child)

# Ends the test's own processes (by PID) and removes $run: the EXIT trap.
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$run"
}

# Prints what failed, any sanitizer report, and the tail of every log; exits 1. With
# PSD_E2E_KEEP_DIR set, the whole log directory is kept there first (for a failure seen once in
# many runs).
fail() {
  echo "FAIL: $*"
  if [ -n "${PSD_E2E_KEEP_DIR:-}" ] && mkdir -p "$PSD_E2E_KEEP_DIR" && cp -r "$run" "$PSD_E2E_KEEP_DIR/"; then
    echo "logs kept in $PSD_E2E_KEEP_DIR/$(basename "$run")"
  fi
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

# Ports are owned, never guessed (tests/e2e/listen.py says how):
listen_py="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/listen.py"
# Reserves $1 ports on 127.0.0.1 for the rest of the test (the holder is in $pids) and prints
# their list, "127.0.0.1:P1,127.0.0.1:P2,..."; $2 names the file it goes through. Call it as
# `reserve_ports N FILE; list=$(cat FILE)` — not in $(...), whose subshell would end the holder.
reserve_ports() {
  /usr/bin/python3 "$listen_py" reserve "$1" "$2" &
  pids+=($!)
  wait_for "$2" . 10 || fail "could not reserve $1 port(s) on 127.0.0.1"
}
# Reserves $1 ports as above and sets $cluster to their list (the test's cluster, for its whole run).
reserve_cluster() {
  reserve_ports "$1" "$run/ports"
  cluster=$(cat "$run/ports")
}
# `"${serve_on[@]}" PORT -- CMD...` runs CMD (exec: the same PID, so `timeout S "${serve_on[@]}" ...`
# has CMD as its child) with a socket listening on the reserved 127.0.0.1:PORT as its
# descriptor 3: give psd `--listen-fd 3`.
serve_on=(/usr/bin/python3 "$listen_py" serve)
# The port of entry $2 (from 0) of a list "host:port,host:port,...".
port_of() { echo "$1" | cut -d, -f$(($2 + 1)) | sed 's/.*://'; }
