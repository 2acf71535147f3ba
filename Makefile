# ate-devplugd — build, test and run. `make help` lists the targets; each target's `##` comment is its help.
#
# Everything a fresh Debian 12 machine lacks is installed here (apt packages, the venv).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV      := .venv
VPY       := $(VENV)/bin/python
SYSPY     := /usr/bin/python3
STAMPS    := .cache/stamps
PB        := src/ate_devplugd/_pb
PROTO     := proto/deviceplugin/v1beta1/api.proto
# DRA and CRI protos: proto/<dir>/api.proto is generated as ate_devplugd._pb.<dir as package>.api_pb2
DRA_PROTO_DIRS := dra/v1 dra/v1beta1 pluginregistration/v1 drahealth/v1alpha1 cri/v1 podresources/v1
VERSION   := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' src/ate_devplugd/__init__.py)
DEB       := dist/ate-devplugd_$(VERSION)_all.deb
NOBODY    := setpriv --reuid=65534 --regid=65534 --clear-groups
PYTEST_ARGS ?=

# Debian's own runtime (what the .deb depends on), the protoc that makes the committed code,
# build needs of systemd-python for the venv, udev for the real-uevent tests, strace, podman
# with runc (a real CDI consumer) and containerd 1.6 (CRI, as kubelet drives it) plus libc6-dev
# (static libc) for the container tests' checker, node_exporter and promtool (the real readers of the
# metrics file) and prometheus_client (whose parser reads it in the tests; the daemon does not use it),
# and aiohttp, PyYAML and
# cryptography for the DRA mode and its fake API server's certificates.
APT_PACKAGES := python3 python3-venv python3-dev python3-grpcio python3-protobuf python3-systemd \
                python3-pyudev python3-pytest python3-hypothesis python3-prometheus-client \
                python3-aiohttp python3-yaml python3-cryptography \
                protobuf-compiler protobuf-compiler-grpc libsystemd-dev pkg-config gcc udev strace \
                podman runc containerd libc6-dev prometheus-node-exporter prometheus

.PHONY: help dev run test lint proto proto-check test-venv test-debian test-nonroot test-trixie apt clean deb \
        test-package e2e e2e-arm64 check bench soak runtimes

help: ## this list
	@awk 'BEGIN { FS = ":.*## " } /^[a-z][a-z0-9-]*:.*## / { printf "  make %-14s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)
	@echo "  variables: PYTEST_ARGS='...' (both suites), QUICK=1 (bench), ARGS='...' and REAL=1 (run), FULL=1 (e2e-arm64)"

$(STAMPS):
	@mkdir -p $@

# apt packages, installed once per package list.
APT_STAMP := $(STAMPS)/apt-$(shell echo '$(APT_PACKAGES)' | md5sum | cut -c1-12)
$(APT_STAMP): | $(STAMPS)
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get -o DPkg::Lock::Timeout=300 update -qq && \
	  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@touch $@
apt: $(APT_STAMP) ## install the Debian packages the build and the tests need

$(VENV)/.installed: pyproject.toml $(APT_STAMP)
	@test -x $(VPY) || python3 -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test,lint]'
	@touch $@
dev: $(VENV)/.installed ## create .venv: current PyPI releases, pytest, ruff, mypy (idempotent)

# `make run` serves a scratch kubelet directory under build/run (its config is build/run/config.toml,
# written once: edit it freely), so that nothing is created on the host (no /var/lib/kubelet, no
# metrics in node_exporter's directory, no CDI spec in /var/run/cdi); /dev/kvm is only looked at.
# `make run REAL=1` runs on the real paths (the packaged defaults, or ARGS='--config ...').
RUN_DIR := $(CURDIR)/build/run
run: dev ## the daemon in the foreground on a scratch directory (build/run), with the next steps; REAL=1: the real paths
ifeq ($(REAL),)
	@mkdir -p $(RUN_DIR)/device-plugins
	@test -e $(RUN_DIR)/config.toml || printf '%s\n' \
	  '# make run: a scratch kubelet directory; see ate-devplugd.toml(5) (packaging/man/ate-devplugd.toml.5)' \
	  'plugin_dir = "$(RUN_DIR)/device-plugins"' \
	  'cdi_dir = "$(RUN_DIR)/cdi"' \
	  'metrics_file = "$(RUN_DIR)/ate-devplugd.prom"' \
	  '' '[[device]]' 'resource = "ate.dev/kvm"' 'path = "/dev/kvm"' >$(RUN_DIR)/config.toml
	@echo "ate-devplugd: serving on $(RUN_DIR)/device-plugins (config: $(RUN_DIR)/config.toml); Ctrl-C stops."
	@echo "  It registers as soon as a kubelet.sock appears there. Next, in another terminal:"
	@echo "    $(VPY) tests/fakes/kubelet.py --dir $(RUN_DIR)/device-plugins   # a stand-in for kubelet"
	@echo "    $(VENV)/bin/ate-devplugd probe --config $(RUN_DIR)/config.toml   # what kubelet sees"
	@echo "    $(VENV)/bin/ate-devplugd doctor --config $(RUN_DIR)/config.toml  # the node, check by check"
	@echo "  (make run REAL=1: kubelet's real directory and the packaged defaults instead)"
	$(VENV)/bin/ate-devplugd run --config $(RUN_DIR)/config.toml --log-target console $(ARGS)
