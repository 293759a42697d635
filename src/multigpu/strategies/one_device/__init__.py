"""One device, Lightning's own strategy (``auto`` on one device): the reference every other layout is compared with.

layouts  what it tells ``plan``
"""

from multigpu.strategies.one_device.layouts import OneDeviceLayout
from multigpu.strategies.spec import StrategySpec

__all__ = ["SPECS", "OneDeviceLayout"]

SPECS = (StrategySpec("auto", "one process, one device", layout=OneDeviceLayout),)
