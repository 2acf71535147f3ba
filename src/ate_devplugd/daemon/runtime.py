"""The container runtime in the daemon: asked whether it applies our CDI names (``cri.check``), and what
its verdict makes usable (``cri.usable``); both made the first time a config uses CDI, so a node without
CDI loads nothing of ``cri/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ate_devplugd.config import Config
from ate_devplugd.node.devices import Resource
from ate_devplugd.node.watch import DeviceWatch

if TYPE_CHECKING:
    from ate_devplugd.cri.check import RuntimeCheck
    from ate_devplugd.cri.facts import RuntimeReport
    from ate_devplugd.cri.usable import Usability

#: What the daemon holds now: the devices it follows and the config it runs.
State = Callable[[], tuple["DeviceWatch | None", Config]]


class RuntimeLink:
    """The runtime's check and the usability it decides. ``on_change(resource, event)`` hears a resource
    whose withholding changed, ``on_verdict(verdict, runtime)`` the verdict for the metric, ``on_report``
    each answer of the runtime (STATUS follows)."""

    def __init__(
        self,
        state: State,
        on_change: Callable[[Resource, str | None], None],
        on_verdict: Callable[[str | None, str], None],
        on_report: Callable[[], None],
    ) -> None:
        self._state = state
        self._on_change = on_change
        self._on_verdict = on_verdict
        self._on_report = on_report
        self._check: RuntimeCheck | None = None
        self._usable: Usability | None = None

    def ask(self, config: Config | None = None) -> RuntimeCheck | None:
        """Ask whether the runtime applies our CDI names under ``config`` (the one running by default): at
        start and on reload before the looks, when kubelet starts; the check follows the runtime's own
        restarts by itself. The check, whose first verdict a start awaits (bounded); None while no config
        uses CDI."""
        cfg = config or self._state()[1]
        if self._check is None:
            if not cfg.checks_runtime:
                return None
            from ate_devplugd.cri.check import RuntimeCheck  # noqa: PLC0415 - the CRI modules only once CDI is used
            from ate_devplugd.cri.usable import Usability  # noqa: PLC0415

            self._check = RuntimeCheck(self._reported)
            self._usable = Usability(self._on_change, self._on_verdict)
        self._check.start(
            socket=cfg.runtime_socket,
            cdi_dir=cfg.cdi_dir,
            mode=cfg.mode,
            enabled=cfg.checks_runtime,
            devices=cfg.devices,
        )
        return self._check

    def decide(self) -> None:
        """Decide again whether each device is usable (after a look at one, or a change of its withholding)."""
        if self._check is not None and self._usable is not None:
            devices, cfg = self._state()
            self._usable.update(devices, cfg, self._check.report, self._check.spec_problems)

    def _reported(self, report: RuntimeReport | None) -> None:
        assert self._check is not None and self._usable is not None
        devices, cfg = self._state()
        self._usable.update(devices, cfg, report, self._check.spec_problems)
        self._on_report()

    def status_parts(self) -> list[str]:
        """STATUS's parts of what the runtime does with CDI names, once it has been asked."""
        return self._check.status_parts() if self._check is not None else []

    async def close(self) -> None:
        if self._check is not None and self._usable is not None:
            await self._check.close()
            self._usable.close()
