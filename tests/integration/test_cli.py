"""The command line as a newcomer meets it: the real ``ate-devplugd`` as a subprocess, its words checked.

Usage errors exit 2 (argparse's convention), config errors 78; values in config errors are written as
in TOML; ``check-config`` says what the config means on this host (a directory for a device path, the
cost of a large ``count``, the default device served when no table is given).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import NotifyReceiver, daemon, run_cli, subprocess_env

COMMANDS = ("run", "check-config", "probe", "doctor", "dra-manifests", "reload", "switch-mode")
EX_USAGE = 2
EX_CONFIG = 78
KVM = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'


def config_file(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    """A config on the test's own directories: nothing of the host is read for devices."""
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text(f'dev_root = "{root}"\nplugin_dir = "{tmp_path / "plugins"}"\nmetrics_file = ""\n' + text)
    return path


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ate-devplugd: config error: ")]


# -- commands ----------------------------------------------------------------------------------------
async def test_unknown_command_says_so_and_names_the_commands() -> None:
    """``ate-devplugd bogus`` is an unknown command (not argparse's "unrecognized arguments"), and the
    message lists every command."""
    status, out, err = await run_cli("bogus")
    assert status == EX_USAGE, err
    assert out == ""
    assert "unknown command 'bogus'" in err and "unrecognized arguments" not in err, err
    for name in COMMANDS:
        assert name in err, (name, err)


async def test_config_may_come_before_or_after_the_command(tmp_path: Path) -> None:
    """``--config X check-config`` is ``check-config --config X`` (and ``--config=X``), reading X."""
    cfg = config_file(tmp_path, KVM + "count = 7\n")
    results = [
        await run_cli("--config", str(cfg), "check-config"),
        await run_cli("check-config", "--config", str(cfg)),
        await run_cli(f"--config={cfg}", "check-config"),
    ]
    for status, out, err in results:
        assert status == 0, err
        assert "count = 7" in out, out
    assert len({out for _, out, _ in results}) == 1


async def test_options_alone_still_mean_run(tmp_path: Path) -> None:
    """Options without a command are the daemon's (``run`` is the default): a bad file stops it at 78."""
    cfg = config_file(tmp_path, KVM + "count = 0\n")
    status, _, err = await run_cli("--config", str(cfg), "--log-target", "console")
    assert status == EX_CONFIG, err
    assert "count: 0 must be an integer" in err
    assert not (tmp_path / "plugins").exists()


async def test_help_lists_each_command_once_with_its_line() -> None:
    """``--help`` lists the commands once, each on one line with what it does; each command's own help
    starts with that line."""
    status, out, _ = await run_cli("--help")
    assert status == 0
    lines = out.splitlines()
    for name in COMMANDS:
        listed = [line for line in lines if line.split()[:1] == [name]]
        assert len(listed) == 1, (name, out)
        assert len(listed[0].split()) > 3, listed  # the name and what the command does
    assert "{run," not in out  # argparse's own list of choices
    for name in COMMANDS:
        status, own, _ = await run_cli(name, "--help")
        assert status == 0
        description = own.split("\n\n")[1].replace("\n", " ")
        line = next(line for line in lines if line.split()[:1] == [name])
        assert description == line.split(maxsplit=1)[1], (description, line)


async def test_switch_mode_needs_the_dra_table(tmp_path: Path) -> None:
    """``switch-mode`` without a ``[dra]`` table (no node name, no credentials) is a config error, 78,
    before anything changes; a mode it does not know is a usage error."""
    cfg = config_file(tmp_path, KVM)
    before = cfg.read_text()
    status, _, err = await run_cli("switch-mode", "dra", "--config", str(cfg), "--systemctl", "/bin/false")
    assert status == EX_CONFIG, err
    assert "dra: switch-mode needs the [dra] table" in err
    assert cfg.read_text() == before
    status, _, err = await run_cli("switch-mode", "both", "--config", str(cfg))
    assert status == EX_USAGE and "invalid choice: 'both'" in err, err


