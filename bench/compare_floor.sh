#!/usr/bin/env bash
# compare_floor.sh: psd next to the raw-socket floor, in the same run, over workers x model sizes.
#
# The floor (../shared/tools/raw_tcp_ps.c, relative to the repo root) is a plain blocking-socket
# parameter server with no framework: one server process, a thread and a receive buffer per
# worker, the least a sync step on loopback can cost. psd runs as its own daemon process (like the
# floor's server), driven by psd_bench --connect with --fused --pull-in-push: one round trip per
# step, as the floor. Absolute times drift between runs on shared machines, so what matters is the
# psd/floor ratio of median step times measured back to back, cell by cell. The workers run on
# psd's host, so they move tensors through shared memory (README "Same-host shared memory") while
# the floor uses TCP; --bench-flags "--shared-memory 0" compares TCP with TCP, and --bench-flags
# "--shared-buffers" keeps the workers' tensors in shared buffers (README "Zero-copy shared
# buffers": no copy on either side). psd's peak RSS then counts the workers' shared pages it
# touched; its own memory (RssAnon and its values segment, where its big buffers live; its peak
# sampled every 50 ms) is printed apart.
#
# Usage: bench/compare_floor.sh [options] [path/to/psd_bench]   (default: build/bench/psd_bench)
#   --workers "2 4 8 16"      worker counts of the sweep (default: 2 4 8 16; "": no sweep)
#   --sizes "4K 4M 64M 256M"  model sizes (K/M/G: powers of 1024; default: 4K 4M 64M 256M)
#   --psd PATH                the daemon (default: build/server/psd, beside psd_bench's build)
#   --floor-src PATH          the floor's C source (default: ../shared/tools/raw_tcp_ps.c beside
#                             the repo root; pass it where that is absent, e.g. on another machine)
#   --steps-scale F           multiply every cell's measured steps by F (default 1)
#   --repeat N                run each cell's floor and psd N times, alternating, and report the
#                             medians of their medians (default: 5 for cells up to 64 KiB, whose
#                             runs take about a second and whose medians move by ±50% from run to
#                             run on a shared machine; 1 for bigger cells)
#   --psd-flags "..."         extra flags for every psd (e.g. "--deterministic"; "--threads N"
#                             replaces psd's default of one I/O thread per core)
#   --bench-flags "..."       extra flags for every psd_bench (e.g. "--push-frame-bytes 0")
#                             busy-poll: --psd-flags "--busy-poll" --bench-flags "--busy-poll-us 200"
#   --rss "1 4 16 64"         then the daemon's peak RSS alone, at --rss-model, for these workers
#   --rss-model SIZE          model size of the RSS runs (default 64M)
#   --sparse "2 8"            then sparse rows/s for these workers: psd_bench --sparse, a 1M x 64
#                             float32 embedding, 4096 distinct rows per worker and step (no floor)
# Prints each cell's floor and psd medians, then a ratio table (psd/floor, median step) and the
# daemon's peak RSS (VmHWM) per cell. Exit status: 0 when every cell ran (or the floor source is
# missing: skipped), 1 otherwise.
set -u -o pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
workers_list="2 4 8 16"
sizes_list="4K 4M 64M 256M"
steps_scale=1
repeat=""
psd_flags=""
bench_flags=""
rss_list=""
rss_model="64M"
sparse_list=""
bench=""
psd=""
floor_src="$repo_root/../shared/tools/raw_tcp_ps.c"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers) workers_list="$2"; shift 2 ;;
    --sizes) sizes_list="$2"; shift 2 ;;
    --psd) psd="$2"; shift 2 ;;
    --floor-src) floor_src="$2"; shift 2 ;;
    --steps-scale) steps_scale="$2"; shift 2 ;;
    --psd-flags) psd_flags="$2"; shift 2 ;;
    --bench-flags) bench_flags="$2"; shift 2 ;;
    --rss) rss_list="$2"; shift 2 ;;
    --rss-model) rss_model="$2"; shift 2 ;;
    --sparse) sparse_list="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    -*) echo "compare_floor: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) bench="$1"; shift ;;
  esac
done
if [[ -n "$repeat" && ! "$repeat" =~ ^[1-9][0-9]*$ ]]; then
  echo "compare_floor: --repeat takes a positive whole number, not '$repeat'" >&2
  exit 2
