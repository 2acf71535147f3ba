"""A handover (``ate-devplugd reload --handover``; an upgrade's): the running daemon starts its successor, which
takes the node over once it is ready, under a service manager that follows the main process as systemd does
(``tests/fakes/servicemanager.py``: ``NotifyAccess=main``, ``MAINPID=``, the service's processes killed when
the main one ends), with pods arriving through the fake kubelet's admission all along.

What must hold: kubelet sees the old stream end, then one Register and the same units (never the new client
first: kubelet would disconnect it); systemd follows the successor before the predecessor exits (0); no pod
fails but in the window (none is cut off in flight by the stream's end); a successor that cannot take over
leaves the predecessor serving, and the command says why.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from ate_devplugd.commands import reload as reload_command
from tests.integration.dra_rig import short_dir
from tests.managed import Arrivals, service
from tests.support import RESOURCE, run_cli, started_kubelet, write_config

COUNT = 64


async def test_handover_takes_the_node_over(dev_root: Path) -> None:
    """The successor takes the node over: kubelet sees the old stream end, then one Register and the same
    units; the manager follows MAINPID to the successor, which says READY; the predecessor exits 0; the
    pods that fail are only those of the window with no healthy unit, none cut off in flight."""
    async with short_dir() as base:
        plugin_dir = base / "device-plugins"
        plugin_dir.mkdir()
        config = write_config(
            base / "c.toml",
            plugin_dir,
            dev_root,
            f'[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\ncount = {COUNT}\n',
        )
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with service(config, base) as svc:
                await svc.ready()
                first = await kubelet.next_event("list", resource=RESOURCE, timeout=60)
                old = svc.main
                kubelet.drain()
                pods = Arrivals(kubelet, rate=50)
                pods.start()
                began = time.monotonic()
                status, _, err = await run_cli("reload", "--handover", "--config", str(config))
                took = time.monotonic() - began
                failed = await pods.stop()
                assert status == 0, err
                assert f"ate-devplugd: handed over from pid {old} " in err, err
                new = (await svc.next("main", timeout=5)).get("pid")
                assert new == svc.main != old
                exited = await svc.next("exit", timeout=30, pid=old)
                assert exited["status"] == 0
                events = [e for e in kubelet.drain() if e.resource == RESOURCE]
                kinds = [e.kind for e in events]
                assert kinds.count("register") == 1, kinds
                assert kinds.index("stream-ended") < kinds.index("register"), kinds
                listed = next(e for e in events if e.kind == "list" and e.t > events[kinds.index("register")].t)
                assert (listed.healthy, listed.ids) == (COUNT, first.ids)
                window = listed.t - events[kinds.index("stream-ended")].t
                refused = [e for e in svc.history if e["event"] == "refused"]
                assert not [e for e in refused if "MAINPID" in e["fields"]], refused
                print(
                    f"handover: {len(pods.outcomes)} pods at 50/s, {len(failed)} failed; window "
                    f"{window * 1000:.1f} ms (stream end -> healthy again), the command {took:.2f} s"
                )
                # A call that reached the old server was answered: none cut off (CANCELLED) by the stream's end;
                # a call kubelet sent after the old server stopped taking any is the window's, as is one
                # kubelet refuses with no healthy unit.
                cut = [f for f in failed if "CANCELLED" in f]
                assert not cut, cut
                # The successor is the service now: a reload is its, and a stop ends it.
                status, _, err = await run_cli("reload", "--config", str(config))
                assert status == 0, err
        finally:
            await kubelet.stop()


async def test_a_successor_that_cannot_start_leaves_the_daemon_serving(dev_root: Path) -> None:
    """The file broken before the handover: the successor exits 78 before it is ready, the daemon serves
    on (its stream never ends, it stays the main process), and the command fails with the reason."""
    async with short_dir() as base:
        plugin_dir = base / "device-plugins"
        plugin_dir.mkdir()
        config = write_config(base / "c.toml", plugin_dir, dev_root)
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with service(config, base) as svc:
                await svc.ready()
                await kubelet.next_event("list", resource=RESOURCE, timeout=60)
                old = svc.main
                kubelet.drain()
                config.write_text(config.read_text() + "count = 0\n")
                status, _, err = await run_cli("reload", "--handover", "--config", str(config))
                assert status == 1, err
                assert "handover failed: the new process (pid " in err, err
                assert "exited 78 before it was ready: config error: device[0] (ate.dev/kvm): count: 0" in err, err
                assert f"the daemon (pid {old}, " in err and "serves on" in err, err
                assert svc.main == old and svc.proc.returncode is None
                assert [e.kind for e in kubelet.drain() if e.kind in ("stream-ended", "register")] == []
                assert await kubelet.admit(RESOURCE) == ""
        finally:
            await kubelet.stop()


async def test_no_record_cannot_hand_over(tmp_path: Path) -> None:
    """``--handover --pid`` of a process that announces no record: exit 69 (restart it instead)."""
    proc = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        status, _, err = await run_cli("reload", "--handover", "--pid", str(proc.pid))
        assert status == os.EX_UNAVAILABLE, err
        assert "cannot hand over" in err
    finally:
        proc.kill()
        await proc.wait()


async def test_a_reload_of_another_version_hands_over(
    dev_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``reload`` (what ``systemctl reload`` runs) of a daemon whose version is not the program's on disk
    (the package was upgraded under it) hands over instead of re-reading the config."""
    async with short_dir() as base:
        plugin_dir = base / "device-plugins"
        plugin_dir.mkdir()
        config = write_config(base / "c.toml", plugin_dir, dev_root)
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with service(config, base) as svc:
                await svc.ready()
                await kubelet.next_event("list", resource=RESOURCE, timeout=60)
                old = svc.main
                monkeypatch.setattr(reload_command, "__version__", "0.0.0+on-disk")
                status = await asyncio.to_thread(reload_command.request, str(config), old, 60.0)
                assert status == 0, capsys.readouterr().err
                assert f"handed over from pid {old} " in capsys.readouterr().err
                assert (await svc.next("exit", timeout=30, pid=old))["status"] == 0
                assert svc.main != old
        finally:
            await kubelet.stop()
