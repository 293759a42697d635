"""How many images per second each layout will train, forecast before anything trains.

A step is built from each block's measured forward, backward and update time (``profile``), at
the layout's batch or micro-batch and, on the CPU, its processes' share of the cores, slowed
as much as processes running at once slow each other (``links``; where every process waits for the
others throughout the step, ``ddp``'s, ``fsdp``'s and replicated model parallel's, as much slower as the slowest
of them runs), and the tensors it moves at the measured latency and bandwidth of the links:

- one device: the passes, then the update;
- ``ddp``: the backward pass hands DDP's buckets (the first of 1 MiB, then 25 MiB, filled
  from the last block back) to an all-reduce as each fills; the all-reduces run one after
  another beside the backward pass, and the step waits for the last;
- ``fsdp``: each block's parameters are all-gathered before its forward and backward pass (the
  next block's while this one computes) and its gradients reduce-scattered after its backward
  pass, one transfer at a time beside the computation, plus ``fully_shard``'s own cost per block and
  per byte of its parameters;
- ``manual_model_parallel``: the stages one after another for the whole batch, the activations
  and their gradients sent between devices, and with several replicas ``ddp``'s all-reduce;
- ``dp``: a slice of the batch on every device at once, the parameters broadcast and the
  gradients gathered on the first every step;
- ``pipeline``: the schedule's step simulated from its action lists (``pipeline_simulation``),
  the zero-bubble schedules' split backward passes as much longer as the network's measured split in two
  (``BlockProfile.split_backward``; their whole ones, DualPipeV's most, not), its passes slowed by the
  processes' average concurrency over the step (they compute at once only between the bubbles); then, every
  process waiting for the step's last action (the last stage's output is broadcast to all), with several
  copies of the pipeline an all-reduce of each process's gradients, and the update of its blocks, the step
  ending with the slowest process's (the stage of the largest blocks updates longest).

With activation recomputation each backward pass also runs its block's forward pass again.
"""

from collections.abc import Callable, Sequence

from multigpu.planning.layouts import Layout
from multigpu.planning.links import Links
from multigpu.planning.memory_estimate import BlockMemory
from multigpu.planning.pipeline_simulation import simulate_step, splits_backward
from multigpu.planning.profile import BlockProfile
from multigpu.strategies.partition import stage_ranges

__all__ = ["forecast", "timed_input"]

MIB = 2**20
DDP_FIRST_BUCKET, DDP_BUCKET = 1 * MIB, 25 * MIB  # DistributedDataParallel's defaults


