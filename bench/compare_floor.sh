#!/usr/bin/env bash
# compare_floor.sh: psd_bench next to the raw-socket floor, in the same run.
#
# The floor (../shared/tools/raw_tcp_ps.c, relative to the repo root) is a plain blocking-socket
# parameter server with no framework: the least a 2-worker sync step on loopback can cost here.
# Absolute times drift between runs on shared machines, so what matters is the psd/floor ratio of
# median step times measured back to back.
#
# Usage: bench/compare_floor.sh [path/to/psd_bench]    (default: build/bench/psd_bench)
# Exit status: 0 when every size ran (or the floor source is missing: skipped), 1 otherwise.
set -u -o pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench="${1:-build/bench/psd_bench}"
if [[ ! -x "$bench" && -x "$repo_root/$bench" ]]; then
  bench="$repo_root/$bench"
fi
if [[ ! -x "$bench" ]]; then
  echo "compare_floor: psd_bench not found at '$bench' (build it: ninja -C build psd_bench)" >&2
  exit 1
fi

floor_src="$repo_root/../shared/tools/raw_tcp_ps.c"
if [[ ! -f "$floor_src" ]]; then
  echo "compare_floor: floor source not found at $floor_src; skipping the comparison"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# Build line from the floor's header comment.
if ! timeout 120 gcc -O3 -march=native -pthread -o "$tmp/raw_tcp_ps" "$floor_src"; then
  echo "compare_floor: building $floor_src failed" >&2
  exit 1
fi

workers=2
status=0
summary=()
# size:steps — fewer steps for big models keeps the run short; enough for a stable median.
for spec in 4096:200 4194304:20 67108864:10; do
  size="${spec%%:*}"
  steps="${spec##*:}"
  echo "== $size bytes, $workers workers, $steps measured steps =="

  # Both sides warm up 3 steps (the floor's WARM, psd_bench's default --warmup).
  floor_out="$(timeout 300 "$tmp/raw_tcp_ps" "$size" "$steps" "$workers" 2>&1)"
  floor_rc=$?
  echo "floor: $floor_out"
  psd_out="$(timeout 300 "$bench" --workers "$workers" --model-bytes "$size" --steps "$steps" --fused --pull-in-push --json \
             --timeout-s 280 2>&1)"
  psd_rc=$?
  echo "psd:   $psd_out"

  floor_ms="$(sed -n 's/.*step median \([0-9.]*\) ms.*/\1/p' <<<"$floor_out" | head -n1)"
  psd_ms="$(sed -n 's/.*"step_ms_p50": \([0-9.eE+-]*\).*/\1/p' <<<"$psd_out" | head -n1)"
  if [[ $floor_rc -ne 0 || $psd_rc -ne 0 || -z "$floor_ms" || -z "$psd_ms" ]]; then
    echo "compare_floor: $size bytes: no comparison (floor exit $floor_rc, psd_bench exit $psd_rc)" >&2
    summary+=("$(printf '%10s %12s %12s %8s' "$size" "${floor_ms:-n/a}" "${psd_ms:-n/a}" "n/a")")
    status=1
    continue
  fi
  ratio="$(awk -v p="$psd_ms" -v f="$floor_ms" 'BEGIN { if (f > 0) printf "%.2f", p / f; else print "n/a" }')"
  echo "ratio: psd/floor median step time = $psd_ms ms / $floor_ms ms = $ratio"
  summary+=("$(printf '%10s %12.3f %12.3f %8s' "$size" "$floor_ms" "$psd_ms" "$ratio")")
  echo
done

echo "== summary (median step time, ms; psd with --fused --pull-in-push: one round trip per step, as the floor) =="
printf '%10s %12s %12s %8s\n' "bytes" "floor" "psd" "ratio"
for line in "${summary[@]}"; do echo "$line"; done
exit $status
