#!/usr/bin/env bash
# Installs the Debian packages the platform needs; fast when they are already there.
set -euo pipefail
missing=()
for pkg in "$@"; do
    case "$pkg" in
        nodejs|npm) command -v "${pkg/nodejs/node}" >/dev/null 2>&1 && continue ;;
    esac
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
