"""What the loader workers' fork server imports once, before any worker starts (``loader_workers.PRELOADED``): the
data modules, with the garbage collector off while they import (as in ``main.py``, a third of the imports' time) and
their objects frozen out of its sweeps afterwards, so that the workers forked from the server do not copy the pages
a sweep would write to."""

import gc

gc.disable()

import multigpu.data.datamodule  # noqa: E402, F401

gc.freeze()
gc.enable()
