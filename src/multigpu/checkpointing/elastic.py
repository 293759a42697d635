"""torchrun restarts: each attempt's processes meet under their own keys in torchrun's store, and
take the node count torchrun started.

When torchrun (``--max-restarts``) restarts its workers, it keeps the store it serves at
``MASTER_ADDR:MASTER_PORT``, and torch's ``env://`` rendezvous no longer prefixes the keys
with the attempt. The process group of a restarted attempt then reads the addresses that
the killed attempt's processes published, and gloo (or NCCL) fails connecting to them, or
hangs (pytorch/pytorch#167288; seen here with torch 2.15 and gloo, with both static and
c10d rendezvous). ``separate_restart_attempts()`` puts the attempt back into the keys.

An elastic run (``torchrun --nnodes=1:2``) goes on with the nodes that are left, so no
``--trainer.num_nodes`` fits every attempt: ``torchrun_node_count()`` says how many this one has.
"""

import os
from datetime import timedelta

from lightning.fabric.plugins.environments import TorchElasticEnvironment
from torch.distributed import PrefixStore
from torch.distributed.constants import default_pg_timeout

from multigpu.compat import rendezvous_handlers

__all__ = ["separate_restart_attempts", "torchrun_node_count"]

_ATTEMPT = "TORCHELASTIC_RESTART_COUNT"


def separate_restart_attempts() -> None:
    """Under torchrun, make ``env://`` process groups use keys of this restart attempt only."""
    attempt = os.environ.get(_ATTEMPT)
    handlers = rendezvous_handlers()
    if attempt is None or getattr(handlers["env"], "separates_attempts", False):
        return
    env_handler = handlers["env"]

    def env_handler_of_this_attempt(url: str, timeout: timedelta = default_pg_timeout, **kwargs):
        store, rank, world_size = next(env_handler(url, timeout=timeout, **kwargs))
        yield PrefixStore(f"multigpu/attempt_{attempt}/", store), rank, world_size
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    env_handler_of_this_attempt.separates_attempts = True  # type: ignore[attr-defined]  # a mark, read above
    handlers["env"] = env_handler_of_this_attempt


def torchrun_node_count() -> int | None:
    """Under torchrun, the nodes of this attempt (its processes over those of one node); else ``None``."""
    if not TorchElasticEnvironment.detect():
        return None
    processes, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return processes // per_node if processes % per_node == 0 else None
