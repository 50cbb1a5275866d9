#!/usr/bin/env bash
# Builds and installs psd's Python package, psclient, for Debian's /usr/bin/python3 (README "Python"):
#
#   deploy/install_python.sh [--prefix DIR] [--build DIR]
#
# Installs the Debian packages (deploy/install_deps.sh), configures a Release build of libpsclient
# and the extension only (no daemon, tests or bench), and installs the package and libpsclient into
# DIR (default /usr/local: DIR/lib/python3.X/dist-packages/psclient and DIR/lib/libpsclient.so*).
# Debian's python3 reads /usr/local/lib/python3.X/dist-packages by itself; for another DIR the
# script prints the PYTHONPATH to set. Needs root (or sudo) for packages and for a system prefix.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
prefix=/usr/local
build="$here/build-python"
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "install_python.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)

"$here/deploy/install_deps.sh"
export CCACHE_BASEDIR="$here"
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" \
  -DPython3_EXECUTABLE=/usr/bin/python3 -DPSD_BUILD_PYTHON=ON -DPSD_BUILD_TESTS=OFF -DPSD_BUILD_BENCH=OFF \
  -DPSD_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build" --target psclient_python -j "$(nproc)"
sudo=""
if [ ! -w "$prefix" ] && [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
$sudo cmake --install "$build" --component python

site=$(/usr/bin/python3 -c 'import sys; print(f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/dist-packages")')
check_path=""
if ! (cd / && /usr/bin/python3 -c 'import sys; sys.exit(sys.argv[1] not in sys.path)' "$prefix/$site"); then
  check_path="$prefix/$site"
fi
version=$(cd / && PYTHONPATH="$check_path${PYTHONPATH:+:$PYTHONPATH}" /usr/bin/python3 -c \
  'import psclient; print(psclient.__version__, psclient.__file__)')
echo "installed psclient $version"
if [ -n "$check_path" ]; then
  echo "$prefix is not on Debian python3's path: export PYTHONPATH=$check_path"
fi