else
	@echo "ate-devplugd: serving on /var/lib/kubelet/device-plugins; it registers as soon as kubelet.sock appears (Ctrl-C stops)"
	@echo "  Then: $(VENV)/bin/ate-devplugd probe; $(VENV)/bin/ate-devplugd doctor (with the same --config, if ARGS gives one)"
	$(VENV)/bin/ate-devplugd run --log-target console $(ARGS)
endif

PROTOC_CMD = protoc -Iate_devplugd/_pb=$(dir $(PROTO)) --python_out=$(1) --pyi_out=$(1) \
	--grpc_python_out=$(1) --plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin ate_devplugd/_pb/api.proto

PROTOC_DRA_CMD = protoc -Iate_devplugd/_pb/$(2)=proto/$(2) --python_out=$(1) --pyi_out=$(1) \
	--grpc_python_out=$(1) --plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin ate_devplugd/_pb/$(2)/api.proto

proto: $(APT_STAMP) ## regenerate src/ate_devplugd/_pb from proto/ (Debian's protoc 3.21)
	$(call PROTOC_CMD,src)
	$(foreach d,$(DRA_PROTO_DIRS),$(call PROTOC_DRA_CMD,src,$(d));)

proto-check: $(APT_STAMP) ## fail if the committed generated code differs from what `make proto` makes
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
	$(call PROTOC_CMD,$$tmp); \
	$(foreach d,$(DRA_PROTO_DIRS),$(call PROTOC_DRA_CMD,$$tmp,$(d));) \
	for f in api_pb2.py api_pb2.pyi api_pb2_grpc.py $(foreach d,$(DRA_PROTO_DIRS),$(addprefix $(d)/,api_pb2.py api_pb2.pyi api_pb2_grpc.py)); do \
	  cmp -s $$tmp/ate_devplugd/_pb/$$f $(PB)/$$f || { echo "$(PB)/$$f differs from 'make proto' output"; exit 1; }; \
	done; echo "proto-check: generated code matches proto/"

lint: dev ## ruff (check and format) and mypy --strict
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

test-venv: dev ## the suite on the venv (current PyPI grpcio/protobuf)
	@$(VPY) -c 'import grpc, google.protobuf as p; print("== suite on the venv: grpcio", grpc.__version__, "protobuf", p.__version__)'
	$(VPY) -m pytest $(PYTEST_ARGS)

test-debian: $(APT_STAMP) ## the suite on Debian's python3 packages (the .deb's runtime)
	@$(SYSPY) -c 'import grpc, google.protobuf as p; print("== suite on Debian: grpcio", grpc.__version__, "protobuf", p.__version__)'
	PYTHONPATH=src $(SYSPY) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

