"""kubelet's DRA checkpoint as read for the driver's claims (``kubelet.dra_state``)."""

from __future__ import annotations

from pathlib import Path

from ate_devplugd.kubelet.dra_state import CHECKPOINT, Claims, claims_of

DRIVER = "kvm.ate.dev"


def test_the_checkpoint_tells_whether_a_claim_of_the_driver_is_left(tmp_path: Path) -> None:
    assert claims_of(str(tmp_path), DRIVER) is Claims.NONE  # no checkpoint: kubelet holds no claim
    assert claims_of(str(tmp_path / "missing"), DRIVER) is Claims.NONE
    state = tmp_path / CHECKPOINT
    state.write_text('{"Data":"{\\"ClaimInfoStateList\\":[]}","Checksum":7}')
    assert claims_of(str(tmp_path), DRIVER) is Claims.NONE
    state.write_text('{"Data":"{\\"ClaimInfoStateList\\":[{\\"DriverState\\":{\\"kvm.ate.dev\\":{}}}]}"}')
    assert claims_of(str(tmp_path), DRIVER) is Claims.RECORDED
    assert claims_of(str(tmp_path), "gpu.example.com") is Claims.NONE


def test_a_checkpoint_that_cannot_be_read_tells_nothing(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT).mkdir()  # EISDIR: not "absent"
    assert claims_of(str(tmp_path), DRIVER) is Claims.UNKNOWN
