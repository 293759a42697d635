"""The training run: what a run writes, where it stands, and the processes it runs in.

callbacks           the console line, throughput, checkpoints every N steps and on SIGTERM, SIGUSR1 or Ctrl-C
step_times          at log steps: step time, the loader's wait, images/s, MFU, a save's hold, peak memory, a straggler
gradient_norm       the gradient norm before clipping, at log steps, which each strategy computes
peak_flops          a device's peak FLOP/s at a run's precision, which MFU divides by
run_logger          the run's TensorBoard logger: the epoch scalar once per epoch
stop_votes          the processes' agreement, every step and without a wait, on a stop signal or the time limit
validation_report   each validation's accuracy by class, its confusion matrix and worst images, drawn in a thread
watchdog            a stalled process named and its job ended; a failed background write raised after its step
checkpoints         finding and checking a run's checkpoint files
checkpoint_io       checkpoint files written in the background and atomically; a failed write named in one line
sharded_checkpoints fsdp's checkpoints as each process holds them, and put together again
device_sync         waiting for a device's queued work before a clock is read
elastic             torchrun's restarts and node count
fit_summary         what a finished fit says: throughput, each device's peak memory, its best checkpoint, TensorBoard
host_memory         the C heap of a training process: freed memory kept for the next step; its resident memory
loop_position       where a run stands in Lightning's loop counters, and whether it is finished
model_summary       the model summary, without a FLOP count that was never made
process_groups      process groups that end cleanly
progress_bar        the progress bar, which reads the metrics only after log steps and at each end
replicas            who reads which data: data-parallel replicas, ranks and micro-batches of a strategy
run_hparams         a run as one row of TensorBoard's HPARAMS: its layout and recipe, its best and last validation
resume              the one owner of resume: a checkpoint's ResumePoint, given to the sampler and the loop counters
spawned_ranks       the process groups of ddp_spawn's ranks, ended as their Trainer tears down
trainer_parts       what a Trainer holds but its class does not declare (its callbacks, data module...), typed
"""

__all__ = [
    "callbacks",
    "checkpoint_io",
    "checkpoints",
    "device_sync",
    "elastic",
    "fit_summary",
    "gradient_norm",
    "host_memory",
    "loop_position",
    "model_summary",
    "peak_flops",
    "process_groups",
    "progress_bar",
    "replicas",
    "resume",
    "run_hparams",
    "run_logger",
    "sharded_checkpoints",
    "spawned_ranks",
    "step_times",
    "stop_votes",
    "trainer_parts",
    "validation_report",
    "watchdog",
]
