#!/usr/bin/env bash
# Installs the Debian 12 packages psd needs to build and test (skips apt when all are present).
set -euo pipefail
pkgs=(cmake ninja-build g++ ccache pkg-config capnproto libcapnp-dev libboost-dev libboost-system-dev
      libspdlog-dev libfmt-dev libcli11-dev libxxhash-dev libssl-dev catch2 iproute2 procps time
      curl python3 python3-prometheus-client chromium python3-yaml yamllint shellcheck openssl
      clang libclang-rt-14-dev llvm-14  # clang, libFuzzer, llvm-symbolizer: tests/fuzz/run.sh
      python3-dev pybind11-dev python3-numpy python3-pytest python3-torch)  # the Python package (client/python)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
