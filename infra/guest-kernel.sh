#!/usr/bin/env bash
# The microVM guest: Debian's kernel package downloaded and unpacked (never installed: a second
# kernel image on the host would join its boot menu and initramfs hooks), then reduced by
# linuxnode/vm/guest_image.py to a kernel, the project's initramfs and its release in $2; then
# the `vm` level's initramfs beside them (linuxnode/vm/vm_guest.py: display and input modules).
# Usage: guest-kernel.sh PYTHON OUT. Fast when OUT already holds a guest built from these sources.
set -euo pipefail
py="$1" out="$2"
sources=$(cat linuxnode/vm/guest/agent.c linuxnode/vm/guest/init linuxnode/vm/guest_image.py linuxnode/vm/vm_guest.py | sha256sum | cut -c1-16)
package=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)
[ -n "$package" ] || { echo "no Debian kernel package (linux-image-amd64) in the apt sources" >&2; exit 1; }
stamp="$package $sources"
if [ -f "$out/built-from" ] && [ "$(cat "$out/built-from")" = "$stamp" ]; then exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -qq "$package" 2>/dev/null) || (cd "$work" && apt-get update -qq && apt-get download -qq "$package")
dpkg-deb -x "$work"/linux-image-*.deb "$work/root"
"$py" -m linuxnode.vm.guest_image "$work/root" "$out"
"$py" -m linuxnode.vm.vm_guest "$work/root" "$out"
echo "$stamp" > "$out/built-from"
