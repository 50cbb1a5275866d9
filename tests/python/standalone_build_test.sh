#!/usr/bin/env bash
# The binding builds against an INSTALLED libpsclient (public headers + find_package(psclient) only):
# install the build to a prefix, build client/python standalone against it, import and use it.
#   standalone_build_test.sh BUILD_DIR SOURCE_DIR PSD_BINARY
set -euo pipefail
build=$1 src=$2 psd=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
export CCACHE_BASEDIR="$src"
cmake -S "$src/client/python" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >/dev/null
cmake --build "$tmp/build" >/dev/null
# The standalone package must load the installed libpsclient, not the build tree's.
cd "$tmp" && PYTHONPATH="$tmp/build/python" timeout 120 /usr/bin/python3 - "$psd" "$tmp/prefix" <<'PY'
import os, subprocess, sys, tempfile, time
import numpy as np
import psclient
psd, prefix = sys.argv[1], sys.argv[2]
maps = open(f"/proc/{os.getpid()}/maps").read()
assert f"{prefix}/lib/libpsclient.so" in maps, "not the installed libpsclient"
port_file = os.path.join(tempfile.mkdtemp(), "port")
daemon = subprocess.Popen([psd, "--port", "0", "--port-file", port_file], stderr=subprocess.DEVNULL)
try:
    deadline = time.monotonic() + 30
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        assert daemon.poll() is None and time.monotonic() < deadline, "psd did not start"
        time.sleep(0.02)
    with psclient.Client(port=int(open(port_file).read())) as c:
        w = np.arange(4, dtype=np.float32)
        c.create_variable("w", w)
        out = np.zeros(4, np.float32)
        c.pull("w", out)
        assert (out == w).all()
finally:
    daemon.kill()
    daemon.wait(timeout=30)
print("PASS")
PY
