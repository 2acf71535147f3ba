"""``ate-devplugd probe``: what kubelet (and in DRA mode the scheduler) sees of this node's plugin.

It probes what runs: the config of the daemon that serves the file given (``commands.instance``), whatever
the file says now, saying on stderr how the file differs and how the daemon's last reload went; with no
daemon for it, the file's config, saying which daemons it sees elsewhere. Device-plugin mode's probe is
``commands/probe/deviceplugin.py``, DRA mode's ``commands/probe/dra.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ate_devplugd.commands import instance
from ate_devplugd.commands.findings import EXIT_FAILED, config_error
from ate_devplugd.config import DEFAULT_CONFIG_PATH, Config


def main(args: argparse.Namespace) -> int:
    found = asyncio.run(instance.find(args.config, args.plugin_dir))
    cfg = found.config
    if cfg is None:
        return config_error(found.file_errors)
    running = found.running
    if running is None:
        print(f"ate-devplugd: {found.nobody()}; probing what the file says", file=sys.stderr)
    else:
        if args.plugin_dir:
            cfg = cfg.with_overrides(plugin_dir=args.plugin_dir)
        where = f"the running daemon ({running.describe()})"
        if found.file_error:
            file = args.config or DEFAULT_CONFIG_PATH
            print(f"ate-devplugd: probing {where}; {file} does not load: {found.file_error}", file=sys.stderr)
        elif found.differences:
            print(f"ate-devplugd: probing {where}; {found.file_line()}", file=sys.stderr)
        if running.refused:
            print(f"ate-devplugd: its last reload was not applied: {running.refused}", file=sys.stderr)
    return probe(cfg, args.timeout)


def probe(cfg: Config, timeout: float) -> int:
    if cfg.mode == "dra" and cfg.dra is not None:
        from ate_devplugd.commands.probe import dra  # noqa: PLC0415 - aiohttp and PyYAML only in DRA mode

        report = asyncio.run(dra.probe(cfg.dra, timeout))
        print(dra.render(report))
        return os.EX_OK if report.ok else EXIT_FAILED

    from ate_devplugd.commands.probe import deviceplugin  # noqa: PLC0415 - grpc only here

    ours = {dev.socket_name: dev.resource for dev in cfg.devices}
    try:
        rows = asyncio.run(deviceplugin.probe_all(cfg.plugin_dir, ours, timeout, cfg.metrics_file))
    except OSError as exc:
        print(f"ate-devplugd: cannot read {cfg.plugin_dir}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    if not rows:
        print(f"no plugin sockets in {cfg.plugin_dir}")
        return EXIT_FAILED
    print(deviceplugin.render(rows))
    return EXIT_FAILED if any(row.error for row in rows) else os.EX_OK
