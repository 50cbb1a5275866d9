#!/usr/bin/env bash
# tests.names_reach_ctest: every Catch test of the given binaries must be reachable from ctest.
# catch_discover_tests cuts a test's name at a ';' (a CMake list separator): the test registered
# under the cut name then matches nothing and "passes" without running. Use ',' instead. A name
# that starts with '-' is passed to the test binary as an option, which it refuses: the test fails
# without running.
#
# Usage: check_test_names.sh CATCH_BINARY...
set -u -o pipefail
bad=0
for bin in "$@"; do
  # (Catch2 v2 exits with the number of tests listed, not 0.)
  names=$("$bin" --list-test-names-only)
  [ -n "$names" ] || { echo "FAIL: $bin lists no tests"; exit 1; }
  while IFS= read -r name; do
    [ -z "$name" ] && continue
    case "$name" in
      *";"*) echo "FAIL: $(basename "$bin"): \"$name\" has a ';': ctest would run nothing for it (use ',')"; bad=1 ;;
      -*) echo "FAIL: $(basename "$bin"): \"$name\" starts with '-': the binary would take it for an option"; bad=1 ;;
    esac
  done <<< "$names"
done
[ $bad = 0 ] && echo "PASS: no test name has a ';' or starts with '-'"
exit $bad
