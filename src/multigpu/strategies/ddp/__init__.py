"""Lightning's ``ddp`` and ``ddp_spawn``: one process per device, each a replica, its gradients all-reduced.

layouts  what ``ddp`` tells ``plan``
options  the options every DDP of ours is given (Lightning's names re-registered with them, and the strategies
         that replicate with DDP)
"""

from multigpu.strategies.ddp.layouts import DDPLayout
from multigpu.strategies.ddp.options import ddp_options
from multigpu.strategies.spec import StrategySpec

__all__ = ["SPECS", "DDPLayout", "ddp_options"]

DETAILS = "[many GPUs and machines](docs/scaling.md)"
SPECS = (
    StrategySpec("ddp", "Lightning's: one process per device, gradients all-reduced", DETAILS, layout=DDPLayout),
    StrategySpec("ddp_spawn", "Lightning's: as `ddp`, its processes spawned", DETAILS),
)
