"""torchrun restarts: each attempt's processes meet under their own keys in torchrun's store.

When torchrun (``--max-restarts``) restarts its workers, it keeps the store it serves at
``MASTER_ADDR:MASTER_PORT``, and torch's ``env://`` rendezvous no longer prefixes the keys
with the attempt. The process group of a restarted attempt then reads the addresses that
the killed attempt's processes published, and gloo (or NCCL) fails connecting to them, or
hangs (pytorch/pytorch#167288; seen here with torch 2.15 and gloo, with both static and
c10d rendezvous). ``separate_restart_attempts()`` puts the attempt back into the keys.
"""

import os
from datetime import timedelta

from torch.distributed import PrefixStore
from torch.distributed.constants import default_pg_timeout

from multigpu.compat import rendezvous_handlers

__all__ = ["separate_restart_attempts"]

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

    env_handler_of_this_attempt.separates_attempts = True
    handlers["env"] = env_handler_of_this_attempt
