"""``CountWaits``: a test-only callback (``step_waits.CountWaits`` in a config) that counts, in each process of a run,
every call that would make the host wait for a GPU and every Python-level collective, training step by training step.

A wait: ``.item()``, ``.tolist()``, ``bool()``, ``float()``, ``int()`` of a tensor, ``.cpu()``, ``.numpy()``, and
a tensor made on a device from Python numbers (``torch.tensor(..., device=...)``). On the CPU none of them costs
anything, which is why they are counted rather than timed. A collective: every function of ``torch.distributed``
that talks to the other processes, and DDP's broadcast of buffers (``isend`` and ``irecv`` through
``batch_isend_irecv``: torch's ``P2POp`` checks that it was given those very functions). Those that a strategy's own
arithmetic makes (``OWN``) are counted apart, by the module that calls them; DDP's gradient buckets are all-reduced
in C++, out of Python's sight. A loader's work on its host tensors is not counted.

A step's window runs from its ``on_train_batch_start`` to the next one's, so that it holds what Lightning does
after the batch (logging, the progress bar, checkpoints). A window is quiet unless, within it, the logger wrote, a
checkpoint was saved, validation ran or the epoch ended, and unless it is an epoch's first: the counts of the quiet
windows are the waits between log steps. Each process writes ``out_dir/rank<N>.json``. With ``sync_debug``, on CUDA,
torch itself raises at any synchronisation (those made in C++ too) in a step that is neither a log step, an epoch's
first nor its last.
"""

import json
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from typing_extensions import override

from multigpu.compat import is_log_step

WAITS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "gather",
    "scatter", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "send", "recv", "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "_broadcast_coalesced",
)  # fmt: skip
# Callers whose collectives are a strategy's own arithmetic: FSDP's gathers and reductions, the pipeline's sends and
# receives and its clipping norm over the stages, and the replicas' BatchNorm statistics (one all-reduce of 2 numbers
# per channel a step, which keeps them one device's: docs/speed.md says why it is not put off).
OWN = (
    "torch/distributed/fsdp/",
    "torch/distributed/pipelining/",
    "multigpu/model/step_batch_norm.py",
    "multigpu/strategies/pipeline/gradients.py",  # the clipping norm of every stage's gradients
)
# Callers that talk to the other processes on the host alone, on CPU tensors in a gloo group of their own, never waiting
# for a device: the stop signal's vote (``checkpointing/stop_votes.py``), counted apart as ``host``.
HOST = ("multigpu/checkpointing/stop_votes.py",)
LOADING = "torch/utils/data/_utils/fetch.py"
# Frames skipped when naming where a call came from.
SKIPPED = (__file__, "torch/_tensor.py", "torch/utils/_contextlib.py", "torch/distributed/c10d_logger.py")


def _caller() -> str:
    """``file:line function`` of the frame that made the call being counted."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(skip in frame.filename for skip in SKIPPED):
            return f"{'/'.join(Path(frame.filename).parts[-3:])}:{frame.lineno} {frame.name}"
    return "?"


class CountWaits(Callback):
    """Counts waits and collectives per training step's window; writes ``out_dir/rank<N>.json`` as training ends."""

    def __init__(self, out_dir: str, sync_debug: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.sync_debug = sync_debug  # on CUDA: torch raises at any synchronisation in a step between log steps
        self.windows: list[dict[str, Any]] = []
        self._originals: list[tuple[Any, str, Any]] = []

    def _count(self, kind: str, name: str) -> None:
        if self.windows:
            self.windows[-1][kind][f"{name} at {_caller()}"] += 1

    def _patch(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        counter = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            stack = "".join(traceback.format_stack(limit=12))
            if any(host in stack for host in HOST):
                counter._count("host", name)
            elif kind == "collectives" and any(own in stack for own in OWN):
                counter._count("own collectives", name)
            elif LOADING not in stack:  # a loader's work on the host's tensors, before they go to the device
                counter._count(kind, name)
            return original(*args, **kwargs)

        self._originals.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, counted)

    def _patch_tensor_factories(self) -> None:
        counter = self
        for name in ("tensor", "as_tensor"):
            original = getattr(torch, name)

            def made(data: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                    counter._count("waits", f"torch.{_name}(python numbers, device=...)")
                return _original(data, *args, **kwargs)

            self._originals.append((torch, name, original))
            setattr(torch, name, made)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        for name in WAITS:
            self._patch(torch.Tensor, name, "waits")
        if dist.is_available():
            for name in COLLECTIVES:
                self._patch(dist, name, "collectives")
        self._patch_tensor_factories()
        for logger in trainer.loggers:
            original = logger.log_metrics

            def log_metrics(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self._mark("logged")
                return _original(*args, **kwargs)

            logger.log_metrics = log_metrics

    def _mark(self, why: str) -> None:
        if self.windows:
            self.windows[-1]["noisy"].add(why)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first = batch_idx == 0 or not self.windows
        if self.sync_debug:  # until the next step starts, unless this one logs or ends the epoch
            quiet = not (first or is_log_step(trainer) or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
            torch.cuda.set_sync_debug_mode("error" if quiet else "default")
        self.windows.append(
            {
                "step": trainer.global_step,
                "batch": batch_idx,
                "noisy": {"epoch's first"} if first else set(),
                "waits": Counter(),
                "collectives": Counter(),
                "own collectives": Counter(),
                "host": Counter(),
            }
        )

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._mark("saved")

    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        self._mark("validated")

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._mark("epoch's end")

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode("default")
        for owner, name, original in reversed(self._originals):
            if original is None:  # inherited: the class's own attribute goes
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        windows = [{**window, "noisy": sorted(window["noisy"])} for window in self.windows]
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(windows, indent=1))


def quiet_counts(folder: Path) -> dict[str, dict]:
    """Every rank's quiet windows (their number), and what their waits and collectives were, summed, by call site."""
    found = {}
    for path in sorted(folder.glob("rank*.json")):
        windows = json.loads(path.read_text())
        quiet = [window for window in windows if not window["noisy"]]
        totals: dict[str, Counter] = {
            "waits": Counter(), "collectives": Counter(), "own collectives": Counter(), "host": Counter()
        }  # fmt: skip
        for window in quiet:
            for kind, counts in totals.items():
                counts.update(window[kind])
        found[path.stem] = {"windows": len(windows), "quiet": len(quiet), **{k: dict(v) for k, v in totals.items()}}
    return found


if __name__ == "__main__":  # print what a run's folder holds
    print(json.dumps(quiet_counts(Path(sys.argv[1])), indent=1))
