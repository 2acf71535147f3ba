"""`ate-devplugd reload` (the unit's ExecReload): it signals the daemon and waits for the daemon's verdict
on that reload, so every refusal fails it with the reason on stderr.

The command runs as a real subprocess; the daemon runs on the test's loop (the command's SIGHUP reaches
it through the loop's signal handler, as in the real process) or as a real subprocess of its own. It
finds the daemon by ``$MAINPID`` or by the config it serves, and waits for the verdict in the record the
daemon announces on its instance lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from pathlib import Path

from ate_devplugd import config as configmod
from ate_devplugd.commands import instance
from ate_devplugd.config import Config
from ate_devplugd.reload.result import Outcome, Result
from tests.support import (
    FakeKernel,
    daemon,
    daemon_in_process,
    kvm_config,
    record_of,
    run_cli,
    subprocess_env,
    wait_for_path,
    write_config,
)

#: What applies a new mode: never a restart (it loses the pods arriving meanwhile).
SWITCH_MODE_LINE = (
    "ate-devplugd: a new mode is applied by `ate-devplugd switch-mode dra` (it cordons the node for the restart, "
    "so no arriving pod is lost), not by a reload or a plain restart\n"
)
RESTART_ONLY_LINE = (
    "ate-devplugd: reload refused: mode = 'dra' (running: 'device-plugin'): changes only on restart, "
    "so nothing of this reload was applied\n" + SWITCH_MODE_LINE
)
#: The same change in a file: DRA mode's [dra] table comes with it (its defaults).
RESTART_ONLY_FILE_LINE = (
    "ate-devplugd: reload refused: mode = 'dra' (running: 'device-plugin'), [dra] added: change only on "
    "restart, so nothing of this reload was applied\n" + SWITCH_MODE_LINE
)


async def reload_in_process(
    tmp_path: Path, kernel: FakeKernel, config: Config, new: Config | Path, *, journal: bool = False
) -> tuple[int, str]:
    """The daemon on this loop runs ``config``; ``ate-devplugd reload`` (with ``$MAINPID``, as the unit runs
    it) makes it reload ``new`` (a config, or a file to load): the command's exit status and stderr (with
    ``journal``, a file that ``$JOURNAL_STREAM`` names, as systemd gives ExecReload= the journal)."""

    def reload_config() -> Config:
        return configmod.load(new) if isinstance(new, Path) else new

    async with daemon_in_process(config, kernel, reload_config=reload_config) as running:
        await running.events.wait_for("ready")
        started = await record_of(config)
        assert started is not None and (started.pid, started.record.reload) == (os.getpid(), Result(0, Outcome.STARTED))
        env = subprocess_env(MAINPID=str(os.getpid()))
        if journal:
            status, out, err = await run_with_journal(tmp_path / "journal", env)
        else:
            status, out, err = await run_cli("reload", "--timeout", "20", env=env)
        assert out == ""
        after = await record_of(config)
        assert after is not None and after.record.reload.generation == 1, after
        assert after.record.reload.outcome is (Outcome.APPLIED if status == 0 else Outcome.REFUSED), (after, err)
    assert await record_of(config) is None, "the record outlived the daemon"
    return status, err


#: A process that holds an instance lock and announces a record, as a daemon would, and ends on SIGHUP
#: without a verdict (argv: the lock's directory).
ENDS_ON_SIGHUP = """
import asyncio, signal, socket, sys, time
from ate_devplugd import __version__
from ate_devplugd.base.announce import Announcer
from ate_devplugd.config import Config, values
from ate_devplugd.kubelet.lock import lock_name
from ate_devplugd.reload import record
from ate_devplugd.reload.result import Outcome, Result
import os

async def main():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    sock.bind(lock_name(sys.argv[1]))
    sock.listen(8)
    cfg = Config(plugin_dir=sys.argv[1])
    rec = record.Instance(os.getpid(), __version__, "device-plugin", time.time(), "", {}, values(cfg), True, "", (),
                          Result(0, Outcome.STARTED))
    Announcer(sock, lambda: record.encode(rec))
    hup = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hup.set)
    print("ready", flush=True)
    await hup.wait()

asyncio.run(main())
"""


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

    def test_a_reload_running_when_signalled_is_not_the_verdict(self) -> None:
        """The result read before the signal is of a reload already running (or ended): its end is not this
        reload's verdict; the end of the next one is."""
        running = Result(3, Outcome.RELOADING)
        assert not Result(3, Outcome.APPLIED).ended_after(running.generation)
        assert not Result(4, Outcome.RELOADING).ended_after(running.generation)
        assert Result(4, Outcome.REFUSED, "reload refused: why").ended_after(running.generation)


