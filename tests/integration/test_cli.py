"""The command line as a newcomer meets it: the real ``ate-devplugd`` as a subprocess, its words checked.

Usage errors exit 2 (argparse's convention), config errors 78; values in config errors are written as
in TOML; ``check-config`` says what the config means on this host (a directory for a device path, the
cost of a large ``count``, the default device served when no table is given).
"""

from __future__ import annotations

from pathlib import Path

from tests.support import run_cli

COMMANDS = ("run", "check-config", "probe", "doctor", "dra-manifests")
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
