"""The training run: what a run logs and shows, and the processes it runs in (its checkpoints, resume and stops:
``multigpu.checkpointing``).

throughput          images per second, MFU and the epoch time, logged and printed once per epoch
step_times          at log steps: step time, the loader's wait, images/s, MFU, a save's hold, peak memory, a straggler
gradient_norm       the gradient norm before clipping, at log steps, which each strategy computes
peak_flops          a device's peak FLOP/s at a run's precision, which MFU divides by
run_logger          the run's TensorBoard logger: the epoch scalar once per epoch
validation_report   each validation's accuracy by class, its confusion matrix and worst images, drawn in a thread
device_sync         waiting for a device's queued work before a clock is read
fit_summary         what a finished fit says: throughput, each device's peak memory, its best checkpoint, TensorBoard
host_memory         the C heap of a training process: freed memory kept for the next step; its resident memory
model_summary       the model summary, without a FLOP count that was never made
process_groups      process groups that end cleanly
progress_bar        the progress bar, which reads the metrics only after log steps and at each end
replicas            who reads which data: data-parallel replicas, ranks and micro-batches of a strategy; the layout
                    record of a run
run_hparams         a run as one row of TensorBoard's HPARAMS: its layout and recipe, its best and last validation
spawned_ranks       the process groups of ddp_spawn's ranks, ended as their Trainer tears down
trainer_parts       what a Trainer holds but its class does not declare (its callbacks, data module...), typed
"""

__all__ = [
    "device_sync",
    "fit_summary",
    "gradient_norm",
    "host_memory",
    "model_summary",
    "peak_flops",
    "process_groups",
    "progress_bar",
    "replicas",
    "run_hparams",
    "run_logger",
    "spawned_ranks",
    "step_times",
    "throughput",
    "trainer_parts",
    "validation_report",
]
