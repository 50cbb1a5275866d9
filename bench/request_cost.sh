#!/usr/bin/env bash
# request_cost.sh: the CPU one small request costs psd's daemon and its client, beside the step.
#
# Where a step is short (4 KiB), its time follows the work done per request on both sides, which
# compare_floor's step ratio shows only through the noise of a shared machine. This starts psd as
# compare_floor does (its own process, on 127.0.0.1, a port from the kernel), runs psd_bench
# --connect with --fused --pull-in-push (one round trip per step) against it, and reads the
# daemon's user and system time from /proc/PID/stat before and after, the client's from
# /usr/bin/time. Each run prints the daemon's CPU per request (user, total), the client's CPU per
# step and the median step; several runs, alternating between builds when two are given (A/B),
# end with the medians per build.
#
# Usage: bench/request_cost.sh [options]
#   --workers W         workers (default 1: psd and its worker each have a core on 2 cores)
#   --steps N           measured steps per run (default 20000)
#   --size S            model size (default 4K)
#   --runs R            runs per build (default 5)
#   --psd PATH          the daemon (default build/server/psd)
#   --bench PATH        psd_bench (default build/bench/psd_bench)
#   --psd-b PATH --bench-b PATH   a second build, alternated with the first (A/B)
#   --psd-flags "..."   extra flags for psd;  --bench-flags "...": extra flags for psd_bench
#                       (default --shared-memory 0: TCP, as the floor)
#   --syscalls          also count the daemon's system calls per request (epoll_wait, recvfrom,
#                       sendmsg, epoll_ctl, futex, read and write: a lane's doorbells, and their sum) with
#                       `perf stat` on the kernel's
#                       syscall tracepoints (Debian package linux-perf; root or
#                       kernel.perf_event_paranoid <= -1); the medians then give the sum too.
#                       Counting costs the daemon some CPU: take CPU figures from runs without it
set -euo pipefail
cd "$(dirname "$0")/.."
workers=1 steps=20000 size=4K runs=5
psd_a=build/server/psd bench_a=build/bench/psd_bench psd_b="" bench_b=""
psd_flags="" bench_flags="--shared-memory 0" syscalls=0
counted="epoll_wait recvfrom sendmsg epoll_ctl futex read write"
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --psd) psd_a="$2"; shift 2 ;;
    --bench) bench_a="$2"; shift 2 ;;
    --psd-b) psd_b="$2"; shift 2 ;;
    --bench-b) bench_b="$2"; shift 2 ;;
    --psd-flags) psd_flags="$2"; shift 2 ;;
    --bench-flags) bench_flags="$2"; shift 2 ;;
    --syscalls) syscalls=1; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "request_cost.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$psd_b" ] && [ -z "$bench_b" ]; then bench_b=$bench_a; fi
if [ -n "$bench_b" ] && [ -z "$psd_b" ]; then psd_b=$psd_a; fi
for f in "$psd_a" "$bench_a" ${psd_b:+"$psd_b"} ${bench_b:+"$bench_b"}; do
  [ -x "$f" ] || { echo "request_cost.sh: '$f' is not an executable (build first, or pass --psd/--bench)" >&2; exit 2; }
done
[ -x /usr/bin/time ] || { echo "request_cost.sh: needs /usr/bin/time (Debian package 'time')" >&2; exit 2; }
events=""
if [ "$syscalls" = 1 ]; then
  for c in $counted; do events="${events:+$events,}syscalls:sys_enter_$c"; done
  # Asked for and not available: said now, not after the runs.
  if ! command -v perf > /dev/null || ! perf stat -e "$events" -x, -o /dev/null true > /dev/null 2>&1; then
    echo "request_cost.sh: --syscalls needs 'perf stat' with the kernel's syscall tracepoints (Debian package" \
      "linux-perf, run as root or with kernel.perf_event_paranoid <= -1); run without --syscalls" >&2
    exit 2
  fi
fi

work=$(mktemp -d)
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ]; then kill "$daemon_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
tck=$(getconf CLK_TCK)