fi
bench="${bench:-build/bench/psd_bench}"
[[ ! -x "$bench" && -x "$repo_root/$bench" ]] && bench="$repo_root/$bench"
if [[ ! -x "$bench" ]]; then
  echo "compare_floor: psd_bench not found at '$bench' (build it: cmake --build build --target psd_bench)" >&2
  exit 1
fi
psd="${psd:-$(dirname "$bench")/../server/psd}"
[[ ! -x "$psd" && -x "$repo_root/$psd" ]] && psd="$repo_root/$psd"
if [[ ! -x "$psd" ]]; then
  echo "compare_floor: psd not found at '$psd' (pass --psd PATH)" >&2
  exit 1
fi

# "64M" -> bytes (powers of 1024).
to_bytes() {
  local v="$1" n="${1%[KMGkmg]}"
  case "$v" in
    *[Kk]) echo $(( n << 10 )) ;;
    *[Mm]) echo $(( n << 20 )) ;;
    *[Gg]) echo $(( n << 30 )) ;;
    *) echo "$v" ;;
  esac
}
# Measured steps per size: enough for a stable median, short enough for the big cells. Small
# steps take 0.05-0.3 ms, so 200 of them were over in tens of milliseconds and their median moved
# by ±40% between runs on a shared machine; 2000 take under a second and move by a few percent.
steps_for() {
  local b="$1" s
  if (( b <= 65536 )); then s=2000; elif (( b <= 8 << 20 )); then s=20; elif (( b <= 128 << 20 )); then s=8; else s=4; fi
  awk -v s="$s" -v f="$steps_scale" 'BEGIN { n = int(s * f); print (n < 2 ? 2 : n) }'
}
# Alternating floor/psd runs per cell (--repeat, or 5 for small cells and 1 for big ones).
repeats_for() {
  if [[ -n "$repeat" ]]; then echo "$repeat"; elif (( $1 <= 65536 )); then echo 5; else echo 1; fi
}
# The median of the numbers given (the lower middle one of an even count, as psd_bench's p50).
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }'; }

