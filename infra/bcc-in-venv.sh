#!/usr/bin/env bash
# Makes Debian's bcc (python3-bpfcc, pure Python over libbcc) importable from the venv.
#
#   bash infra/bcc-in-venv.sh [VENV]      (default .venv; idempotent)
#
# Only the `bcc` package is linked in: a .pth naming /usr/lib/python3/dist-packages would
# drag every Debian Python package into the venv and shadow what pip installed.
set -euo pipefail
venv="${1:-.venv}"
src=/usr/lib/python3/dist-packages/bcc
if [ ! -f "$src/__init__.py" ]; then
    echo "bcc-in-venv: $src is missing; apt-get install python3-bpfcc" >&2
    exit 1
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
link="$site/bcc"
if [ "$(readlink "$link" 2>/dev/null || true)" != "$src" ]; then
    if [ -e "$link" ] && [ ! -L "$link" ]; then
        echo "bcc-in-venv: $link exists and is not our symlink; leaving it" >&2
        exit 1
    fi
    ln -sfn "$src" "$link"
fi
"$venv/bin/python" -c 'import bcc' || { echo "bcc-in-venv: bcc still not importable from $venv" >&2; exit 1; }
