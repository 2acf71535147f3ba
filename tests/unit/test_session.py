"""A session's own waits: a stop is never lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ate_devplugd.deviceplugin.session import Session
from ate_devplugd.kubelet.watch import KubeletWatch
from ate_devplugd.signals.metrics import Metrics
from tests.support import kvm_resource


class TestWait:
    async def test_cancel_in_the_same_turn_as_a_kick(self, tmp_path: Path) -> None:
        """A stop (cancel) landing as kubelet's event wakes the session ends its wait."""
        session = Session(
            kvm_resource(), str(tmp_path / "s.sock"), KubeletWatch(str(tmp_path)), lambda: None, Metrics()
        )
        task = asyncio.get_running_loop().create_task(session._wait(30.0))
        await asyncio.sleep(0)  # the task waits on the kick now
        session._wake()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)
        assert task in done
        assert task.cancelled()
