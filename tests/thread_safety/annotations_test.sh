#!/usr/bin/env bash
# ctest thread_safety.annotations_bite: clang's -Wthread-safety accepts annotations_probe.cc and
# refuses each of its PSD_VIOLATION variants (an unlocked read, an unlocked call of a REQUIRES
# function, a use after a callee released the lock) with a thread-safety error. Skipped (77)
# without clang.  Usage: annotations_test.sh CLANGXX COMMON_DIR
set -uo pipefail
cxx=${1:-}
common=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "$cxx" ] || ! command -v "$cxx" >/dev/null; then
  echo "clang++ not found: skipped (Debian: clang)"
  exit 77
fi
compile() {
  "$cxx" -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety -I "$common" "$@" \
    "$here/annotations_probe.cc" 2>&1
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for v in 0 1 2 3; do  # in parallel: about 0.5 s each
  (compile -DPSD_VIOLATION=$v >"$tmp/$v.out"; echo $? >"$tmp/$v.rc") &
done
wait
if [ "$(cat "$tmp/0.rc")" != 0 ]; then
  echo "FAIL: the clean probe does not compile:"; cat "$tmp/0.out"; exit 1
fi
for v in 1 2 3; do
  if [ "$(cat "$tmp/$v.rc")" = 0 ]; then
    echo "FAIL: violation $v compiled: the annotations are not checked"; exit 1
  fi
  if ! grep -q -- "-Werror,-Wthread-safety" "$tmp/$v.out"; then
    echo "FAIL: violation $v failed for another reason:"; cat "$tmp/$v.out"; exit 1
  fi
  echo "violation $v refused: $(grep -m1 'error:' "$tmp/$v.out" | sed 's/.*error: //')"
done
echo "ok: clang -Wthread-safety checks the annotations"