tmp="$(mktemp -d)"
psd_pid=""
sampler_pid=""
cleanup() {
  [[ -n "$sampler_pid" ]] && kill "$sampler_pid" 2>/dev/null
  [[ -n "$psd_pid" ]] && kill "$psd_pid" 2>/dev/null && wait "$psd_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

# Starts a psd for `workers` workers with a frame limit that fits `bytes`; sets psd_pid and port.
start_psd() {
  local workers="$1" bytes="$2" frame=$(( 256 << 20 ))
  # Chunked pushes need no more than the default; with --bench-flags "--push-frame-bytes 0" a push
  # carries the whole model (one variable), so the frame limit holds it either way.
  (( bytes + (1 << 20) > frame )) && frame=$(( bytes + (64 << 20) ))
  rm -f "$tmp/port"
  # psd's own default threads (one per core) unless --psd-flags names --threads.
  # shellcheck disable=SC2086
  timeout 900 "$psd" --host 127.0.0.1 --port 0 --port-file "$tmp/port" -R "$workers" \
    --max-frame-bytes "$frame" --log-level warn $psd_flags >"$tmp/psd.log" 2>&1 &
  psd_pid=$!
  for _ in $(seq 100); do
    [[ -s "$tmp/port" ]] && break
    kill -0 "$psd_pid" 2>/dev/null || break  # it exited: its log says why
    sleep 0.05
  done
  if [[ ! -s "$tmp/port" ]]; then
    echo "compare_floor: psd did not start (the cell shows n/a):" >&2
    cat "$tmp/psd.log" >&2
    # A psd still starting would hold its port and memory through the next cells.
    kill "$psd_pid" 2>/dev/null
    wait "$psd_pid" 2>/dev/null
    psd_pid=""
    return 1
  fi
  port="$(cat "$tmp/port")"
  # psd's own memory (RssAnon, what it allocated, plus the resident pages of its values segment,
  # where its big buffers live; not the workers' shared pages it maps), sampled every 50 ms (the
  # values segment every 0.5 s: one awk); its peak goes to $tmp/psd_anon_peak (KiB).
  local daemon
  daemon="$(pgrep -P "$psd_pid" | head -n1)"  # psd itself, under `timeout`
  echo 0 >"$tmp/psd_anon_peak"
  (
    peak=0 values=0 i=0
    while [[ -r "/proc/${daemon:-$psd_pid}/status" ]]; do
      (( i++ % 10 == 0 )) && values="$(values_rss "${daemon:-$psd_pid}")"
      while read -r key kb _; do
        if [[ "$key" == "RssAnon:" ]]; then
          (( kb + values > peak )) && { peak=$(( kb + values )); echo "$peak" >"$tmp/psd_anon_peak"; }
          break
        fi
      done <"/proc/${daemon:-$psd_pid}/status" 2>/dev/null
      sleep 0.05
    done
  ) &
  sampler_pid=$!
}
# KiB resident in psd's values segment (its big buffers: README "Same-host shared memory").
values_rss() {
  awk '/ \/memfd:psd-values/ { f = 1; next } /^[0-9a-f]+-[0-9a-f]+ / { f = 0 } f && /^Rss:/ { s += $2 }
       END { print s + 0 }' "/proc/$1/smaps" 2>/dev/null || echo 0
}
# Stops the psd started last; prints its peak RSS in MiB. Same-host workers' shared memory is in
# that peak (their pages, mapped by psd too), so $tmp/psd_anon gets psd's own memory (RssAnon and
# its values segment, MiB) at its sampled peak: its own buffers.
stop_psd() {
  local kb daemon anon peak
  daemon="$(pgrep -P "$psd_pid" | head -n1)"  # psd itself, under `timeout`
  kb="$(awk '/^VmHWM:/ { print $2 }' "/proc/${daemon:-$psd_pid}/status" 2>/dev/null)"
  anon="$(awk '/^RssAnon:/ { print $2 }' "/proc/${daemon:-$psd_pid}/status" 2>/dev/null)"
  anon=$(( ${anon:-0} + $(values_rss "${daemon:-$psd_pid}") ))
  kill "$sampler_pid" 2>/dev/null
  wait "$sampler_pid" 2>/dev/null
  sampler_pid=""  # reaped: cleanup must not signal a PID the kernel may give to someone else
  peak="$(cat "$tmp/psd_anon_peak" 2>/dev/null)"
  (( ${anon:-0} > ${peak:-0} )) && peak=$anon
  awk -v k="${peak:-0}" 'BEGIN { printf "%.0f", k / 1024 }' >"$tmp/psd_anon"
  # Its CPU time (user + system) so far, for the per-cell line (busy-poll's cost shows here).
  awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/${daemon:-$psd_pid}/stat" \
    >"$tmp/psd_cpu" 2>/dev/null
  kill "$psd_pid" 2>/dev/null
  wait "$psd_pid" 2>/dev/null
  psd_pid=""
  awk -v k="${kb:-0}" 'BEGIN { printf "%.0f", k / 1024 }'
}
# The per-cell results stop_psd leaves behind, cleared before each cell: a cell whose psd does not
# start must show n/a, not the previous cell's numbers.
reset_cell() {
  psd_out=""
  rss_mib="n/a"
  rm -f "$tmp/psd_anon" "$tmp/psd_cpu" "$tmp/psd_anon_peak"
}
# One psd_bench run against a fresh daemon; sets psd_out, rss_mib; returns psd_bench's status.
run_psd() {
  local workers="$1" bytes="$2" steps="$3" rc
  reset_cell
  if ! start_psd "$workers" "$bytes"; then
    psd_out="psd did not start (its log is above)"
    return 1
  fi
  psd_out="$(timeout 900 "$bench" --connect "127.0.0.1:$port" --workers "$workers" --model-bytes "$bytes" \
             --steps "$steps" --fused --pull-in-push --finish --json --timeout-s 850 $bench_flags 2>&1)"
  rc=$?
  rss_mib="$(stop_psd)"
  return $rc
}

# The workers x sizes table: one row per worker count, `cell KEY BYTES` prints each entry.
print_grid() {
  local width="$1" cell="$2" w b
  printf '%-8s' "workers"
  for s in $sizes_list; do printf " %${width}s" "$s"; done
  echo
  for w in $workers_list; do
    printf '%-8s' "$w"
    for b in "${sizes_b[@]}"; do printf " %${width}s" "$("$cell" "$w,$b" "$b")"; done
    echo
  done
}
ratio_cell() { echo "${ratio[$1]} (${psd_tab[$1]}/${floor_tab[$1]})"; }
rss_cell() { echo "${rss_tab[$1]:-n/a}/$(( (2 * $2 >> 20) + 64 ))"; }
anon_cell() { echo "${anon_tab[$1]:-n/a}"; }

status=0
declare -A ratio floor_tab psd_tab rss_tab anon_tab
sizes_b=()
for s in $sizes_list; do sizes_b+=("$(to_bytes "$s")"); done

if [[ -z "$workers_list" || -z "$sizes_list" ]]; then
  :  # no sweep asked for (--workers "" or --sizes ""): only the RSS or sparse runs
elif [[ ! -f "$floor_src" ]]; then
  echo "compare_floor: floor source not found at $floor_src; skipping the comparison"
else
  # Build line from the floor's header comment.
  if ! timeout 120 gcc -O3 -march=native -pthread -o "$tmp/raw_tcp_ps" "$floor_src"; then
    echo "compare_floor: building $floor_src failed" >&2
    exit 1
  fi
  for w in $workers_list; do
    for b in "${sizes_b[@]}"; do
      steps="$(steps_for "$b")"
      reps="$(repeats_for "$b")"
      echo "== $b bytes, $w workers, $steps measured steps$( (( reps > 1 )) && echo ", $reps runs of each, alternating") =="
      key="$w,$b"
      floor_runs=() psd_runs=() pair_ratios=() cell_rss=0 cell_anon=0 cell_failed=""
      for ((k = 1; k <= reps; ++k)); do
        # Both sides warm up 3 steps (the floor's WARM, psd_bench's default --warmup).
        floor_out="$(timeout 900 "$tmp/raw_tcp_ps" "$b" "$steps" "$w" 2>&1)"
        floor_rc=$?
        echo "floor: $floor_out"
        run_psd "$w" "$b" "$steps"
        psd_rc=$?
        psd_steps="$(sed -n 's/.*\("step_ms_p50": [0-9.eE+-]*\).*\("step_ms_p99": [0-9.eE+-]*\).*/\1, \2/p' <<<"$psd_out")"
        workers_cpu="$(sed -n 's/.*"process_cpu_s": \([0-9.eE+-]*\).*/\1/p' <<<"$psd_out" | head -n1)"
        echo "psd:   ${psd_steps:-step times n/a}, peak RSS $rss_mib MiB (own peak: $(cat "$tmp/psd_anon" 2>/dev/null || echo n/a) MiB), CPU s: psd $(cat "$tmp/psd_cpu" 2>/dev/null || echo n/a) workers ${workers_cpu:-n/a}"
        floor_ms="$(sed -n 's/.*step median \([0-9.]*\) ms.*/\1/p' <<<"$floor_out" | head -n1)"
        psd_ms="$(sed -n 's/.*"step_ms_p50": \([0-9.eE+-]*\).*/\1/p' <<<"$psd_out" | head -n1)"
        # The cell's memory: the highest of its runs.
        [[ "$rss_mib" =~ ^[0-9]+$ ]] && (( rss_mib > cell_rss )) && cell_rss=$rss_mib
        anon="$(cat "$tmp/psd_anon" 2>/dev/null)"
        [[ "$anon" =~ ^[0-9]+$ ]] && (( anon > cell_anon )) && cell_anon=$anon
        if [[ $floor_rc -ne 0 || $psd_rc -ne 0 || -z "$floor_ms" || -z "$psd_ms" ]]; then
          echo "compare_floor: $b bytes, $w workers: no comparison (floor exit $floor_rc, psd_bench exit $psd_rc)" >&2
          [[ $psd_rc -ne 0 ]] && echo "$psd_out" | tail -5 >&2
          cell_failed=1
          break
        fi
        floor_runs+=("$floor_ms")
        psd_runs+=("$psd_ms")
        pair_ratios+=("$(awk -v p="$psd_ms" -v f="$floor_ms" 'BEGIN { if (f > 0) printf "%.2f", p / f; else print "n/a" }')")
      done
      rss_tab[$key]="$cell_rss"
      anon_tab[$key]="$cell_anon"
      (( cell_rss == 0 )) && rss_tab[$key]="n/a"  # no run reported one
      (( cell_anon == 0 )) && anon_tab[$key]="n/a"
      if [[ -n "$cell_failed" ]]; then
        ratio[$key]="n/a"; floor_tab[$key]="${floor_ms:-n/a}"; psd_tab[$key]="${psd_ms:-n/a}"
        status=1
        continue
      fi
      floor_ms="$(median "${floor_runs[@]}")"
      psd_ms="$(median "${psd_runs[@]}")"
      floor_tab[$key]="$floor_ms"
      psd_tab[$key]="$(awk -v p="$psd_ms" 'BEGIN { printf "%.3f", p }')"
      ratio[$key]="$(awk -v p="$psd_ms" -v f="$floor_ms" 'BEGIN { if (f > 0) printf "%.2f", p / f; else print "n/a" }')"
      if (( reps > 1 )); then
        echo "ratio: ${ratio[$key]} (median psd / median floor; run by run: ${pair_ratios[*]})"
      else
        echo "ratio: ${ratio[$key]}"
      fi
      echo
    done
  done

  echo "== psd/floor, median step time (psd --fused --pull-in-push as its own process; floor: raw_tcp_ps;"
  echo "   a cell run several times (--repeat) shows the median of each side's medians) =="
  print_grid 22 ratio_cell
  echo "(cells: ratio (psd ms / floor ms))"
  echo
  echo "== psd's peak RSS (MiB) in those runs / the target 2 x model + 64 MiB (SGD) =="
  print_grid 14 rss_cell
  echo "(with same-host workers this counts the pages of their shared memory that psd mapped)"
  echo
  echo "== psd's own memory (RssAnon + its values segment, MiB): its peak, sampled every 50 ms, in those runs =="
  print_grid 14 anon_cell
fi

if [[ -n "$rss_list" ]]; then
  mb="$(to_bytes "$rss_model")"
  target=$(( (2 * mb >> 20) + 64 ))
  echo
  echo "== psd's peak RSS alone: model $rss_model, SGD, 3 measured steps (target 2 x model + 64 MiB = $target MiB) =="
  printf '%-8s %10s %8s %13s %8s\n' "workers" "RSS MiB" "/target" "own MiB" "/target"
  for w in $rss_list; do
    if run_psd "$w" "$mb" 3; then
      anon_mib="$(cat "$tmp/psd_anon" 2>/dev/null)"
      printf '%-8s %10s %8s %13s %8s\n' "$w" "$rss_mib" \
        "$(awk -v r="$rss_mib" -v t="$target" 'BEGIN { printf "%.2f", r / t }')" "$anon_mib" \
        "$(awk -v r="${anon_mib:-0}" -v t="$target" 'BEGIN { printf "%.2f", r / t }')"
    else
      printf '%-8s %10s %8s\n' "$w" "failed" "n/a"
      echo "$psd_out" | tail -5 >&2
      status=1
    fi
  done
fi

if [[ -n "$sparse_list" ]]; then
  echo
  echo "== sparse: psd_bench --sparse, 1M x 64 float32 embedding (244 MiB), 4096 distinct rows per worker and step =="
  printf '%-8s %14s %14s %12s %10s\n' "workers" "rows/s pushed" "rows/s pulled" "step p50 ms" "RSS MiB"
  for w in $sparse_list; do
    reset_cell
    sparse_out=""
    if start_psd "$w" $(( 256 << 20 )); then
      # shellcheck disable=SC2086
      sparse_out="$(timeout 900 "$bench" --connect "127.0.0.1:$port" --workers "$w" --sparse --embedding-rows 1000000 \
                    --embedding-dim 64 --steps 40 --finish --json --timeout-s 850 $bench_flags 2>&1)"
      sparse_rc=$?
      rss_mib="$(stop_psd)"
    else
      sparse_rc=1
      sparse_out="psd did not start (its log is above)"
    fi
    field() { sed -n "s/.*\"$1\": \([0-9.eE+-]*\).*/\1/p" <<<"$sparse_out" | head -n1; }
    if [[ $sparse_rc -ne 0 || -z "$(field push_rows_per_s)" ]]; then
      printf '%-8s %14s\n' "$w" "failed"
      echo "$sparse_out" | tail -5 >&2
      status=1
      continue
    fi
    printf '%-8s %14.0f %14.0f %12.3f %10s\n' "$w" "$(field push_rows_per_s)" "$(field pull_rows_per_s)" \
      "$(field step_ms_p50)" "$rss_mib"
  done
fi
exit $status
