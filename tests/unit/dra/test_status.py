"""The DRA part of STATUS=, made from enums and counts."""

from __future__ import annotations

import pytest

from ate_devplugd.config.dra import Layout
from ate_devplugd.dra.driver import DraStatus, KubeletLink
from ate_devplugd.dra.layout import LayoutChoice, Why
from ate_devplugd.dra.slices import SliceState


class TestStatus:
    @pytest.mark.parametrize(
        ("status", "text"),
        [
            (
                DraStatus(KubeletLink.REGISTERED, SliceState.PUBLISHED, 128),
                "dra: registered with kubelet, slice published (128 devices)",
            ),
            (
                DraStatus(KubeletLink.WAITING, SliceState.PUBLISHED, 0),
                "dra: waiting for kubelet, slice published (no device offered)",
            ),
            (
                DraStatus(KubeletLink.GONE, SliceState.PUBLISHED, 128),
                "dra: kubelet gone, not registered, slice published (128 devices)",
            ),
            (
                DraStatus(KubeletLink.REGISTERED, SliceState.REPUBLISHING, 0),
                "dra: registered with kubelet, slices deleted, publishing again",
            ),
            (
                DraStatus(KubeletLink.REGISTERED, SliceState.KUBECONFIG_ERROR, 0, detail="/kc: cannot read"),
                "dra: registered with kubelet, slices kubeconfig error: /kc: cannot read",
            ),
            (
                DraStatus(KubeletLink.REGISTERED, SliceState.CREDENTIALS_REFUSED, 0, detail="401 Unauthorized; x"),
                "dra: registered with kubelet, slices not published, the API server refuses the credentials: "
                "401 Unauthorized; x",
            ),
            (
                DraStatus(
                    KubeletLink.REGISTERED, SliceState.PUBLISHED, 1, layout=LayoutChoice(Layout.SHARED, Why.KEPT)
                ),
                "dra: registered with kubelet, slice published (1 device), "
                "layout shared (decided: the API server keeps allowMultipleAllocations)",
            ),
            (
                DraStatus(
                    KubeletLink.REGISTERED, SliceState.PUBLISHED, 128, layout=LayoutChoice(Layout.UNITS, Why.DROPPED)
                ),
                "dra: registered with kubelet, slice published (128 devices), "
                "layout units (decided: the API server drops allowMultipleAllocations (DRAConsumableCapacity off))",
            ),
            (
                DraStatus(
                    KubeletLink.WAITING,
                    SliceState.API_ERROR,
                    0,
                    detail="x",
                    layout=LayoutChoice(Layout.UNITS, Why.CONFIG),
                ),
                "dra: waiting for kubelet, slices API server error: x",
            ),
            (
                DraStatus(KubeletLink.REGISTERED, SliceState.PUBLISHED, 1, sharing_dropped=True),
                "dra: registered with kubelet, slice published (1 device), "
                "shared device made exclusive by the API server (DRAConsumableCapacity off)",
            ),
        ],
    )
    def test_status_line(self, status: DraStatus, text: str) -> None:
        """The STATUS= part is built from the state enums and counts."""
        assert str(status) == text
