"""``make run``, as a newcomer's first command: it serves a scratch directory, not the host's kubelet
directory, and the next steps it prints work as printed (the fake kubelet, then probe and doctor).

The real Makefile recipe runs, with ``VENV`` pointing at a stand-in for .venv (this interpreter and
these sources) and ``-o`` keeping make from building the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support import SRC, subprocess_env

REPO = SRC.parent


def stand_in_venv(directory: Path) -> Path:
    """``bin/python`` and ``bin/ate-devplugd`` of a .venv, made of this interpreter and ``src/``."""
    (directory / "bin").mkdir(parents=True)
    for name, args in (("python", ""), ("ate-devplugd", " -m ate_devplugd")):
        script = directory / "bin" / name
        script.write_text(
            f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(SRC))} exec {shlex.quote(sys.executable)}{args} "$@"\n'
        )
        script.chmod(0o755)
    return directory


def make_run(venv: Path, *variables: str) -> list[str]:
    return [
        "make",
        "--no-print-directory",
        "-C",
        str(REPO),
        "-o",
        f"{venv}/.installed",
        "run",
        f"VENV={venv}",
        *variables,
    ]


@contextlib.asynccontextmanager
async def own_group(*argv: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``argv`` in a process group of its own, stopped with SIGTERM (and waited for) at the end."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=subprocess_env(),
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            await proc.wait()


async def read_until(proc: asyncio.subprocess.Process, text: str, seen: list[str]) -> None:
    """Read ``proc``'s output line by line into ``seen`` until a line holds ``text``."""
    assert proc.stdout is not None
    async with asyncio.timeout(20):
        while True:
            line = (await proc.stdout.readline()).decode()
            assert line, f"output ended before {text!r}: {seen}"
            seen.append(line.rstrip("\n"))
            if text in line:
                return


def test_default_is_a_scratch_directory_under_build(tmp_path: Path) -> None:
    """By default the recipe serves ``build/run`` of the checkout; ``REAL=1`` runs on the real paths."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = stand_in_venv(tmp_path / "venv")
    dry = subprocess.run([*make_run(venv), "-n"], capture_output=True, text=True, timeout=30, check=True).stdout
    assert f"run --config {REPO}/build/run/config.toml" in dry, dry
    assert f'plugin_dir = "{REPO}/build/run/device-plugins"' in dry
    real = subprocess.run([*make_run(venv, "REAL=1"), "-n"], capture_output=True, text=True, timeout=30, check=True)
    assert f"{venv}/bin/ate-devplugd run --log-target console" in real.stdout
    assert "build/run" not in real.stdout


async def test_make_run_serves_a_scratch_directory_and_the_next_steps_work(tmp_path: Path) -> None:
    """``make run`` writes a config of scratch paths only, serves there, and prints commands that, run as
    printed, register the device with the fake kubelet and show it in probe and doctor."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = stand_in_venv(tmp_path / "venv")
    run_dir = tmp_path / "run"
    seen: list[str] = []
    async with own_group(*make_run(venv, f"RUN_DIR={run_dir}")) as daemon:
        await read_until(daemon, "ready:", seen)
        served = "absent" not in seen[-1]  # the host's /dev/kvm, if it has one, is what is served
        config = (run_dir / "config.toml").read_text()
        for key in ("plugin_dir", "cdi_dir", "metrics_file"):
            (line,) = [line for line in config.splitlines() if line.startswith(f"{key} =")]
            assert line.startswith(f'{key} = "{run_dir}/'), line
        steps = [line.split("#")[0].split() for line in seen if line.startswith("    ") and "#" in line]
        assert [step[:2] for step in steps] == [
            [f"{venv}/bin/python", "tests/fakes/kubelet.py"],
            [f"{venv}/bin/ate-devplugd", "probe"],
            [f"{venv}/bin/ate-devplugd", "doctor"],
        ], seen
        assert steps[0][2:] == ["--dir", f"{run_dir}/device-plugins"]
        assert steps[1][2:] == steps[2][2:] == ["--config", f"{run_dir}/config.toml"]

        steps[0][1] = str(REPO / steps[0][1])  # as printed, from the checkout
        async with own_group(*steps[0]):
            if served:
                await read_until(daemon, "registered ate.dev/kvm with kubelet", seen)
            probe = await asyncio.create_subprocess_exec(
                *steps[1], stdout=asyncio.subprocess.PIPE, env=subprocess_env()
            )
            doctor = await asyncio.create_subprocess_exec(
                *steps[2], stdout=asyncio.subprocess.PIPE, env=subprocess_env()
            )
            async with asyncio.timeout(30):
                (probe_out, _), (doctor_out, _) = await probe.communicate(), await doctor.communicate()
        if served:
            assert probe.returncode == 0, probe_out
            assert b"ate.dev/kvm  ate.dev-kvm.sock" in probe_out
            assert b"OK    kubelet " in doctor_out, doctor_out
            assert (run_dir / "ate-devplugd.prom").exists()
        else:  # no /dev/kvm: the device is absent and nothing is served
            assert b"no plugin sockets in" in probe_out
        # doctor describes the daemon `make run` started, the one that serves its config (by its record)
        config = re.escape(str(run_dir))
        assert re.search(rf"^OK +config +the running daemon's, {config}/config.toml: ".encode(), doctor_out, re.M), (
            doctor_out
        )
        assert re.search(
            rf"^OK +daemon +running \(pid \d+, device-plugin mode in {config}/device-plugins, ".encode(),
            doctor_out,
            re.M,
        ), doctor_out
