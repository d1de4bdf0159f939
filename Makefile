# Two entry points for a fresh Debian 12 machine, as root: `make demo` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
APT_PACKAGES := catatonit strace libseccomp2 iproute2 util-linux python3-venv nodejs npm erofs-utils busybox-static debootstrap crun libfuse3-dev pkg-config fuse3 python3-bpfcc linux-headers-$(shell dpkg --print-architecture) nftables apparmor gcc libc6-dev prometheus tmux qemu-system-x86 qemu-utils seabios kmod
NODE_STAMP := tests/node/node_modules/.installed

.PHONY: install demo test schemas clean-venv bench fusion-layers

install: $(STAMP) $(NODE_STAMP)

$(STAMP): pyproject.toml infra/install-deps.sh infra/bcc-in-venv.sh infra/guest-kernel.sh linuxnode/vm/guest/agent.c linuxnode/vm/guest/init linuxnode/vm/guest_image.py linuxnode/vm/vm_guest.py Makefile
	bash infra/install-deps.sh $(APT_PACKAGES)
	test -x $(PY) || /usr/bin/python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[node,test]'
	bash infra/bcc-in-venv.sh $(VENV)
	bash infra/guest-kernel.sh $(PY) $(VENV)/share/sandfleet-guest
	touch $@

$(NODE_STAMP): tests/node/package.json | $(STAMP)
	cd tests/node && npm install --no-audit --no-fund --silent
	touch $@

demo: install
	$(PY) -m sandfleet.demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 -n 2 --dist loadfile

schemas: install
	$(PY) -m schemas.export schemas/json

bench: install
	$(PY) -m loadtest.create_rate

# The SandboxFusion endpoint's language layers (python bash cpp nodejs go java), one Debian root
# each, built by the running platform at $$SANDFLEET_NATS_URL (`sandfleet up` first).
fusion-layers: install
	$(PY) -m sandfleet.cli fusion layers
