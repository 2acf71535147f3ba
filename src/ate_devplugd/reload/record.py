"""The record the running daemon keeps of itself, announced on its instance lock (``kubelet.lock``).

It says who the daemon is (pid, version, mode, when it started, the config file it reads), the config it
runs as values (``config.values``: every value in effect, so a file is compared with it by value, never by
text), what it serves (each resource: its units, how many are offered healthy, whether kubelet holds it,
why it is withheld), its STATUS line and how its latest reload went. It lives as long as the daemon and
the lock: no file is left behind by a daemon that died, and the pid is the kernel's (SO_PEERCRED), not
the record's word. The commands find a daemon by the config they are given (``commands.instance``).

One JSON object per line (``encode``/``decode``); a record that does not decode is no record. Keys it
does not know are ignored, so a command of one version reads the daemon of the next (an upgrade).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from ate_devplugd.config import DEFAULT_CONFIG_PATH
from ate_devplugd.reload.result import Outcome, Result


class Serving(NamedTuple):
    """One resource as the daemon serves it."""

    resource: str
    #: Units offered to kubelet (0 before the device was first present).
    units: int
    #: Of those, the ones offered Healthy now (0 while the device is unhealthy or withheld).
    healthy: int
    #: Kubelet holds it: registered and watched (DRA mode: the driver registered and the resource published).
    registered: bool
    #: Why it is withheld (``cri.usable``), "" while it is not.
    withheld: str = ""


class Instance(NamedTuple):
    """A running daemon, as it says of itself."""

    pid: int
    version: str
    mode: str
    #: When it started (seconds since the epoch).
    started: float
    #: The config file it reads ("" for the built-in defaults), and what its command line sets over it
    #: (``plugin_dir``, ``dev_root``, ``log_level``: the file is compared with what runs under the same).
    source: str
    overrides: Mapping[str, str]
    #: ``config.values`` of the config it runs.
    config: Mapping[str, Any]
    #: READY=1 has gone out: every present device served once.
    ready: bool
    status: str
    serving: tuple[Serving, ...]
    reload: Result
    #: The handover it was started for (its predecessor's pid), and the one it is making (its successor's
    #: pid, while it hands over); 0 for none (``daemon.handover``).
    predecessor: int = 0
    successor: int = 0


def source_of(config_path: str | os.PathLike[str] | None) -> str:
    """A config file as a record names it: its real path, or "" for the built-in defaults (no file given,
    and none at the default path)."""
    if config_path is None:
        if not os.path.exists(DEFAULT_CONFIG_PATH):
            return ""
        config_path = DEFAULT_CONFIG_PATH
    return os.path.realpath(config_path)


def encode(instance: Instance) -> bytes:
    import json  # noqa: PLC0415 - only when a command asks

    body = instance._asdict()
    body["serving"] = [s._asdict() for s in instance.serving]
    body["reload"] = {**instance.reload._asdict(), "outcome": instance.reload.outcome.value}
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes) -> Instance | None:
    """The record in ``data``; None when it is not one."""
    import json  # noqa: PLC0415

    try:
        body = json.loads(data)
        reload = body["reload"]
        return Instance(
            pid=int(body["pid"]),
            version=str(body["version"]),
            mode=str(body["mode"]),
            started=float(body["started"]),
            source=str(body["source"]),
            overrides={str(k): str(v) for k, v in dict(body.get("overrides") or {}).items()},
            config=dict(body["config"]),
            ready=bool(body["ready"]),
            status=str(body["status"]),
            serving=tuple(Serving(**{k: s[k] for k in Serving._fields if k in s}) for s in body["serving"]),
            reload=Result(int(reload["generation"]), Outcome(reload["outcome"]), str(reload.get("error", ""))),
            predecessor=int(body.get("predecessor", 0)),
            successor=int(body.get("successor", 0)),
        )
    except (ValueError, KeyError, TypeError):
        return None
