#!/usr/bin/env bash
# The clang thread-safety build (CI: tests/run_all.sh): compiles psd and the daemon's libraries
# (not the tests) with clang's -Wthread-safety (-DPSD_THREAD_SAFETY=ON); code that breaks a lock
# annotation (GUARDED_BY, REQUIRES, ... of common/base/thread_annotations.h; docs/THREADING.md)
# fails it. Unoptimized, without debug info and through ccache, to stay cheap.
#
#   tests/thread_safety/build.sh [--build DIR] [--jobs N]     # default build-tsa/, nproc jobs
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build="$here/build-tsa"
jobs=$(nproc)
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
cc=$(command -v clang-14 || command -v clang || true)
cxx=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$cc" ] || [ -z "$cxx" ]; then
  echo "build.sh: clang is not installed (deploy/install_deps.sh installs it)" >&2
  exit 1
fi
export CCACHE_BASEDIR="$here"
echo "== clang thread-safety build ($build) =="
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 -DCMAKE_C_FLAGS_DEBUG=-O0 \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DPSD_THREAD_SAFETY=ON -DPSD_BUILD_TESTS=OFF \
  -DPSD_BUILD_BENCH=OFF -DPSD_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target psd
echo "ok: the lock annotations hold"
