"""``switch-mode``'s host side: the config's mode line (every other byte kept), the drop-in linked and removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ate_devplugd.commands import switch_files
from ate_devplugd.commands.instance import Found, Running
from ate_devplugd.commands.switch_files import HostFiles, with_mode
from ate_devplugd.config import ConfigError, parse, values
from ate_devplugd.reload.record import Instance
from ate_devplugd.reload.result import Outcome, Result

ADDED = switch_files.ADDED


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        (
            'mode = "dra"  # moved on Monday\n[dra]\n',
            "device-plugin",
            'mode = "device-plugin"  # moved on Monday\n[dra]\n',
        ),
        (
            "# c\nlog_level = 'info'\n\n[dra]\nnode_name = 'a'\n",
            "dra",
            f"# c\nlog_level = 'info'\n\nmode = \"dra\"{ADDED}\n\n[dra]\nnode_name = 'a'\n",
        ),
        (  # above the comment lines of the first table, which stay with it
            "log_level = 'info'\n\n# the devices\n# one table each\n[[device]]\n",
            "dra",
            f"log_level = 'info'\n\nmode = \"dra\"{ADDED}\n\n# the devices\n# one table each\n[[device]]\n",
        ),
        ("log_level = 'info'", "dra", f"log_level = 'info'\nmode = \"dra\"{ADDED}\n"),
        ("", "dra", f'mode = "dra"{ADDED}\n'),
        ("  mode='device-plugin'\n", "dra", 'mode = "dra"\n'),
        ("log_level = 'info'\n", "device-plugin", "log_level = 'info'\n"),  # the default: nothing added
        (f'mode = "dra"{ADDED}\n\n[dra]\n', "device-plugin", "[dra]\n"),  # the line it added goes
    ],
)
def test_with_mode_changes_the_mode_line_only(text: str, mode: str, expected: str) -> None:
    assert with_mode(text, mode) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "log_level = 'info'\n",
        "# c\nlog_level = 'info'\n\n# Each [[device]] table\n[[device]]\nresource = 'ate.dev/kvm'\n\n[dra]\n",
        'mode = "device-plugin"\n[dra]\n',
        'mode = "device-plugin"  # mine\n',
    ],
)
def test_there_and_back_leaves_the_file_as_it_was(text: str) -> None:
    """(An operator's own mode line is kept, in the spelling ``mode = "..."``; a file without a last newline
    keeps the one added before the line.)"""
    there = with_mode(text, "dra")
    assert there != text and with_mode(there, "dra") == there
    assert with_mode(there, "device-plugin") == text


def test_write_mode_refuses_a_config_check_config_refuses(tmp_path: Path) -> None:
    """Nothing is written when the result would not pass check-config (here: DRA mode without [dra])."""
    config = tmp_path / "config.toml"
    config.write_text("log_level = 'nonsense'\n")
    with pytest.raises(ConfigError):
        switch_files.write_mode(HostFiles(str(config)), "dra")
    assert config.read_text() == "log_level = 'nonsense'\n"


def test_write_mode_keeps_the_file_mode_and_says_whether_it_changed(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[dra]\nnode_name = "node-1"\n')
    config.chmod(0o640)
    files = HostFiles(str(config))
    changed, cfg = switch_files.write_mode(files, "dra")
    assert changed and cfg.mode == "dra" and config.stat().st_mode & 0o777 == 0o640
    assert switch_files.write_mode(files, "dra")[0] is False


def test_dropin_linked_then_removed_leaves_nothing(tmp_path: Path) -> None:
    source = tmp_path / "dra-mode.conf"
    source.write_text("[Service]\n")
    files = HostFiles(str(tmp_path / "config.toml"), str(tmp_path / "ate-devplugd.service.d"), str(source))
    assert switch_files.link_dropin(files) and not switch_files.link_dropin(files)
    assert Path(files.dropin).resolve() == source
    assert switch_files.remove_dropin(files) and not switch_files.remove_dropin(files)
    assert not (tmp_path / "ate-devplugd.service.d").exists()


def running_in(mode: str) -> Running:
    """A daemon's record as it announces it, running ``mode``."""
    cfg = parse(f'mode = "{mode}"\n')
    result = Result(0, Outcome.STARTED)
    record = Instance(4242, "0", mode, 0.0, "/etc/c.toml", {}, values(cfg), True, "", (), result)
    return Running(b"\0ate-devplugd/x", record, cfg)


async def test_doctor_says_a_node_is_half_way() -> None:
    """The file's mode against the mode of the daemon that serves it (its record, not its config read back
    from a file: the two differ exactly when a node is half-way): a WARN with the ways on."""
    from ate_devplugd.commands.doctor import switch as doctor_switch
    from ate_devplugd.commands.findings import Level

    file = parse('mode = "dra"\n')
    nowhere = "/nonexistent/ate-devplugd.service.d"
    (found,) = await doctor_switch.findings(Found(file, (), running_in("device-plugin")), 1.0, nowhere)
    assert found.level is Level.WARN and "half-way" in found.message
    assert "finish with `ate-devplugd switch-mode dra`" in found.remedy
    assert "go back with `ate-devplugd switch-mode device-plugin`" in found.remedy
    (found,) = await doctor_switch.findings(Found(file, (), running_in("dra")), 1.0, nowhere)
    assert found.level is Level.OK
    assert await doctor_switch.findings(Found(parse(""), (), None), 1.0, nowhere) == []
