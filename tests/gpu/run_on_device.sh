#!/usr/bin/env bash
# Runs the GPU test on a machine with a CUDA device but without this project's build or its
# libraries: bundle here, carry the bundle there, run it there.
#
#   here:   cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DPSD_WERROR=ON \
#             -DPSD_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc
#           cmake --build build-cuda -j2
#           tests/gpu/run_on_device.sh bundle build-cuda build-gpu-bundle
#   there:  tests/gpu/run_on_device.sh run build-gpu-bundle       (exit 0 passed, 77 no device)
#
# The bundle (git-ignored: /build*/) holds psd, psd_gpu_training_test, libpsclient and every
# shared library ldd finds outside the C library's own (Cap'n Proto, KJ, spdlog, fmt, OpenSSL, the
# CUDA runtime, libstdc++); the GPU machine needs only an NVIDIA driver recent enough for the
# toolkit the test was built with. `run` prints the device (nvidia-smi) and the test's output.
set -euo pipefail
mode=${1:-}
case "$mode" in
  bundle)
    build=$2 out=$3
    [ -x "$build/server/psd" ] && [ -x "$build/tests/gpu/psd_gpu_training_test" ] ||
      { echo "no $build/server/psd or $build/tests/gpu/psd_gpu_training_test: build with -DPSD_WITH_CUDA=ON first" >&2; exit 2; }
    rm -rf "$out"; mkdir -p "$out/lib"
    cp "$build/server/psd" "$build/tests/gpu/psd_gpu_training_test" "$out/"
    cp -L "$build"/client/libpsclient.so.0 "$out/lib/"
    # Every resolved dependency but the C runtime (libc, libm, ld.so, libpthread, libdl, librt),
    # which must come from the machine that runs it.
    for bin in "$out/psd" "$out/psd_gpu_training_test" "$out/lib/libpsclient.so.0"; do
      LD_LIBRARY_PATH="$build/client${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$bin" |
        awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
    done | sort -u | grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' | while read -r lib; do
      case "$lib" in */libpsclient.so*) continue ;; esac
      cp -L "$lib" "$out/lib/"
    done
    ls -la "$out" "$out/lib"
    du -sh "$out"
    ;;
  run)
    nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
    dir=$2 steps=${3:-8}
    cd "$dir"
    export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    ldd ./psd_gpu_training_test | grep -E "not found" && { echo "missing libraries (above)" >&2; exit 2; }
    timeout 300 ./psd_gpu_training_test ./psd "$steps"
    ;;
  *)
    echo "usage: $0 bundle <cuda build dir> <bundle dir> | $0 run <bundle dir>" >&2
    exit 2
    ;;
esac
