"""The handover guard: a handover (``reload --handover``, an upgrade's) inside switch-mode's cordon, the
mode kept, so that no pod reaches kubelet while no unit is healthy. ``reload --guard``, or
``handover_guard = true`` in the config, which guards every handover, the package upgrade's too.

The run is ``switch_move``'s toward the mode the node is in: kubelet holds the daemon; the Node cordoned
(``spec.unschedulable``, our annotations beside it); every pod bound here that asks our resources admitted,
held for the settle; then the handover (``commands.handover``); then the successor's own record that
kubelet holds it, kubelet's word and the Node read after it; the cordon lifted. A handover the daemon
refuses changes nothing: the cordon is lifted and the command fails, saying why. Any other end keeps the
cordon and says where the node stands; ``switch-mode <mode>`` finishes it.

What it costs: the node takes no new pod of any kind while the cordon lasts (the settle, then the
handover and kubelet's word: seconds), and it needs credentials that may patch the Node (the ``[dra]``
table's kubeconfig, kubelet's own by default). So it is off by default: an unguarded handover loses only a
pod that kubelet admits in its window of tens of milliseconds (docs/performance.md).
"""

from __future__ import annotations

import signal

from ate_devplugd.commands import instance, switch
from ate_devplugd.commands.handover import hand_over_said
from ate_devplugd.commands.switch_files import Host, NothingChanged, SwitchFailed
from ate_devplugd.commands.switch_move import Timing
from ate_devplugd.config import Config

SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def guarded(config: Config, host: Host, timing: Timing, timeout: float, *, signals: bool = True) -> int:
    """The guarded handover of the daemon serving ``config`` (the handover itself within ``timeout``
    seconds); its exit status as ``switch-mode``'s: 0, 1, or 128 + a signal of ``SIGNALS``."""

    async def step(running: instance.Running | None) -> str:
        if running is None:
            raise SwitchFailed("no daemon serves the config any more: nothing to hand over")
        said = await hand_over_said(running, timeout)
        if said.done:
            return said.line
        raise NothingChanged(said.line) if said.serving_on else SwitchFailed(said.line)

    return await switch.switch_mode(
        config.mode, config, host, timing, signals=SIGNALS if signals else (), handover=step
    )
