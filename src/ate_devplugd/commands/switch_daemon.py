"""``switch-mode``'s view of the daemon: its own record (``reload.record``, found as ``commands.instance``
finds it), followed on its instance lock until it says what a step needs.

Kubelet holds the daemon when its record says so (``unheld`` is None): READY=1 has gone out and every
resource is ``registered`` (device-plugin mode: kubelet holds a registration and watches it; DRA mode: the
driver registered with kubelet and the resource published in the slice), and where a step asks it, the
resource has healthy units. ``until`` follows the record (``announce.follow``: each change is an event)
until the step's ``accept`` takes it; while no daemon holds a lock of the config (stopped, crashed, a
restart under way) it looks again after a back-off. A record never counts for more than it says: the wait
after a restart takes only a daemon started after it (``Restart.after``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ate_devplugd import config as configmod
from ate_devplugd.base import announce
from ate_devplugd.commands.instance import Running
from ate_devplugd.commands.switch_files import SwitchFailed
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.kubelet.lock import InstanceLock
from ate_devplugd.reload import record
from ate_devplugd.reload.record import Instance

#: The first and the longest wait before a lock nobody holds is looked at again (seconds).
FIRST_LOOK = 0.05
LONGEST_LOOK = 1.0


def unheld(instance: Instance, resources: Sequence[str], *, healthy: bool) -> str | None:
    """Why kubelet does not hold the daemon of this record, by the record's own word (None: it does)."""
    who = f"the daemon (pid {instance.pid}, {instance.mode} mode)"
    if not instance.ready:
        return f"{who} is starting: {instance.status}"
    serving = {s.resource: s for s in instance.serving}
    for name in resources:
        served = serving.get(name)
        if served is None:
            return f"{who} does not serve {name}"
        if not served.registered:
            return f"{who}: kubelet does not hold {name} yet: {instance.status}"
        if healthy and served.healthy < 1:
            why = f"withheld: {served.withheld}" if served.withheld else instance.status
            return f"{who}: no unit of {name} is healthy ({why})"
    return None


class Restart(NamedTuple):
    """A restart of the unit: the daemon that ran before it (its pid, 0 for none) and when it was asked for
    (seconds since the epoch)."""

    pid: int
    at: float

    @classmethod
    def now(cls, before: Running | None) -> Restart:
        return cls(before.pid if before is not None else 0, time.time())

    def after(self, instance: Instance) -> bool:
        """Whether the record is of a daemon started after the restart: another pid, or a later start."""
        return self.pid not in (0, instance.pid) or instance.started >= self.at


async def until(
    config: Config,
    accept: Callable[[Running], str | None],
    timeout: float,
    waiting: Callable[[str], None],
    what: str,
) -> Running:
    """The daemon serving ``config`` once ``accept`` takes its record (None); SwitchFailed after ``timeout``
    seconds, with the last reason it gave. ``waiting`` is told each new reason."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    nobody = f"no ate-devplugd serves {InstanceLock.of(config).directory}"
    why = nobody
    said = ""
    delay = FIRST_LOOK

    def heard(reason: str) -> None:
        nonlocal why, said
        why = reason
        if reason != said:
            waiting(reason)
            said = reason

    try:
        async with asyncio.timeout_at(deadline):
            while True:
                followed = False
                for lock in InstanceLock.candidates(config):
                    try:
                        records = announce.follow(lock.name)
                        async with contextlib.aclosing(records):
                            async for peer, line in records:
                                followed = True
                                running = _running(lock.name, peer.pid, line)
                                if running is None:
                                    continue
                                reason = accept(running)
                                if reason is None:
                                    return running
                                heard(reason)
                                delay = FIRST_LOOK
                    except OSError:
                        continue  # nobody holds this one
                # its lock closed (it stopped, or crashed), or none held one: look again after a back-off
                heard("the daemon ended" if followed else nobody)
                await asyncio.sleep(delay)
                delay = min(delay * 2, LONGEST_LOOK)
    except TimeoutError:
        raise SwitchFailed(f"{what}: not within {timeout:g} s: {why}") from None


def _running(name: bytes, pid: int, line: bytes) -> Running | None:
    """A record line as ``commands.instance`` takes it: the kernel's pid must be the record's."""
    instance = record.decode(line)
    if instance is None or instance.pid != pid:
        return None
    try:
        return Running(name, instance, configmod.from_mapping(instance.config))
    except ConfigError:
        return None
