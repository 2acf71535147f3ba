"""DRA mode: ate-devplugd as a Dynamic Resource Allocation driver (kubelet 1.32 and later).

The daemon uses ``DraDriver`` (see driver.py for the order of calls), ``config.from_mapping`` for the
``[dra]`` table and ``manifests.render`` for ``ate-devplugd dra-manifests``.
"""

from ate_devplugd.dra.config import DraConfig
from ate_devplugd.dra.driver import DraDriver, DraSetupError, DraStatus, KubeletState
from ate_devplugd.dra.pools import DraResource
from ate_devplugd.dra.slices import SliceState

__all__ = ["DraConfig", "DraDriver", "DraResource", "DraSetupError", "DraStatus", "KubeletState", "SliceState"]
