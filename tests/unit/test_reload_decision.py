"""What refuses a reload, and the lines each refusal gives the journal and the `reload` command."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from ate_devplugd import config as configmod
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.reload.decision import Reason, ReloadRefused, accept

KVM = DeviceConfig("ate.dev/kvm", "/dev/kvm")
TUN = DeviceConfig("ate.dev/tun", "/dev/net/tun", subsystem="misc")


def running(tmp_path: Path, **changes: object) -> Config:
    return dataclasses.replace(Config(plugin_dir=str(tmp_path), dev_root=str(tmp_path), devices=(KVM,)), **changes)


def refusal(old: Config, new: Config | ConfigError) -> ReloadRefused:
    def load() -> Config:
        if isinstance(new, ConfigError):
            raise new
        return new

    with pytest.raises(ReloadRefused) as info:
        accept(old, load)
    return info.value


def test_a_config_that_does_not_load(tmp_path: Path) -> None:
    got = refusal(running(tmp_path), ConfigError(["count: 0 must be an integer", "unknown key 'x'"]))
    assert got.reason is Reason.CONFIG_ERROR and got.first == "count: 0 must be an integer"
    assert got.journal_lines() == [
        "config error, keeping the running config: count: 0 must be an integer",
        "config error, keeping the running config: unknown key 'x'",
    ]
    assert got.message() == "config error: count: 0 must be an integer"


def test_what_check_config_refuses(tmp_path: Path) -> None:
    """The reload loads the file as check-config does (``config.load``): a path that is a directory on
    this host is refused with the file's other errors, in one round."""
    (tmp_path / "dev" / "kvm").mkdir(parents=True)
    path = tmp_path / "c.toml"
    path.write_text(f'dev_root = "{tmp_path}"\nbogus = 1\n[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
    with pytest.raises(ReloadRefused) as info:
        accept(running(tmp_path), lambda: configmod.load(path))
    got = info.value
    assert got.reason is Reason.CONFIG_ERROR
    assert got.lines == (
        "unknown key 'bogus'",
        "device[0] (ate.dev/kvm): path: '/dev/kvm' is a directory; path names a device node, e.g. '/dev/kvm'",
    )


def test_a_restart_only_change_is_one_line_with_no_python_in_it(tmp_path: Path) -> None:
    """The mode's new and running values as TOML; never a Python None."""
    got = refusal(running(tmp_path), running(tmp_path, mode="dra"))
    assert got.reason is Reason.RESTART_ONLY
    assert got.lines == (
        "mode = 'dra' (running: 'device-plugin'): changes only on restart, so nothing of this reload was applied",
    )
    assert got.journal_lines() == list(got.lines)
    assert got.message() == f"reload refused: {got.first}"
    assert "None" not in got.first


def test_dra_mode_keeps_its_set_of_resources(tmp_path: Path) -> None:
    old = running(tmp_path, mode="dra")
    got = refusal(old, dataclasses.replace(old, devices=(KVM, TUN)))
    assert got.reason is Reason.RESTART_ONLY
    assert got.first == (
        "DRA mode's set of resources changes only on restart (adding ate.dev/tun), "
        "so nothing of this reload was applied"
    )


def test_an_added_socket_another_process_serves(tmp_path: Path) -> None:
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(str(tmp_path / "ate.dev-tun.sock"))
        other.listen()
        got = refusal(running(tmp_path), running(tmp_path, devices=(KVM, TUN)))
    finally:
        other.close()
    assert got.reason is Reason.SOCKET_BUSY
    assert got.journal_lines() == [f"{got.first}; keeping the running config"]
    assert got.message() == f"reload refused: {got.first}"


def test_an_acceptable_config_is_returned(tmp_path: Path) -> None:
    new = running(tmp_path, devices=(dataclasses.replace(KVM, count=8), TUN))
    assert accept(running(tmp_path), lambda: new) is new
