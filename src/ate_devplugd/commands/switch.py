"""``ate-devplugd switch-mode dra|device-plugin``: a node moved between the modes, with pods running and
arriving, none lost and none stranded. The move itself, step by step, is ``switch_move``'s; this is the
command around it: its line, the journal, the signals and the exit status.

SIGINT and SIGTERM only set a flag; the move is then cancelled where it stands, and the command says where
that leaves the node (``switch_where``), keeps the cordon and exits 128 + the signal (130, 143). A failed
step, a timeout or an API server that went away end the same way with exit status 1; no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Sequence

from ate_devplugd import config as configmod
from ate_devplugd.commands import switch_move
from ate_devplugd.commands.findings import config_error
from ate_devplugd.commands.switch_files import Host, HostFiles, NothingChanged, SwitchFailed, run_systemctl
from ate_devplugd.commands.switch_move import EVENTS, STEPS, HandOver, Switch, Timing
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.dra import kubeconfig
from ate_devplugd.dra.apiclient import ApiError, ApiUnavailable

__all__ = ["EVENTS", "Timing", "main", "switch_mode"]

#: What ends a move before it is done, each said with where the node stands.
FAILURES = (SwitchFailed, ApiError, ApiUnavailable, kubeconfig.KubeconfigError, OSError, ConfigError)


async def switch_mode(
    target: str,
    config: Config,
    host: Host,
    timing: Timing,
    *,
    own: Config | None = None,
    interrupted: asyncio.Event | None = None,
    signals: Sequence[int] = (),
    handover: HandOver | None = None,
) -> int:
    """The whole move and its exit status: 0 done; 1 failed (where the node stands is said); 128 + the
    signal when one of ``signals`` came (their handlers are set here), or 130 when the caller set
    ``interrupted`` (a test's Ctrl-C). With ``handover``, the run is a guarded handover (``commands.guard``)
    toward the mode the node is in."""
    if config.dra is None:
        raise ConfigError(["dra: switch-mode needs the [dra] table (node_name, kubeconfig) in the config"])
    switch = Switch(target, config, host, timing, own, handover=handover)
    stop = interrupted or asyncio.Event()
    caught: list[int] = []
    loop = asyncio.get_running_loop()

    def caught_one(signum: int) -> None:  # a flag, nothing more: the move is cancelled below
        caught.append(signum)
        stop.set()

    for signum in signals:
        loop.add_signal_handler(signum, caught_one, signum)
    run = loop.create_task(switch.run())
    waiter = loop.create_task(stop.wait())
    try:
        await asyncio.wait({run, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        for signum in signals:
            loop.remove_signal_handler(signum)
    try:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, *FAILURES):
                await run
            name = signal.Signals(caught[0]).name if caught else "SIGINT"
            await switch.ended(f"interrupted by {name} {at(switch.step)}", "switch-interrupted")
            return 128 + (caught[0] if caught else signal.SIGINT)
        try:
            run.result()
        except FAILURES as exc:
            text = "; ".join(exc.errors) if isinstance(exc, ConfigError) else str(exc)
            where = "the cordon lifted" if isinstance(exc, NothingChanged) else at(switch.step)
            await switch.ended(f"{text} ({where})")
            return 1
        return os.EX_OK
    finally:
        await switch.close()


def at(step: int) -> str:
    return f"at step {step}/{STEPS}" if step else "before its first step"


def main(args: argparse.Namespace) -> int:
    """``switch-mode``, as the command line gives it: the config file's, its unit's drop-in, systemctl."""
    from ate_devplugd.base import logs  # noqa: PLC0415

    try:
        cfg = configmod.load(args.config)
    except ConfigError as exc:
        return config_error(exc.errors)
    logger = switch_move.log  # each step's event in the journal, besides stdout; never twice on the terminal
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.NullHandler())
    if os.path.exists("/run/systemd/journal/socket"):
        with contextlib.suppress(ImportError):
            logger.addHandler(logs.JournalHandler())
    files = HostFiles(args.config or configmod.DEFAULT_CONFIG_PATH, args.dropin_dir, args.dropin_source)

    async def systemctl(*words: str) -> None:
        await run_systemctl(args.systemctl, *words)

    own = cfg
    if args.kubeconfig and cfg.dra is not None:
        cfg = dataclasses.replace(cfg, dra=dataclasses.replace(cfg.dra, kubeconfig=args.kubeconfig))
    host = Host(files, systemctl)
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        return asyncio.run(
            switch_mode(args.mode, cfg, host, Timing(args.timeout, args.settle), own=own, signals=signals)
        )
    except ConfigError as exc:
        return config_error(exc.errors)
    except KeyboardInterrupt:  # before the handlers are in place, or a second one while the end is said
        print(f"switch-mode {args.mode}: interrupted; see `ate-devplugd doctor` for where the node stands")
        return 128 + signal.SIGINT