def timed_input(layout: Layout) -> tuple[int, int]:
    """The images of one input of a device of ``layout`` (a micro-batch, dp's slice of the batch), and its
    processes: what its blocks are timed at."""
    images = layout.batch_size // layout.micro_batches if layout.strategy == "pipeline" else layout.batch_size
    if layout.strategy == "dp":
        images = -(-layout.batch_size // layout.devices)
    return images, layout.processes


def forecast(layout: Layout, profile: BlockProfile, links: Links, memory: BlockMemory) -> float | str:
    """Forecast images per second of ``layout``, or why its blocks cannot be timed."""
    times = profile.times(*timed_input(layout))
    if isinstance(times, str):
        return times
    times = times.scaled(links.slowdown(layout.processes, _in_lockstep(layout)))
    forward = times.forward
    backward = [b + (f if layout.recompute else 0.0) for f, b in zip(forward, times.backward)]
    if layout.strategy == "pipeline":
        splits = splits_backward(layout.pipeline, layout.micro_batches)
        split = profile.split_backward(layout.processes) if splits else 1.0
        step = _pipeline(layout, forward, backward, times.update, links, memory, split)
    else:
        step = _STEPS[layout.strategy](layout, forward, backward, times.update, links, memory)
    return layout.batch_size * layout.replicas / step


def _in_lockstep(layout: Layout) -> bool:
    """Whether every process computes the same passes as the others and waits for them throughout the step
    (``ddp``'s and model parallel replicas' all-reduce, ``fsdp``'s gathers and reduce-scatters): then the slowest sets
    the pace. A pipeline's processes compute different stages, with the bubbles between to absorb a slow one."""
    return layout.strategy != "pipeline" and layout.processes > 1


def _one_device(layout, forward, backward, update, links, memory) -> float:
    return sum(forward) + sum(backward) + sum(update)


def _ddp(layout, forward, backward, update, links, memory) -> float:
    reduce = lambda nbytes: links.all_reduce(nbytes, layout.processes)  # noqa: E731
    return sum(forward) + overlapped_reduction(backward, memory.params, reduce, links.overlap) + sum(update)


def overlapped_reduction(
    backward: Sequence[float], params: Sequence[int], reduce: Callable[[float], float], overlap: bool
) -> float:
    """Seconds from the start of the backward pass until its last gradient bucket is all-reduced: beside the
    backward pass when ``overlap``, else (the CPU) each bucket's all-reduce holding the computation up."""
    compute = link = 0.0
    bucket, cap = 0, DDP_FIRST_BUCKET
    for seconds, nbytes in zip(reversed(backward), reversed(params)):
        compute += seconds
        bucket += nbytes
        if bucket >= cap:
            link = max(link, compute) + reduce(bucket)
            compute = compute if overlap else link
            bucket, cap = 0, DDP_BUCKET
    if bucket:
        link = max(link, compute) + reduce(bucket)
    return max(compute, link)


def _fsdp(layout, forward, backward, update, links, memory) -> float:
    group, params = layout.processes, memory.params
    gather = lambda block: links.all_gather(params[block], group, latency=False)  # noqa: E731
    scatter = lambda block: links.reduce_scatter(params[block], group, latency=False)  # noqa: E731
    # The runtime's own cost, per pass: per block, and per byte the copies into and out of its collectives' buffers
    own = [(links.sharded_block + links.sharded_byte * nbytes) / 2 if nbytes else 0.0 for nbytes in params]
    serial, last = not links.overlap, len(params) - 1
    link = gather(0)  # the first block's parameters, before anything computes
    compute = link if serial else 0.0
    for block in range(last + 1):  # forward: block + 1's gather starts as block starts
        start = max(compute, link)
        if block < last:
            link = max(link, start) + gather(block + 1)
            start = link if serial else start
        compute = start + forward[block] + own[block]
    regather = layout.options.get("reshard_after_forward", True)
    if regather:
        link = max(link, compute) + gather(last)
        compute = link if serial else compute
    for block in range(last, -1, -1):  # backward: block - 1's gather, then block's reduce-scatter
        start = max(compute, link) if regather else compute
        if regather and block > 0:
            link = max(link, start) + gather(block - 1)
            start = link if serial else start
        compute = start + backward[block] + own[block]
        link = max(link, compute) + scatter(block)
        compute = link if serial else compute
    return max(compute, link) + sum(update) / group + sum(memory.tensors) * links.sharded_update


def _boundary_bytes(memory: BlockMemory, balance: Sequence[int], images: float) -> list[float]:
    """Bytes each stage's output holds for ``images`` images (the input of the next stage's first block)."""
    stages = stage_ranges(balance)
    return [memory.inputs[stages[s + 1].start] * images if s + 1 < len(stages) else 0.0 for s in range(len(stages))]


def _model_parallel(layout, forward, backward, update, links, memory) -> float:
    sends = _boundary_bytes(memory, layout.balance, layout.batch_size) if links.cuda else []  # CPU: one memory
    moved = 2 * sum(links.send(nbytes) for nbytes in sends)  # activations forward, their gradients back
    reduce = lambda nbytes: links.all_reduce(nbytes, layout.replicas)  # noqa: E731
    return sum(forward) + moved + overlapped_reduction(backward, memory.params, reduce, links.overlap) + sum(update)


def _data_parallel(layout, forward, backward, update, links, memory) -> float:
    copies = 2 * links.send(sum(memory.params))  # parameters out to the devices, gradients back
    return sum(forward) + sum(backward) + copies + sum(update)


def _pipeline(layout, forward, backward, update, links, memory, split: float) -> float:
    pipeline, stages = layout.pipeline, stage_ranges(layout.balance)
    sends = _boundary_bytes(memory, layout.balance, layout.batch_size / layout.micro_batches)

    def simulated(scale: float) -> list[float]:
        return simulate_step(
            pipeline,
            layout.micro_batches,
            [scale * sum(forward[i] for i in blocks) for blocks in stages],
            [scale * sum(backward[i] for i in blocks) for blocks in stages],
            lambda stage: links.send(sends[stage]),
            links.pipeline_action,
            split,
        )

    finish = simulated(1.0)
    # The passes came slowed as if every process computed all the time; between the bubbles fewer do. Slow
    # them as much as the processes' average concurrency over the simulated step does instead.
    computing = layout.replicas * layout.micro_batches * (sum(forward) + sum(backward))  # every copy's processes
    everyone = links.slowdown(layout.processes)
    if everyone > 1.0:
        finish = simulated(links.slowdown(computing / max(finish)) / everyone)
    # Every process gets the last stage's output (a broadcast) once the last action of the step is done, and
    # only then all-reduces its gradients and updates its blocks; the step ends with the slowest of them, which
    # the others wait for (the SIGTERM flag, all-reduced after every step).
    after = []
    for process in range(len(finish)):
        held = [i for stage in pipeline.stages_of(process) for i in stages[stage]]
        reduce = links.all_reduce(sum(memory.params[i] for i in held), layout.replicas)
        after.append(reduce + sum(update[i] for i in held))
    return max(finish) + max(after)


_STEPS = {
    "auto": _one_device,
    "ddp": _ddp,
    "fsdp": _fsdp,
    "manual_model_parallel": _model_parallel,
    "dp": _data_parallel,
}