# podman runs rootful in the tests: as nobody its tests skip, even in make check.
test-nonroot: $(APT_STAMP) ## the suite as nobody, as if the machine had no /dev/kvm (what a contributor runs)
	@echo "== suite as nobody, without /dev/kvm (Debian's python3), in a copy nobody owns"
	@tmp=$$(mktemp -d /tmp/ate-devplugd-nonroot.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
	git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -C "$$tmp" -xf -; \
	chown -R 65534:65534 "$$tmp"; \
	cd "$$tmp" && $(NOBODY) env -u ATE_REQUIRE_PODMAN -u ATE_REQUIRE_CONTAINERD HOME="$$tmp" ATE_TEST_NO_KVM=1 PYTHONPATH=src \
	    $(SYSPY) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

test: lint proto-check test-venv test-debian ## lint, generated-code check, the suite on both runtimes (minutes)

test-trixie: ## the suite on Debian 13's python3 and packages (a cached trixie tree, chrooted into)
	tests/runtime/run-suite.sh trixie $(PYTEST_ARGS)

# The CRI tests (tests/integration/test_cri_containerd.py) drive Debian 12's containerd 1.6 (apt),
# Debian 13's 1.7 from the trixie tree and forky/sid's 2.1 from its .deb, unpacked (both run on
# Debian 12); they find them in .cache/runtime.
runtimes: $(APT_STAMP) ## the container runtimes the CRI tests drive: containerd 1.6 (apt), 1.7 (the trixie tree), 2.1 (.deb)
	tests/runtime/run-suite.sh --build-only trixie
	tests/runtime/containerd-deb.sh

# Only the package's build dependencies (build-deb.sh installs them with apt-get satisfy), not the test stack.
$(DEB): $(shell git ls-files src packaging pyproject.toml README.md 2>/dev/null)
	packaging/build-deb.sh dist
deb: $(DEB) ## dist/ate-devplugd_<version>_all.deb (lintian-gated), built once per change

test-package: $(DEB) ## the .deb in booted Debian 12 and 13 trees (nspawn): install, run, reload, upgrade, purge
	tests/package/run.sh $(DEB)

# Needs qemu-system-x86_64 with the software CPU (installed by build-image.sh); fails, saying why,
# where it cannot run rather than skipping.
e2e: $(DEB) ## the .deb in a Debian 12 VM (qemu) with real udevd and kernel modules
	tests/system/build-image.sh amd64
	tests/system/run.sh --arch amd64 $(DEB)

# The same test on an emulated aarch64 machine (qemu-system-aarch64 from qemu-system-arm, the image
# made through qemu-user; both installed by build-image.sh), whose Debian 12 arm64 kernel runs KVM.
# It leaves out a step and four container checks that emulation makes slow and the amd64 run has;
# FULL=1 runs them too, and Debian's own arm64 qemu as a real VMM in a container (an image of its own,
# .cache/vm/arm64-full).
e2e-arm64: $(DEB) ## the .deb in a Debian 12 arm64 VM (emulated aarch64 with KVM inside); FULL=1: every step
	tests/system/build-image.sh arm64 $(if $(FULL),--full)
	tests/system/run.sh --arch arm64 $(if $(FULL),--full) $(DEB)

# In CI the tests of real consumers (podman, containerd, node_exporter, promtool) fail, saying why,
# where they cannot run, rather than skip. `runtimes` comes first: `make test` drives containerd 1.7
# from the trixie tree and 2.1 from its unpacked .deb. ATE_RESTARTS=1000 runs
# tests/fault/test_registration_once.py's random kubelet restarts at full size (1,000 with the CPU
# idle, 1,000 with it overcommitted: about 3 minutes a suite).
# ATE_NODE_LIFE_EVENTS=60 runs tests/fault/test_node_life.py's random node life at 60 events a mode
# (25 in `make test`): doctor runs after each, so 1.3 minutes a suite quiet, up to 3.5 loaded.
check: export ATE_REQUIRE_PODMAN := 1
check: export ATE_REQUIRE_CONTAINERD := 1
check: export ATE_REQUIRE_PROMETHEUS_TOOLS := 1
check: export ATE_RESTARTS := 1000
check: export ATE_NODE_LIFE_EVENTS := 60
check: runtimes test test-nonroot test-trixie ## what CI runs: `make test`, as nobody, on Debian 13, bench smoke, package and VM tests (amd64, arm64)
	@echo "== benchmark smoke run (figures not checked)"
	$(MAKE) --no-print-directory bench QUICK=1
	@echo "== the .deb in a booted systemd"
	$(MAKE) --no-print-directory test-package
	@echo "== the .deb in a VM with real udev and kernel modules"
	$(MAKE) --no-print-directory e2e
	@echo "== the .deb in an emulated arm64 VM"
	$(MAKE) --no-print-directory e2e-arm64

clean: ## remove build output and caches (not .venv, not .cache)
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache src/*.egg-info

# ---- benchmarks (bench/) ------------------------------------------------------------------------
#   make bench           the full run on both runtimes (venv and Debian's python3): one table, each
#                        figure beside its floor; bench/results.json. Under 5 minutes; root and kvm.
#   make bench QUICK=1   a smoke run of every step in seconds (build/bench-quick.json); its figures
#                        are not to be quoted.
bench: dev ## the benchmarks on both runtimes, each figure beside its floor (QUICK=1: a smoke run)
	$(VPY) bench/run.py $(if $(QUICK),--quick)

# ---- soak: the long fault suite (tests/fault) -------------------------------------------------------
#   make soak    tests/fault with ATE_SOAK=1 on both runtimes: 1,000 kubelet restarts, 1,000 device
#                flaps, thousands of hostile inputs; prints one "leak-check" line per check (fds,
#                threads, RSS, CPU). Takes about 30 minutes; root and kvm. `make test` runs the
#                same tests in their fast sizes.
SOAK_ARGS := -s -o faulthandler_timeout=1800 tests/fault
soak: dev $(APT_STAMP) ## the fault suite's long sizes on both runtimes (about 30 minutes)
	@echo "== soak on the venv (current PyPI releases)"
	ATE_SOAK=1 ATE_TEST_TIMEOUT=1800 $(VPY) -m pytest $(SOAK_ARGS) $(PYTEST_ARGS)
	@echo "== soak on Debian's runtime"
	ATE_SOAK=1 ATE_TEST_TIMEOUT=1800 PYTHONPATH=src $(SYSPY) -m pytest -p no:cacheprovider $(SOAK_ARGS) $(PYTEST_ARGS)
