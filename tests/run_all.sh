#!/usr/bin/env bash
# Builds and runs the whole test suite, from a fresh Debian 12 machine: installs the packages,
# then a Release build with -Werror, a clang build of the daemon checking its lock annotations
# (tests/thread_safety/build.sh) and an ASan+UBSan build, the two full builds running every test
# (unit, integration, e2e), then the fuzz targets briefly (tests/fuzz/run.sh). Exits non-zero on any
# failure. Bounded: every test has a CTest timeout, every fuzz target a time limit.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/deploy/install_deps.sh"
jobs=$(nproc)
# ccache hits across clones in different directories (CI builds a fresh clone each time).
export CCACHE_BASEDIR="$here"

echo "== Release build (-Werror) =="
cmake -S "$here" -B "$here/build-ci" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPSD_WERROR=ON >/dev/null
cmake --build "$here/build-ci" -j "$jobs"
(cd "$here/build-ci" && ctest --output-on-failure --timeout 300 -j 2)

# clang -Wthread-safety over psd and its libraries: a lock-annotation violation fails the run.
"$here/tests/thread_safety/build.sh" --build "$here/build-tsa" --jobs "$jobs"

echo "== ASan + UBSan build =="
cmake -S "$here" -B "$here/build-asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPSD_WERROR=ON \
  -DPSD_SANITIZE=ON -DPSD_BUILD_BENCH=OFF -DPSD_BUILD_PYTHON=OFF >/dev/null
cmake --build "$here/build-asan" -j "$jobs"
(cd "$here/build-asan" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure --timeout 300 -j 2)

echo "== Fuzzing (clang + libFuzzer: regressions, then 60 s per target) =="
"$here/tests/fuzz/run.sh" --seconds 60 --build "$here/build-fuzz" --jobs "$jobs"
