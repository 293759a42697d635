"""What the loader workers' fork server imports once, before any worker starts (``loader_workers.PRELOADED``): the
data modules, with the garbage collector off while they import (as in ``main.py``: its sweeps were a large share of
the imports' time, docs/testing.md, "What keeps it short") and their objects frozen out of its sweeps afterwards, so
that the workers forked from the server do not copy the pages a sweep would write to."""

import gc

gc.disable()

import multigpu.data.datamodule  # noqa: E402, F401

gc.freeze()
gc.enable()
