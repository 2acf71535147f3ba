"""``ate-devplugd check-config``: the effective config on stdout (what the daemon would run), and on stderr
what else it means on this host (``config.review``); every error names key and value, exit 78."""

from __future__ import annotations

import argparse
import os
import sys

from ate_devplugd import config as configmod
from ate_devplugd.commands.findings import config_error
from ate_devplugd.config import ConfigError


def main(args: argparse.Namespace) -> int:
    try:
        cfg = configmod.load(args.config)
    except ConfigError as exc:
        return config_error(exc.errors)
    review = configmod.review(cfg)
    for line in review.notes:
        print(f"ate-devplugd: note: {line}", file=sys.stderr)
    for line in review.warnings:
        print(f"ate-devplugd: config warning: {line}", file=sys.stderr)
    sys.stdout.write(configmod.render(cfg))
    return os.EX_OK
