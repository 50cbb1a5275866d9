#!/usr/bin/env bash
# Builds psd's libFuzzer targets (clang, -DPSD_FUZZ=ON, in build-fuzz/) and runs each one from the
# checked-in seed corpus, after replaying the regression inputs. Exits non-zero when a target
# crashes, leaks, hits undefined behaviour or times out on an input; the input is then in
# build-fuzz/fuzz-artifacts/<target>/ (copy it into tests/fuzz/regressions/<target>/ with the fix).
#
#   tests/fuzz/run.sh                    # 60 s per target (what tests/run_all.sh runs)
#   tests/fuzz/run.sh --minutes 30       # longer, e.g. before a release or after a protocol change
#   tests/fuzz/run.sh --seconds 20 frame # some targets only: frame, worker_request, peer_message
#
# New inputs the fuzzer finds go to build-fuzz/fuzz-corpus/<target>/ (kept between runs, not
# checked in). Options: --build DIR (default build-fuzz), --jobs N (compile jobs; default nproc).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
seconds=60
build="$here/build-fuzz"
jobs=$(nproc)
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) seconds=$(( $2 * 60 )); shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(frame worker_request peer_message)
case "$seconds" in ''|*[!0-9]*) echo "run.sh: --minutes/--seconds take a whole number" >&2; exit 2 ;; esac
[ "$seconds" -gt 0 ] || { echo "run.sh: the run time must be above 0" >&2; exit 2; }

cc=$(command -v clang-14 || command -v clang || true)
cxx=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$cc" ] || [ -z "$cxx" ]; then
  echo "run.sh: clang is not installed (deploy/install_deps.sh installs clang and libclang-rt-14-dev)" >&2
  exit 1
fi
export CCACHE_BASEDIR="$here"
# -g would put the build directory into ccache's hash: without this, a fresh clone (CI) never hits.
export CCACHE_NOHASHDIR=1
echo "== fuzz build ($build) =="
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_CXX_COMPILER="$cxx" -DPSD_FUZZ=ON -DPSD_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target psd_fuzz
"$build/tests/fuzz/psd_fuzz_corpus" --check "$here/tests/fuzz/corpus"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Stack traces with file:line (Debian: llvm-14).
for s in /usr/lib/llvm-14/bin/llvm-symbolizer /usr/bin/llvm-symbolizer; do
  [ -x "$s" ] && { export ASAN_SYMBOLIZER_PATH="$s"; break; }
done
failed=()
summary=()
for t in "${targets[@]}"; do
  bin="$build/tests/fuzz/fuzz_$t"
  [ -x "$bin" ] || { echo "run.sh: no fuzz target '$t' (frame, worker_request, peer_message)" >&2; exit 2; }
  seeds="$here/tests/fuzz/corpus/$t"
  regressions="$here/tests/fuzz/regressions/$t"
  work="$build/fuzz-corpus/$t"
  artifacts="$build/fuzz-artifacts/$t"
  log="$build/fuzz-logs/$t.log"
  mkdir -p "$work" "$artifacts" "$(dirname "$log")"
  echo "== fuzz $t: regressions =="
  mapfile -t inputs < <(find "$regressions" -type f ! -name '.*' 2>/dev/null | sort)
  if [ ${#inputs[@]} -gt 0 ]; then
    if ! "$bin" -rss_limit_mb=2048 -timeout=10 "${inputs[@]}" >"$log.regressions" 2>&1; then
      tail -40 "$log.regressions"
      echo "FAIL: fuzz $t: a regression input in $regressions crashes again (log: $log.regressions)"
      failed+=("$t (regression)")
      continue
    fi
    echo "${#inputs[@]} regression input(s) replayed"
  fi
  echo "== fuzz $t: ${seconds} s =="
  # libFuzzer writes new inputs into the first corpus directory only.
  set +e
  "$bin" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "$work" "$seeds" "$regressions" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  corpus=$(find "$work" -type f | wc -l)
  line="$t: ${execs:-?} execs, ${rate:-?} execs/s, cov ${cov:-?}, ft ${ft:-?}, corpus $corpus (+ seeds) in ${seconds} s"
  summary+=("$line")
  if [ $rc -ne 0 ]; then
    tail -60 "$log"
    echo "FAIL: fuzz $t (exit $rc): the input is in $artifacts/; log $log"
    failed+=("$t")
  else
    echo "$line"
  fi
done
echo "== fuzz summary =="
[ ${#summary[@]} -eq 0 ] || printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzzing passed"
