"""Applying a config, at start and on reload: a plan, then a commit.

``plan`` takes every step that can fail before anything of the running daemon changes. On reload the
re-read config was accepted before it (``reload.decision.accept``: it loads with every check passing, it
changes no restart-only key, each added resource's socket is free); at start the plugin directory is
made (DRA mode's server makes its own) and kubelet's directory watched. Then, its last step, the udev
filter for the new set of subsystems: before any look, so that no change after a look goes unseen; a
filter the kernel refuses leaves the old one in place (``node.udev``).

``commit`` then makes the changes, none of which raises: the log level; the removed resources stop being
served and the metrics hold the new set of resources; the state is read (the container runtime's verdict
on our CDI names, awaited for ``cri.check.FIRST_VERDICT`` at most, so that the first ListAndWatch answer
and the first slice already carry it; CDI's directory; then a look at each device, which writes its CDI
spec and decides whether it is usable). The daemon then serves the added resources (each socket proves
it answers before it registers) and swaps its config last, with its record saying the new one
(``Daemon._serve``), so the two never disagree.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import TYPE_CHECKING, NamedTuple

from ate_devplugd.base.unixserver import SocketInUseError
from ate_devplugd.config import Config, ConfigDiff, diff
from ate_devplugd.kubelet.lock import make_plugin_dir, no_permission
from ate_devplugd.kubelet.watch import KubeletWatch
from ate_devplugd.node.watch import DeviceWatch
from ate_devplugd.signals.metrics import Metrics

if TYPE_CHECKING:
    from ate_devplugd.cri.check import RuntimeCheck
    from ate_devplugd.daemon.modes import Modes


class Plan(NamedTuple):
    """A config ready to be committed over the running one (``old``: None at start)."""

    old: Config | None
    new: Config
    change: ConfigDiff


def plan(old: Config | None, new: Config, kubelet: KubeletWatch, devices: DeviceWatch) -> Plan:
    """Every step of applying ``new`` that can fail; raises before anything of the running daemon changed."""
    if old is None:
        if new.mode != "dra":  # DRA mode's server makes its own directories
            make_plugin_dir(new.plugin_dir)
        kubelet.start()
    devices.watch(new.devices)
    return Plan(old, new, diff(old or Config(devices=()), new))


async def commit(
    plan: Plan, mode: Modes, devices: DeviceWatch, metrics: Metrics, runtime: RuntimeCheck | None = None
) -> None:
    """The changes, in their one order (the config itself is the caller's to swap, last). ``runtime``: the
    container runtime's check, asked for the new config; its verdict is state, heard before the looks."""
    change = plan.change
    logging.getLogger().setLevel(plan.new.log_level.upper())
    await mode.stop(change.removed)
    for name in change.removed:
        metrics.remove_resource(name)
    for name in change.added:
        metrics.add_resource(name)
    if runtime is not None:
        await runtime.first_verdict()
    devices.read(plan.new)


def start_failure(exc: OSError | SocketInUseError) -> tuple[int, str]:
    """The exit status (sysexits) and the line for an error that ends the start, by its cause: another
    process on our socket (73, EX_CANTCREAT), a permission refused (77, EX_NOPERM, with the path: DRA
    mode makes its directories in kubelet's, as root only can), any other error of the system (71,
    EX_OSERR, as it is)."""
    if isinstance(exc, SocketInUseError) or exc.errno == errno.EADDRINUSE:
        return os.EX_CANTCREAT, f"cannot serve: {exc}; is another ate-devplugd running?"
    if exc.errno == errno.EACCES and exc.filename is not None:
        return os.EX_NOPERM, str(no_permission("create", str(exc.filename)))
    if exc.errno in (errno.EACCES, errno.EPERM):
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return os.EX_NOPERM, f"cannot start: {where}{exc.strerror} (uid {os.geteuid()}); ate-devplugd runs as root"
    where = f": {exc.filename}" if exc.filename is not None else ""
    return os.EX_OSERR, f"cannot start: {exc.strerror or exc}{where}"
