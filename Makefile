# ate-devplugd — build, test and run.
#
#   make run      the daemon in the foreground, console logs, default paths
#   make test     lint, generated-code check, then the suite on both runtimes
#                 (a venv with current PyPI releases, and Debian's python3 packages)
#   make dev      create .venv with the package and the test tools (idempotent)
#   make proto    regenerate src/ate_devplugd/_pb from proto/
#   make deb      build dist/ate-devplugd_<version>_all.deb (lintian-gated)
#   make test-package   the .deb in a booted systemd (nspawn): install, run, reload, upgrade, purge
#   make e2e      the .deb in a Debian 12 VM (qemu, software CPU) with real udevd and kernel modules
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
PYTEST_ARGS ?=

# Debian's own runtime (what the .deb depends on), the protoc that makes the committed code,
# build needs of systemd-python for the venv, and udev for the real-uevent tests.
APT_PACKAGES := python3 python3-venv python3-dev python3-grpcio python3-protobuf python3-systemd \
                python3-pyudev python3-pytest python3-hypothesis protobuf-compiler \
                protobuf-compiler-grpc libsystemd-dev pkg-config gcc udev strace

.PHONY: help dev run test lint proto proto-check test-venv test-debian apt clean deb test-package e2e

help:
	@sed -n '3,13p' Makefile | sed 's/^# \{0,1\}//'

$(STAMPS):
	@mkdir -p $@

# apt packages, installed once per package list.
APT_STAMP := $(STAMPS)/apt-$(shell echo '$(APT_PACKAGES)' | md5sum | cut -c1-12)
$(APT_STAMP): | $(STAMPS)
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@touch $@
apt: $(APT_STAMP)

$(VENV)/.installed: pyproject.toml $(APT_STAMP)
	@test -x $(VPY) || python3 -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test,lint]'
	@touch $@
dev: $(VENV)/.installed

run: dev
	@echo "ate-devplugd: serving on /var/lib/kubelet/device-plugins; it registers as soon as kubelet.sock appears (Ctrl-C stops)"
	$(VENV)/bin/ate-devplugd run --log-target console $(ARGS)

PROTOC_CMD = protoc -Iate_devplugd/_pb=$(dir $(PROTO)) --python_out=$(1) --pyi_out=$(1) \
	--grpc_python_out=$(1) --plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin ate_devplugd/_pb/api.proto

proto: $(APT_STAMP)
	$(call PROTOC_CMD,src)

# The committed code must be exactly what Debian's protoc 3.21 + grpc plugin 1.51 make of proto/.
proto-check: $(APT_STAMP)
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
	$(call PROTOC_CMD,$$tmp); \
	for f in api_pb2.py api_pb2.pyi api_pb2_grpc.py; do \
	  cmp -s $$tmp/ate_devplugd/_pb/$$f $(PB)/$$f || { echo "$(PB)/$$f differs from 'make proto' output"; exit 1; }; \
	done; echo "proto-check: generated code matches proto/"

lint: dev
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

test-venv: dev
	$(VPY) -m pytest $(PYTEST_ARGS)

test-debian: $(APT_STAMP)
	PYTHONPATH=src $(SYSPY) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

test: lint proto-check
	@echo "== suite on the venv (current PyPI releases)"; $(VPY) -c 'import grpc, google.protobuf as p; print("grpcio", grpc.__version__, "protobuf", p.__version__)'
	$(MAKE) --no-print-directory test-venv
	@echo "== suite on Debian's runtime"; $(SYSPY) -c 'import grpc, google.protobuf as p; print("grpcio", grpc.__version__, "protobuf", p.__version__)'
	$(MAKE) --no-print-directory test-debian
	@echo "== benchmark smoke run (figures not checked)"
	$(MAKE) --no-print-directory bench QUICK=1
	@echo "== the .deb in a booted systemd"
	$(MAKE) --no-print-directory test-package
	@echo "== the .deb in a VM with real udev and kernel modules"
	$(MAKE) --no-print-directory e2e

deb: $(APT_STAMP)
	packaging/build-deb.sh dist

test-package: deb
	tests/package/run.sh $$(ls -t dist/ate-devplugd_*_all.deb | head -n 1)

# Needs qemu-system-x86_64 with the software CPU (installed by build-image.sh); fails, saying why,
# where it cannot run rather than skipping.
e2e: deb
	tests/system/build-image.sh
	tests/system/run.sh $$(ls -t dist/ate-devplugd_*_all.deb | head -n 1)

clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache src/*.egg-info

# ---- benchmarks (bench/) ------------------------------------------------------------------------
#   make bench           the full run on both runtimes (venv and Debian's python3): one table, each
#                        figure beside its floor; bench/results.json. Under 5 minutes; root and kvm.
#   make bench QUICK=1   a smoke run of every step in seconds (build/bench-quick.json); its figures
#                        are not to be quoted.
.PHONY: bench
bench: dev
	$(VPY) bench/run.py $(if $(QUICK),--quick)
# ---- end of benchmarks --------------------------------------------------------------------------

# ---- soak: the long fault suite (tests/fault) -------------------------------------------------------
#   make soak    tests/fault with ATE_SOAK=1 on both runtimes: 1,000 kubelet restarts, 1,000 device
#                flaps, thousands of hostile inputs; prints one "leak-check" line per check (fds,
#                threads, RSS, CPU). Takes about 10-15 minutes; root and kvm. `make test` runs the
#                same tests in their fast sizes.
SOAK_ARGS := -s -o faulthandler_timeout=1800 tests/fault
.PHONY: soak
soak: dev $(APT_STAMP)
	@echo "== soak on the venv (current PyPI releases)"
	ATE_SOAK=1 ATE_TEST_TIMEOUT=1800 $(VPY) -m pytest $(SOAK_ARGS) $(PYTEST_ARGS)
	@echo "== soak on Debian's runtime"
	ATE_SOAK=1 ATE_TEST_TIMEOUT=1800 PYTHONPATH=src $(SYSPY) -m pytest -p no:cacheprovider $(SOAK_ARGS) $(PYTEST_ARGS)
# ---- end of soak ------------------------------------------------------------------------------------
