#!/usr/bin/env bash
# psd's checkpoint write and restore next to dd on the same directory, in the same run:
#   write:   psd_bench --checkpoint-bytes NM  vs  dd if=/dev/zero of=DIR/ddtest bs=4M count=P iflag=count_bytes conv=fsync
#   restore: the checkpoint's restore         vs  dd if=DIR/ddtest of=/dev/null bs=4M
# dd moves the same bytes as psd: P is the part_bytes psd_bench reports for its checkpoint file
# (the variables, their optimizer slots, headers), not --mib, which counts the variables only:
# with Adam's two slots psd writes 3x --mib, and a dd of --mib would make the ratio 3x too high.
# So each run writes psd's checkpoint first, then dd.
# The page cache is dropped before both reads when the kernel lets us (root); otherwise both
# reads are warm-cache (the file was just written) and the report says so. Both reads start after
# a sync and 3 s (dd: sleep; psd_bench: --restore-after-s 3), so a virtual disk's host-side
# write-back of the file just written does not run into them (it did here: restores 3x slower).
# Usage: bench/checkpoint_vs_dd.sh [--psd-bench PATH] [--dir DIR] [--mib N] [--runs R] [--warm]
#                                  [-- psd_bench args...]
#   --warm: keep the page cache even where it could be dropped (warm-to-warm reads).
#   --mib N: the variables' size (psd_bench --checkpoint-bytes NM); dd is sized from psd's file.
#   defaults: build/bench/psd_bench, /tmp, --mib 1024, 3 runs, psd_bench args "--variables 8"
#   (the model in 8 float32 variables; e.g. "-- --variables 64 --optimizer adam" for 64 with
#   Adam's two slots each, which triples the bytes written, dd's too). Prints each run (with the
#   bytes both wrote) and the ratios of times for the same bytes (psd / dd; the target is <= 1.1
#   for both).
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
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: $0 [--psd-bench PATH] [--dir DIR] [--mib N] [--runs R] [--warm] [-- psd_bench args...]" >&2; exit 2 ;;
  esac
done
[ -x "$bench" ] || { echo "$0: no psd_bench at $bench (build it, or pass --psd-bench)" >&2; exit 2; }
[ "$mib" -ge 1 ] 2>/dev/null || { echo "$0: --mib must be a whole number of MiB >= 1" >&2; exit 2; }
mkdir -p "$dir"
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

echo "checkpoint vs dd: $mib MiB of variables in $dir, $runs run(s), reads $cache-cache ($(uname -r), $(nproc) CPU)"
echo "dd writes and reads psd's checkpoint part_bytes (variables + slots), so both ratios compare the same bytes"
printf '%-4s %9s %11s %11s %7s   %11s %11s %7s\n' run part_MiB dd_write_ms psd_write_ms ratio dd_read_ms psd_rest_ms \
  ratio
wr_ratios=()
rd_ratios=()
for ((r = 1; r <= runs; r++)); do
  settle
  out=$(timeout 600 "$bench" --checkpoint-bytes "${mib}M" --checkpoint-dir "$dir" --json --restore-after-s 3 "${drop[@]}" "${extra[@]}")
  pw=$(echo "$out" | json_field write_ms)
  pr=$(echo "$out" | json_field restore_ms)
  part=$(echo "$out" | json_field part_bytes)
  if [ -z "$part" ] || [ -z "$pw" ] || [ -z "$pr" ]; then
    echo "$0: psd_bench printed no part_bytes/write_ms/restore_ms (an older psd_bench?): $out" >&2
    exit 1
  fi
  settle
  # count_bytes: count is in bytes, so dd writes exactly part_bytes (the last block may be short).
  w=$( { timeout 300 dd if=/dev/zero of="$ddfile" bs=4M count="$part" iflag=count_bytes conv=fsync 2>&1 >/dev/null; } | dd_seconds)
  settle
  drop_cache
  rd=$( { timeout 300 dd if="$ddfile" of=/dev/null bs=4M 2>&1 >/dev/null; } | dd_seconds)
  rm -f "$ddfile"
  dw=$(awk -v s="$w" 'BEGIN{printf "%.1f", s * 1000}')
  dr=$(awk -v s="$rd" 'BEGIN{printf "%.1f", s * 1000}')
  rw=$(awk -v a="$pw" -v b="$dw" 'BEGIN{printf "%.2f", a / b}')
  rr=$(awk -v a="$pr" -v b="$dr" 'BEGIN{printf "%.2f", a / b}')
  wr_ratios+=("$rw")
  rd_ratios+=("$rr")
  pm=$(awk -v b="$part" 'BEGIN{printf "%.1f", b / 1048576}')
  printf '%-4s %9s %11s %11s %7s   %11s %11s %7s\n' "$r" "$pm" "$dw" "$pw" "$rw" "$dr" "$pr" "$rr"
  echo "     psd_bench: $out"
done
echo "write ratios (psd/dd, same bytes):   ${wr_ratios[*]}   (target <= 1.1)"
echo "restore ratios (psd/dd, same bytes): ${rd_ratios[*]}   (target <= 1.1; $cache cache)"
