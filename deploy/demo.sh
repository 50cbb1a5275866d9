#!/usr/bin/env bash
# The main job, from a fresh Debian 12 machine: install the packages, build (Release), then run
# a local cluster — two psd shards (an elected chief; the weight vector sliced over both) and
# three workers (2 replicas to aggregate + 1 backup, the last one an artificial straggler)
# training logistic regression, all launched by psrun, printing progress and a summary.
# Arguments replace the defaults (see deploy/local_cluster.sh), e.g. `deploy/demo.sh --shards 1`
# for a single daemon; to keep the demo's cluster and change one thing, repeat the defaults:
# `deploy/demo.sh --shards 2 --features 2048 --steps 100000 --timeout-s 0 -- --slice-bytes 4096`
# (a long run with no time limit: Ctrl-C stops it). `deploy/demo.sh --python [options]` runs the
# same job with the Python workers instead (client/python/examples/mlp_classifier.py: a PyTorch
# MLP classifier through psclient.torch); `deploy/demo.sh --both` runs the C++ job, then the
# Python one.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/deploy/install_deps.sh"
# Only the targets below are built; the cache keeps whatever a developer configured (tests stay on).
cmake -S "$here" -B "$here/build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
mode=cpp
case "${1:-}" in
  --python) mode=python; shift ;;
  --both) mode=both; shift ;;
esac
targets=(psd psd_logreg_worker psd_bench psrun)
if [ "$mode" != cpp ]; then targets+=(psclient_python); fi
cmake --build "$here/build" --target "${targets[@]}"
if [ "$mode" = python ]; then
  if [ $# -eq 0 ]; then set -- --shards 2 -- --slice-bytes 4096; fi
  exec "$here/deploy/local_cluster.sh" --build "$here/build" --python "$@"
fi
if [ $# -eq 0 ]; then set -- --shards 2 --features 2048 -- --slice-bytes 4096; fi
if [ "$mode" = both ]; then
  "$here/deploy/local_cluster.sh" --build "$here/build" "$@"
  echo "--- the same job with the Python workers (PyTorch MLP classifier) ---"
  exec "$here/deploy/local_cluster.sh" --build "$here/build" --python --shards 2 -- --slice-bytes 4096
fi
exec "$here/deploy/local_cluster.sh" --build "$here/build" "$@"
