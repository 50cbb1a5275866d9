#!/usr/bin/env bash
# Shard replicas (--replicas-per-shard 2) with real processes: 3 psd shards train the example
# model with 3 workers; the chief and then a non-chief are killed with SIGKILL and started again
# (bench/failover.sh --kills 1). Each time the cluster must serve again from the live copies the
# next shard keeps — not from a checkpoint. At most the step in flight is recomputed: a chief
# killed during a commit leaves that step committed on some shards and never released to the
# workers (failover.sh counts from the highest step a survivor holds).
# Usage: replica_failover_test.sh BUILD_DIR
set -u -o pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out=$(timeout 280 "$repo_root/bench/failover.sh" --kills 1 --replicas 2 --build "$1" 2>&1)
rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAIL: failover.sh exited $rc"; exit 1; }
kills=$(echo "$out" | grep -c "^kill [0-9]*:.*from the live copies of step [0-9]* ([01] step(s) to recompute)")
[ "$kills" -eq 2 ] || { echo "FAIL: $kills of 2 kills were recovered from live copies (at most the step in flight recomputed)"; exit 1; }
echo "PASS: both kills recovered from live copies"
