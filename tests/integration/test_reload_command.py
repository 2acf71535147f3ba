"""`ate-devplugd reload` (the unit's ExecReload): it signals the daemon and waits for the daemon's verdict
on that reload, so every refusal fails it with the reason on stderr.

The command runs as a real subprocess; the daemon runs on the test's loop (the command's SIGHUP reaches
it through the loop's signal handler, as in the real process) or as a real subprocess of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from pathlib import Path

from ate_devplugd import config as configmod
from ate_devplugd.config import Config
from ate_devplugd.reload import result as reload_result
from ate_devplugd.reload.result import Outcome
from tests.support import (
    FakeKernel,
    daemon,
    daemon_in_process,
    kvm_config,
    run_cli,
    subprocess_env,
    wait_for_path,
    write_config,
)

RESTART_ONLY_LINE = (
    "ate-devplugd: reload refused: mode = 'dra' (running: 'device-plugin'): changes only on restart, "
    "so nothing of this reload was applied\n"
)
#: The same change in a file: DRA mode's [dra] table comes with it (its defaults).
RESTART_ONLY_FILE_LINE = (
    "ate-devplugd: reload refused: mode = 'dra' (running: 'device-plugin'), [dra] added: change only on "
    "restart, so nothing of this reload was applied\n"
)


def runtime_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return run


async def reload_in_process(
    tmp_path: Path, kernel: FakeKernel, config: Config, new: Config | Path, *, journal: bool = False
) -> tuple[int, str]:
    """The daemon on this loop runs ``config``; ``ate-devplugd reload`` makes it reload ``new`` (a config,
    or a file to load): the command's exit status and stderr (with ``journal``, a file that
    ``$JOURNAL_STREAM`` names, as systemd gives ExecReload= the journal)."""
    run = runtime_dir(tmp_path)
    result = run / reload_result.FILE_NAME

    def reload_config() -> Config:
        return configmod.load(new) if isinstance(new, Path) else new

    async with daemon_in_process(
        config, kernel, reload_config=reload_config, running_config=run / "running-config.toml", reload_result=result
    ) as running:
        await running.events.wait_for("ready")
        started = reload_result.read(str(result))
        assert started is not None and (started.pid, started.generation, started.outcome) == (
            os.getpid(),
            0,
            Outcome.STARTED,
        )
        env = subprocess_env(RUNTIME_DIRECTORY=str(run), MAINPID=str(os.getpid()))
        if journal:
            status, out, err = await run_with_journal(tmp_path / "journal", env)
        else:
            status, out, err = await run_cli("reload", "--timeout", "20", env=env)
        assert out == ""
        after = reload_result.read(str(result))
        assert after is not None and after.generation == 1, after
        assert after.outcome is (Outcome.APPLIED if status == 0 else Outcome.REFUSED), (after, err)
    assert not result.exists(), "the record outlived the daemon"
    return status, err


async def run_with_journal(path: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """``ate-devplugd reload`` with stderr the "journal": a file named by ``$JOURNAL_STREAM``."""
    with open(path, "wb") as stream:
        st = os.fstat(stream.fileno())
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "ate_devplugd", "reload", "--timeout", "20"),
            stdout=asyncio.subprocess.PIPE,
            stderr=stream,
            env={**env, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"},
        )
        out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), path.read_text()


class TestVerdict:
    async def test_applied_exits_0(self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """A config the daemon applies: exit 0, nothing printed."""
        config = kvm_config(plugin_dir, fake_root, count=8)
        status, err = await reload_in_process(tmp_path, kernel, config, kvm_config(plugin_dir, fake_root, count=4))
        assert (status, err) == (0, "")

    async def test_config_error_exits_1_with_the_error(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A file that does not load: exit 1 with its first error, as check-config prints it."""
        broken = write_config(
            tmp_path / "c.toml",
            plugin_dir,
            fake_root,
            '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = 0\n',
        )
        status, err = await reload_in_process(tmp_path, kernel, kvm_config(plugin_dir, fake_root, count=8), broken)
        assert status == 1
        assert err.startswith("ate-devplugd: config error: device[0] (ate.dev/kvm): count: 0 must be"), err
        assert err.count("\n") == 1, err

    async def test_in_the_journal_each_error_is_written_once(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Run by ExecReload= (stderr the journal, where the daemon wrote each error): exit 1, and a line
        that does not write the error a second time."""
        broken = write_config(
            tmp_path / "c.toml",
            plugin_dir,
            fake_root,
            '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = 0\n',
        )
        config = kvm_config(plugin_dir, fake_root, count=8)
        status, err = await reload_in_process(tmp_path, kernel, config, broken, journal=True)
        assert (status, err) == (1, "ate-devplugd: reload 1 refused: the daemon's errors above say why\n")

    async def test_restart_only_change_exits_1_with_one_line(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A valid config that changes the mode (which check-config passes): refused whole, exit 1 with the
        one line that says why."""
        config = kvm_config(plugin_dir, fake_root, count=8)
        status, err = await reload_in_process(tmp_path, kernel, config, dataclasses.replace(config, mode="dra"))
        assert (status, err) == (1, RESTART_ONLY_LINE)

    async def test_a_reload_running_when_signalled_is_not_the_verdict(self, tmp_path: Path) -> None:
        """The record read before the signal is of a reload already running: its end is not this reload's
        verdict, nor is another process's record; the next reload's end is."""
        path = str(tmp_path / reload_result.FILE_NAME)
        pid = os.getpid()
        reload_result.write(path, reload_result.Result(pid, 3, Outcome.RELOADING))
        after = reload_result.generation_of(path, pid)
        assert after == 3
        reload_result.write(path, reload_result.Result(pid, 3, Outcome.APPLIED))
        assert await reload_result.wait(path, pid, after, 0.2) is None
        reload_result.write(path, reload_result.Result(pid + 1, 9, Outcome.APPLIED))
        assert await reload_result.wait(path, pid, after, 0.2) is None
        waiting = asyncio.ensure_future(reload_result.wait(path, pid, after, 20))
        reload_result.write(path, reload_result.Result(pid, 4, Outcome.RELOADING))
        reload_result.write(path, reload_result.Result(pid, 4, Outcome.REFUSED, "reload refused: why"))
        async with asyncio.timeout(10):
            got = await waiting
        assert got == reload_result.Result(pid, 4, Outcome.REFUSED, "reload refused: why")

    async def test_no_verdict_within_the_timeout(self, tmp_path: Path) -> None:
        path = str(tmp_path / reload_result.FILE_NAME)
        reload_result.write(path, reload_result.Result(os.getpid(), 0, Outcome.STARTED))
        assert await reload_result.wait(path, os.getpid(), 0, 0.2) is None


class TestNoDaemon:
    async def test_a_pid_that_runs_nothing(self, tmp_path: Path) -> None:
        """A pid no process has: a clear line, exit 1."""
        gone = await asyncio.create_subprocess_exec("true")
        await gone.wait()
        env = subprocess_env(RUNTIME_DIRECTORY=str(runtime_dir(tmp_path)))
        status, _, err = await run_cli("reload", "--pid", str(gone.pid), env=env)
        assert (status, err) == (1, f"ate-devplugd: no daemon to reload: no process {gone.pid} is running\n")

    async def test_no_pid_and_no_record(self, tmp_path: Path) -> None:
        """Neither $MAINPID nor a record of a running daemon: it says how to name one, exit 1."""
        run = runtime_dir(tmp_path)
        status, _, err = await run_cli("reload", env=subprocess_env(RUNTIME_DIRECTORY=str(run)))
        assert status == 1
        assert err == (
            f"ate-devplugd: no running daemon to reload: $MAINPID is not set and there is no record of one in "
            f"{run}; give --pid, or use systemctl reload ate-devplugd\n"
        )

    async def test_the_daemon_ends_before_its_verdict(self, tmp_path: Path) -> None:
        """A process that takes SIGHUP and ends: the wait ends with it, not at the timeout."""
        run = runtime_dir(tmp_path)
        sleeper = await asyncio.create_subprocess_exec("sleep", "60")
        try:
            result = run / reload_result.FILE_NAME
            reload_result.write(str(result), reload_result.Result(sleeper.pid, 0, Outcome.STARTED))
            env = subprocess_env(RUNTIME_DIRECTORY=str(run), MAINPID=str(sleeper.pid))
            async with asyncio.timeout(20):
                status, _, err = await run_cli("reload", "--timeout", "60", env=env)
            assert (status, err) == (
                1,
                f"ate-devplugd: the daemon (pid {sleeper.pid}) ended before it said how the reload went\n",
            )
        finally:
            if sleeper.returncode is None:
                sleeper.send_signal(signal.SIGKILL)
            await sleeper.wait()


class TestRealDaemon:
    async def test_under_a_runtime_directory(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """The daemon as the unit runs it ($RUNTIME_DIRECTORY): a good reload exits 0, a mode change 1 with
        its line, and the daemon keeps running the config it had."""
        run = runtime_dir(tmp_path)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        good = cfg.read_text()
        async with daemon(cfg, env=subprocess_env(RUNTIME_DIRECTORY=str(run))) as proc:
            await wait_for_path(run / reload_result.FILE_NAME, timeout=20)
            env = subprocess_env(RUNTIME_DIRECTORY=str(run), MAINPID=str(proc.pid))
            cfg.write_text(good.replace('path = "/dev/kvm"\n', 'path = "/dev/kvm"\ncount = 8\n'))
            status, _, err = await run_cli("reload", env=env)
            assert (status, err) == (0, ""), proc.log()
            cfg.write_text('mode = "dra"\n' + good)
            status, _, err = await run_cli("reload", env=env)
            assert (status, err) == (1, RESTART_ONLY_FILE_LINE), proc.log()
            running = configmod.load(run / "running-config.toml")
            assert running.mode == "device-plugin" and running.devices[0].count == 8
            assert proc.proc is not None and proc.proc.returncode is None
            assert await proc.stop() == 0
        assert not (run / reload_result.FILE_NAME).exists()

    async def test_without_a_runtime_directory(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """A daemon run by hand keeps no record: the command signals it and tells what the file says (its
        first error, exit 1; or no error, exit 0 with a note that only the daemon's log knows more)."""
        run = tmp_path / "no-run-dir"
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        good = cfg.read_text()
        async with daemon(cfg) as proc:
            await wait_for_path(plugin_dir / "ate.dev-kvm.sock", timeout=20)
            env = subprocess_env(RUNTIME_DIRECTORY=str(run))
            args = ("reload", "--pid", str(proc.pid), "--config", str(cfg))
            status, _, err = await run_cli(*args, env=env)
            assert status == 0 and err.startswith(f"ate-devplugd: signalled the daemon (pid {proc.pid}) to reload"), err
            cfg.write_text(good + "count = 0\n")
            status, _, err = await run_cli(*args, env=env)
            assert (status, err.startswith("ate-devplugd: config error: device[0] (ate.dev/kvm): count: 0")) == (
                1,
                True,
            ), err
            assert proc.proc is not None and proc.proc.returncode is None