# One run: $1 label, $2 psd, $3 psd_bench. Appends "label daemon_user daemon_total client p50".
run_once() {
  local label=$1 psd=$2 bench=$3
  rm -f "$work/port"
  # shellcheck disable=SC2086
  timeout 900 "$psd" --host 127.0.0.1 --port 0 --port-file "$work/port" -R "$workers" --log-level warn $psd_flags \
    > "$work/psd.log" 2>&1 &
  daemon_pid=$!  # timeout's; psd is its only child
  for _ in $(seq 200); do [ -s "$work/port" ] && break; sleep 0.05; done
  [ -s "$work/port" ] || { echo "psd did not start: $(cat "$work/psd.log")" >&2; exit 1; }
  local psd_pid before after
  psd_pid=$(pgrep -P "$daemon_pid")
  before=$(awk '{print $14, $15}' "/proc/$psd_pid/stat")
  local perf_pid=""
  if [ -n "$events" ]; then
    rm -f "$work/perf"
    timeout 900 perf stat -e "$events" -x, -o "$work/perf" -p "$psd_pid" > /dev/null 2>&1 &
    perf_pid=$!
    sleep 0.3  # attached before the first step
  fi
  # shellcheck disable=SC2086
  timeout 600 /usr/bin/time -f "%U %S" -o "$work/time" "$bench" --connect "127.0.0.1:$(cat "$work/port")" \
    --workers "$workers" --model-bytes "$size" --steps "$steps" --fused --pull-in-push $bench_flags \
    > "$work/bench.out" 2>&1 || { echo "psd_bench failed: $(tail -5 "$work/bench.out")" >&2; exit 1; }
  after=$(awk '{print $14, $15}' "/proc/$psd_pid/stat")
  local calls=""
  if [ -n "$perf_pid" ]; then
    kill -INT "$perf_pid" 2>/dev/null || true
    wait "$perf_pid" 2>/dev/null || true
    # Lines "count,,syscalls:sys_enter_NAME,...": per request, in the order of $counted, then the sum.
    calls=$(awk -F, -v req=$((steps * workers)) -v order="$counted" '
      $3 ~ /^syscalls:sys_enter_/ { n = $3; sub(/^syscalls:sys_enter_/, "", n); c[n] = $1 }
      END { k = split(order, o, " "); sum = 0; line = "";
            for (i = 1; i <= k; ++i) { v = c[o[i]] / req; sum += v; line = line sprintf(" %s %.2f", o[i], v) }
            printf "%.2f%s", sum, line }' "$work/perf")
  fi
  kill "$daemon_pid"
  wait "$daemon_pid" 2>/dev/null || true
  daemon_pid=""
  local p50
  p50=$(awk '/step \(worker 0\)/ {print $4}' "$work/bench.out")
  read -r cu cs < "$work/time"
  awk -v l="$label" -v b="$before" -v a="$after" -v t="$tck" -v n="$steps" -v w="$workers" -v cu="$cu" -v cs="$cs" \
    -v p="$p50" 'BEGIN {
      split(b, x, " "); split(a, y, " "); req = n * w;
      du = (y[1] - x[1]) / t * 1e6 / req; dt = (y[1] + y[2] - x[1] - x[2]) / t * 1e6 / req;
      printf "%s %.1f %.1f %.1f %s\n", l, du, dt, (cu + cs) * 1e6 / n, p }' | tee -a "$work/runs" |
    awk '{ printf "%-2s daemon %5.1f us/request (user %4.1f)   client %6.1f us/step   median step %s ms\n", $1, $3, $2, $4, $5 }'
  if [ -n "$calls" ]; then
    echo "$label $calls" >> "$work/calls"
    echo "$calls" | awk -v l="$label" '{ printf "%-2s daemon %5.2f system calls/request:", l, $1;
      for (i = 2; i < NF; i += 2) printf " %s %s", $i, $(i + 1); printf "\n" }'
  fi
}

echo "psd_bench --workers $workers --model-bytes $size --steps $steps --fused --pull-in-push $bench_flags; $runs runs"
for _ in $(seq "$runs"); do
  run_once A "$psd_a" "$bench_a"
  if [ -n "$psd_b" ]; then run_once B "$psd_b" "$bench_b"; fi
done
echo "medians (A: $psd_a, $bench_a${psd_b:+; B: $psd_b, $bench_b}):"
for l in A B; do
  grep -q "^$l " "$work/runs" || continue
  med() { grep "^$l " "$work/runs" | sort -k"$1","$1"g | awk -v c="$1" '{v[NR]=$c} END {print v[int((NR+1)/2)]}'; }
  printf "%-2s daemon %5.1f us/request (user %4.1f)   client %6.1f us/step   median step %s ms\n" \
    "$l" "$(med 3)" "$(med 2)" "$(med 4)" "$(med 5)"
  if [ -s "$work/calls" ] && grep -q "^$l " "$work/calls"; then
    printf "%-2s daemon %5.2f system calls/request\n" "$l" \
      "$(grep "^$l " "$work/calls" | sort -k2,2g | awk '{v[NR]=$2} END {print v[int((NR+1)/2)]}')"
  fi
done