async def test_probe_timeout_has_a_default_and_must_be_positive(tmp_path: Path) -> None:
    """``probe --help`` shows the timeout's default; 0, a negative or a non-finite number is refused
    with a clear message before anything is probed."""
    status, out, _ = await run_cli("probe", "--help")
    assert status == 0
    assert "(default 5)" in " ".join(out.split()), out
    for bad in ("0", "-1", "nan", "inf", "soon"):
        status, out, err = await run_cli("probe", "--timeout", bad, "--plugin-dir", str(tmp_path))
        assert status == EX_USAGE, (bad, err)
        assert out == ""
        assert f"--timeout: must be a number of seconds above 0, e.g. 5, not {bad}" in err, err


# -- config errors as TOML ----------------------------------------------------------------------------
async def test_config_errors_show_values_as_written_in_toml(tmp_path: Path) -> None:
    """Booleans, octal modes, tables and arrays appear in TOML form, never as Python."""
    cfg = config_file(
        tmp_path,
        'log_level = ["debug"]\ndra = [{driver = "x"}]\n'
        + KVM
        + "count = true\ncdi = true\ncontainer_mode = 0o1777\ncontainer_uid = 1.5\n",
    )
    status, out, err = await run_cli("check-config", "--config", str(cfg))
    assert status == EX_CONFIG and out == "", err
    for fragment in (
        "count: true must be an integer",
        "container_mode: 0o1777 must be a file mode",
        "container_uid: 1.5 must be a uid",
        "dra: must be a table, not [{driver = 'x'}]",
        "log_level: must be one of debug, info, warning, error, not ['debug']",
    ):
        assert fragment in err, (fragment, err)
    for python in ("True", "1023", "None", "{'", "[{'"):
        assert python not in err, (python, err)


async def test_unreadable_file_is_named_once(tmp_path: Path) -> None:
    """A missing file: ``cannot read <path>: No such file or directory``, the path once, no errno."""
    missing = tmp_path / "nope.toml"
    status, out, err = await run_cli("check-config", "--config", str(missing))
    assert status == EX_CONFIG and out == ""
    assert err == f"ate-devplugd: config error: cannot read {missing}: No such file or directory\n", err


async def test_one_duplicate_device_is_one_error_line(tmp_path: Path) -> None:
    """A ``[[device]]`` table given twice (same resource, path and so socket) is one line, not three."""
    cfg = config_file(tmp_path, KVM + KVM)
    status, _, err = await run_cli("check-config", "--config", str(cfg))
    assert status == EX_CONFIG
    assert error_lines(err) == [
        "ate-devplugd: config error: device[1] (ate.dev/kvm): resource 'ate.dev/kvm' and path '/dev/kvm' "
        "are already used by device[0] (ate.dev/kvm)"
    ], err


# -- what check-config says of the host -----------------------------------------------------------------
async def test_device_path_that_is_a_directory_fails_check_config(tmp_path: Path) -> None:
    """``path = "/dev/shm"`` (a directory) fails check-config with 78 and says why."""
    cfg = config_file(tmp_path, '[[device]]\nresource = "ate.dev/shm"\npath = "/dev/shm"\n')
    (tmp_path / "root" / "dev" / "shm").mkdir()
    status, out, err = await run_cli("check-config", "--config", str(cfg))
    assert status == EX_CONFIG and out == "", err
    assert error_lines(err) == [
        "ate-devplugd: config error: device[0] (ate.dev/shm): path: '/dev/shm' is a directory; "
        "path names a device node, e.g. '/dev/kvm'"
    ], err


async def test_no_device_table_says_the_default_is_served(tmp_path: Path) -> None:
    """A file without ``[[device]]`` serves the default device, and check-config says so on stderr
    (stdout stays the effective config); a file with a table gets no such line."""
    cfg = config_file(tmp_path, "")
    status, out, err = await run_cli("check-config", "--config", str(cfg))
    assert status == 0, err
    assert err == "ate-devplugd: note: no [[device]] table: serving the default ate.dev/kvm -> /dev/kvm\n", err
    assert 'resource = "ate.dev/kvm"' in out
    status, _, err = await run_cli("check-config", "--config", str(config_file(tmp_path, KVM, "kvm.toml")))
    assert status == 0 and err == "", err