class TestNoDaemon:
    async def test_a_pid_that_runs_nothing(self) -> None:
        """A pid no process has: a clear line, exit 1."""
        gone = await asyncio.create_subprocess_exec("true")
        await gone.wait()
        status, _, err = await run_cli("reload", "--pid", str(gone.pid))
        assert (status, err) == (1, f"ate-devplugd: no daemon to reload: no process {gone.pid} is running\n")

    async def test_no_pid_and_no_daemon(self, tmp_path: Path, plugin_dir: Path, fake_root: Path) -> None:
        """Neither $MAINPID nor a daemon serving the config: it says so and how to name one, exit 1."""
        cfg = write_config(tmp_path / "c.toml", plugin_dir, fake_root)
        status, _, err = await run_cli("reload", "--config", str(cfg))
        assert status == 1
        assert err.startswith(f"ate-devplugd: no running daemon to reload: no ate-devplugd serves {plugin_dir}"), err
        assert err.endswith("; give --pid, or use systemctl reload\n"), err

    async def test_the_daemon_ends_before_its_verdict(self, tmp_path: Path) -> None:
        """A daemon that takes SIGHUP and ends: the wait ends with it (its record's socket closes), not at
        the timeout."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ENDS_ON_SIGHUP, str(tmp_path), stdout=asyncio.subprocess.PIPE, env=subprocess_env()
        )
        try:
            assert proc.stdout is not None
            async with asyncio.timeout(20):
                assert await proc.stdout.readline() == b"ready\n"
                status, _, err = await run_cli("reload", "--timeout", "60", env=subprocess_env(MAINPID=str(proc.pid)))
            assert (status, err) == (
                1,
                f"ate-devplugd: the daemon (pid {proc.pid}) ended before it said how the reload went\n",
            )
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
            await proc.wait()

    async def test_a_process_that_announces_no_record(self, tmp_path: Path, plugin_dir: Path, fake_root: Path) -> None:
        """``--pid`` of a process that is no ate-devplugd of ours (it announces no record): it is signalled
        all the same, and the command tells what the file says (its first error, exit 1; or no error,
        exit 0 with a note that only its log knows more)."""
        cfg = write_config(tmp_path / "c.toml", plugin_dir, fake_root)
        ignoring = (
            "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
        )
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", ignoring, stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            await proc.stdout.readline()
            args = ("reload", "--pid", str(proc.pid), "--config", str(cfg))
            status, _, err = await run_cli(*args)
            assert status == 0 and err.startswith(f"ate-devplugd: signalled process {proc.pid} to reload"), err
            cfg.write_text(cfg.read_text() + "count = 0\n")
            status, _, err = await run_cli(*args)
            assert status == 1 and err.startswith("ate-devplugd: config error: device[0] (ate.dev/kvm): count: 0"), err
            assert proc.returncode is None
        finally:
            proc.kill()
            await proc.wait()


class TestRealDaemon:
    async def test_by_pid_and_by_config(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """The daemon as a process (by the unit, or by hand: the same): a good reload exits 0, a mode change 1
        with its line, and the daemon keeps running the config it had; found by ``$MAINPID`` or by the config
        it serves."""
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        good = cfg.read_text()
        async with daemon(cfg) as proc:
            await wait_for_path(plugin_dir / "ate.dev-kvm.sock", timeout=20)
            env = subprocess_env(MAINPID=str(proc.pid))
            cfg.write_text(good.replace('path = "/dev/kvm"\n', 'path = "/dev/kvm"\ncount = 8\n'))
            status, _, err = await run_cli("reload", env=env)
            assert (status, err) == (0, ""), proc.log()
            # run's --log-level debug over the file's default is the daemon's reading of the file, no difference
            applied = await instance.find(cfg)
            assert applied.running is not None and applied.running.config.log_level == "debug"
            assert applied.differences == (), applied.differences
            cfg.write_text('mode = "dra"\n' + good)
            status, _, err = await run_cli("reload", "--config", str(cfg))
            assert (status, err) == (1, RESTART_ONLY_FILE_LINE), proc.log()
            found = await instance.find(cfg)
            assert found.running is not None and found.running.pid == proc.pid
            assert found.running.config.mode == "device-plugin" and found.running.config.devices[0].count == 8
            assert proc.proc is not None and proc.proc.returncode is None
            assert await proc.stop() == 0
        assert (await instance.find(cfg)).running is None
