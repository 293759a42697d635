"""Where a pipeline process's time goes: computing forward and backward, sending and receiving, waiting.

``StageClock`` wraps the calls every schedule of ``torch.distributed.pipelining`` makes for
its actions (``PipelineStage.forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``) and for its point-to-point communication (posting sends and
receives, then waiting for them), and adds up their seconds while ``timing`` is set.
"""

import json
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from typing_extensions import override

from multigpu.compat import time_pipeline_parts

__all__ = ["PARTS", "StageClock"]

PARTS = ("forward", "backward", "send/recv", "wait")


class StageClock(Callback):
    """Seconds per timed step in each part (``PARTS``), and ``other`` (the rest of the step), for this process.

    Times the optimizer steps after the first ``warmup``, and writes ``<out>.clock<rank>``.
    """

    def __init__(self, warmup: int, out: str) -> None:
        self.warmup, self.out = warmup, Path(out)
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.timing = False
        self._start = self._end = 0.0
        time_pipeline_parts(self._timed)

    def _timed(self, part: str, function: Callable) -> Callable:
        @wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.timing:
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return timed

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup and not self.timing:
            self.timing, self._start = True, time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == trainer.max_steps:
            self.timing, self._end = False, time.perf_counter()

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        steps = trainer.global_step - self.warmup
        per_step = {part: seconds / steps for part, seconds in self.seconds.items()}
        per_step["other"] = (self._end - self._start) / steps - sum(per_step.values())
        self.out.with_name(f"{self.out.name}.clock{trainer.global_rank}").write_text(json.dumps(per_step))