async def test_large_count_warns_of_its_cost_and_still_passes(tmp_path: Path) -> None:
    """Above 16384 units check-config warns what they cost kubelet; exit 0. At 16384 it says nothing."""
    status, out, err = await run_cli("check-config", "--config", str(config_file(tmp_path, KVM + "count = 16385\n")))
    assert status == 0, err
    assert "count = 16385" in out
    (line,) = err.splitlines()
    assert line.startswith("ate-devplugd: config warning: device[0] (ate.dev/kvm): count: 16385 units cost kubelet")
    assert "3.3 MiB" in line, line  # 214 B a unit
    status, _, err = await run_cli("check-config", "--config", str(config_file(tmp_path, KVM + "count = 16384\n")))
    assert status == 0 and err == "", err


DRA_TABLE = '[dra]\nnode_name = "node-1"\n'


async def test_a_dra_table_in_device_plugin_mode_is_a_note(tmp_path: Path) -> None:
    """A ``[dra]`` table without ``mode = "dra"`` (a node that switch-mode moves): check-config notes what it
    does in device-plugin mode (exit 0), and that a reload refuses a change to it; the daemon warns of
    nothing at start."""
    cfg = config_file(tmp_path, KVM + DRA_TABLE)
    status, _, err = await run_cli("check-config", "--config", str(cfg))
    assert status == 0, err
    (line,) = err.splitlines()
    assert line.startswith("ate-devplugd: note: [dra]: in device-plugin mode it serves DRA unprepare only"), line
    assert "a reload refuses any change to it" in line
    notify = NotifyReceiver(tmp_path / "notify")
    try:
        async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
            await notify.wait_for(lambda f: "READY" in f, timeout=30)
            assert await proc.stop() == 0
            assert "config warning" not in proc.log(), proc.log()
    finally:
        await notify.close()


# -- what each command loads -------------------------------------------------------------------------
#: ``run`` until READY=1, then the modules loaded so far on stdout (and the process ended there).
RUN_UNTIL_READY = """
import os, sys
from ate_devplugd import cli
from ate_devplugd.signals import notify

def ready(self, status):
    loaded = sorted(sys.modules)
    import json
    print(json.dumps(loaded), flush=True)
    os._exit(0)

notify.Notifier.ready = ready
cli.main(["run", "--config", sys.argv[1], "--log-target", "console"])
sys.exit("run returned before READY")
"""
#: DRA mode's modules and libraries, and argparse (the unit's `run` line is read without it); with CDI
#: off, nothing of the container runtime (``cri/``, its generated code) nor json (CDI's specs); with
#: metrics off, the text format.
NOT_IN_DEVICE_PLUGIN_RUN = ("ate_devplugd.dra", "ate_devplugd.config.dra", "aiohttp", "yaml", "argparse")
NOT_WHILE_OFF = ("ate_devplugd.cri", "ate_devplugd._pb.cri", "ate_devplugd.signals.promtext", "json")


def test_device_plugin_run_loads_nothing_of_dra_mode_nor_of_what_is_off(tmp_path: Path) -> None:
    """Device-plugin mode's ``run`` (CDI and metrics off) reaches READY without DRA mode's modules,
    aiohttp or PyYAML, and without the runtime check's modules or the metrics' text format; with both on,
    still nothing of DRA mode before READY."""
    for name, text in (("off", KVM), ("on", KVM + "cdi = true\n")):
        cfg = config_file(tmp_path, text, f"{name}.toml")
        if name == "on":
            cfg.write_text(cfg.read_text().replace('metrics_file = ""', f'metrics_file = "{tmp_path / "m.prom"}"'))
            cfg.write_text(f'cdi_dir = "{tmp_path / "cdi"}"\n' + cfg.read_text())
        done = subprocess.run(
            [sys.executable, "-c", RUN_UNTIL_READY, str(cfg)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        modules = json.loads(done.stdout)
        assert "ate_devplugd.daemon" in modules and "grpc" in modules, modules
        unwanted = NOT_IN_DEVICE_PLUGIN_RUN + (NOT_WHILE_OFF if name == "off" else ())
        loaded = [m for m in modules if any(m == u or m.startswith(u + ".") for u in unwanted)]
        assert loaded == [], (name, loaded)
