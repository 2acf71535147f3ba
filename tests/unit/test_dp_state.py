"""kubelet's device-manager checkpoint read as kubelet writes it: the healthy IDs per resource and which write
it is; anything else tells nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ate_devplugd.kubelet.dp_state import CHECKPOINT, identity, recorded


def write(directory: Path, text: str) -> None:
    """As kubelet writes it: a dot-named temp file renamed into place (a new file each time)."""
    staging = directory / f".{CHECKPOINT}.tmp"
    staging.write_text(text)
    os.replace(staging, directory / CHECKPOINT)


def test_registered_devices_and_which_write(tmp_path: Path) -> None:
    assert recorded(str(tmp_path)) is None and identity(str(tmp_path)) is None
    entries = [{"PodUID": "u", "ContainerName": "c", "ResourceName": "ate.dev/kvm", "DeviceIDs": {"-1": ["kvm-0"]}}]
    doc = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {"ate.dev/kvm": ["kvm-0", "kvm-1"]}}}
    write(tmp_path, json.dumps({**doc, "Checksum": 1}))
    first = recorded(str(tmp_path))
    assert first is not None and first.healthy == {"ate.dev/kvm": frozenset({"kvm-0", "kvm-1"})}
    assert first.identity == identity(str(tmp_path))
    write(tmp_path, json.dumps({"Data": {"RegisteredDevices": {"ate.dev/kvm": []}}, "Checksum": 2}))
    second = recorded(str(tmp_path))
    assert second is not None and second.healthy == {"ate.dev/kvm": frozenset()}
    assert second.identity != first.identity


def test_what_cannot_be_read_tells_nothing(tmp_path: Path) -> None:
    for text in ("", "{", "[]", '{"Data": []}', '{"Data": {"RegisteredDevices": null}}'):
        write(tmp_path, text)
        assert recorded(str(tmp_path)) is None, text
    (tmp_path / CHECKPOINT).unlink()
    (tmp_path / CHECKPOINT).mkdir()
    assert recorded(str(tmp_path)) is None
