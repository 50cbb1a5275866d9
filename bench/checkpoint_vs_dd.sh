#!/usr/bin/env bash
# psd's checkpoint write and restore next to dd on the same directory, in the same run:
#   write:   dd if=/dev/zero of=DIR/ddtest bs=4M count=N conv=fsync   vs  psd_bench --checkpoint-bytes N*4M
#   restore: dd if=DIR/ddtest of=/dev/null bs=4M                         vs  the checkpoint's restore
# The page cache is dropped before both reads when the kernel lets us (root); otherwise both
# reads are warm-cache (the file was just written) and the report says so. Both reads start after
# a sync and 3 s (dd: sleep; psd_bench: --restore-after-s 3), so a virtual disk's host-side
# write-back of the file just written does not run into them (it did here: restores 3x slower).
# Usage: bench/checkpoint_vs_dd.sh [--psd-bench PATH] [--dir DIR] [--mib N] [--runs R] [--warm]
#                                  [-- psd_bench args...]
#   --warm: keep the page cache even where it could be dropped (warm-to-warm reads).
#   defaults: build/bench/psd_bench, /tmp, 1024 MiB, 3 runs, psd_bench args "--variables 8"
#   (the model in 8 float32 variables; e.g. "-- --variables 64 --optimizer adam" for 64 with
#   Adam's two slots each, which triples the bytes written). Prints each run and the ratios
#   (psd / dd; the target is <= 1.1 for both).
set -euo pipefail
export LC_ALL=C
bench=build/bench/psd_bench
dir=/tmp
mib=1024
runs=3
extra=(--variables 8)
warm=0
while [ $# -gt 0 ]; do
  case "$1" in
    --psd-bench) bench=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --mib) mib=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --warm) warm=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: $0 [--psd-bench PATH] [--dir DIR] [--mib N] [--runs R] [--warm] [-- psd_bench args...]" >&2; exit 2 ;;
  esac
done
[ -x "$bench" ] || { echo "$0: no psd_bench at $bench (build it, or pass --psd-bench)" >&2; exit 2; }
[ $((mib % 4)) -eq 0 ] || { echo "$0: --mib must be a multiple of 4 (dd bs=4M)" >&2; exit 2; }
mkdir -p "$dir"
count=$((mib / 4))
ddfile="$dir/ddtest.$$"
trap 'rm -f "$ddfile"' EXIT

drop=()
cache=warm
if [ "$warm" = 0 ] && sync && (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then
  drop=(--drop-caches)
  cache=cold
fi
# Deleting a GiB-sized file on a filesystem mounted with `discard` sends the disk TRIMs at the
# next journal commit, which slow whatever runs then: commit them and let them pass first.
settle() { sync; sleep 3; }
drop_cache() { [ "$cache" = cold ] && sync && echo 3 > /proc/sys/vm/drop_caches; return 0; }
# Seconds from dd's summary line ("... copied, 2.1 s, 511 MB/s").
dd_seconds() { tail -n 1 | awk -F', ' '{split($(NF-1), a, " "); print a[1]}'; }
json_field() { sed -n "s/.*\"$1\": \([0-9.]*\).*/\1/p"; }

echo "checkpoint vs dd: $mib MiB in $dir, $runs run(s), reads $cache-cache ($(uname -r), $(nproc) CPU)"
printf '%-4s %11s %11s %7s   %11s %11s %7s\n' run dd_write_ms psd_write_ms ratio dd_read_ms psd_rest_ms ratio
wr_ratios=()
rd_ratios=()
for ((r = 1; r <= runs; r++)); do
  settle
  w=$( { timeout 300 dd if=/dev/zero of="$ddfile" bs=4M count="$count" conv=fsync 2>&1 >/dev/null; } | dd_seconds)
  settle
  drop_cache
  rd=$( { timeout 300 dd if="$ddfile" of=/dev/null bs=4M 2>&1 >/dev/null; } | dd_seconds)
  rm -f "$ddfile"
  settle
  out=$(timeout 600 "$bench" --checkpoint-bytes "${mib}M" --checkpoint-dir "$dir" --json --restore-after-s 3 "${drop[@]}" "${extra[@]}")
  pw=$(echo "$out" | json_field write_ms)
  pr=$(echo "$out" | json_field restore_ms)
  dw=$(awk -v s="$w" 'BEGIN{printf "%.1f", s * 1000}')
  dr=$(awk -v s="$rd" 'BEGIN{printf "%.1f", s * 1000}')
  rw=$(awk -v a="$pw" -v b="$dw" 'BEGIN{printf "%.2f", a / b}')
  rr=$(awk -v a="$pr" -v b="$dr" 'BEGIN{printf "%.2f", a / b}')
  wr_ratios+=("$rw")
  rd_ratios+=("$rr")
  printf '%-4s %11s %11s %7s   %11s %11s %7s\n' "$r" "$dw" "$pw" "$rw" "$dr" "$pr" "$rr"
  echo "     psd_bench: $out"
done
echo "write ratios (psd/dd):   ${wr_ratios[*]}   (target <= 1.1)"
echo "restore ratios (psd/dd): ${rd_ratios[*]}   (target <= 1.1; $cache cache)"
