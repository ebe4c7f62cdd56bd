#!/usr/bin/env bash
# Installs the Debian packages kvq builds and tests with (needs root or sudo).
set -euo pipefail
pkgs=(build-essential cmake git python3 python3-venv ca-certificates
      libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libfmt-dev libcpp-httplib-dev zlib1g-dev pkg-config
      python3-jsonschema)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all packages present"
  exit 0
fi
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO=sudo
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
