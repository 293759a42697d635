"""Training throughput of the application against a plain PyTorch loop, measured in the same run.

    python benchmarks/throughput.py                                  # the default set for this machine
    python benchmarks/throughput.py --configs plain app ddp --processes 2 --batch-size 32
    python benchmarks/throughput.py --configs plain-ddp ddp plain-fsdp fsdp plain-pipeline pipeline \
        plain-mmp manual_model_parallel --arch resnet18               # every strategy beside its counterpart
    python benchmarks/throughput.py --list                           # every configuration

Each configuration trains ResNet-50 on synthetic CIFAR-sized images in fresh processes:
``--warmup`` untimed optimizer steps, then ``--steps`` timed ones. It runs ``--rounds`` times (5), the
configurations interleaved (every configuration once per round, each round in another order), so that a
slow period of the machine falls on all of them alike; each ratio is taken within each round. Then it runs
more rounds until the interval of every claim (each multi-process row's efficiency, each other row's ratio to
its plain loop, each strategy's ratio to its counterpart) lies within ``--within`` (±3%) of its median, or
``--max-rounds`` (20) have run, and says which; a row whose reference is not in the set has no claim to judge.
The application runs through ``main.py fit`` with its own callbacks and logger (no checkpoint is written); the
reference is ``plain_loop.py``, the loop the plain recipes write by hand, and ``ddp``, ``fsdp``, ``pipeline`` and
``manual_model_parallel`` each have their plain PyTorch counterpart (``plain-ddp``, ``plain-fsdp``,
``plain-pipeline``, ``plain-mmp``: ``plain_peers.py``). On the CPU every process gets ``--threads`` threads
(default 1). A run that fails, or is still going after ``--timeout-s`` (900 s), ends
the benchmark with the reason. The table shows, for each configuration:

    img/s          images per second over all processes
    step ms        mean time of one optimizer step
    peak MiB       the most memory each device held (CUDA: allocated, per device; CPU: resident, per process)
    vs plain       img/s over the plain loop's with the same precision and memory format
    efficiency     multi-process runs: img/s over (processes x the one-process img/s)
    vs peer        a strategy: img/s over its plain PyTorch counterpart's, where that ran too

Each figure is that of the configuration's median round, and each interval the rounds' order-statistic
interval of the median (``multigpu.timing.intervals``): with 5 rounds, the slowest and the fastest, which
enclose the true median 15 times in 16 whatever the noise. On the CPU it checks the cores before and after
the rounds (``multigpu.timing.busy_cores``) and says so when another process keeps them busy, or a virtual
machine's host stole more than a tenth of its cores' time during the rounds; the share of the cores its check got,
and the share stolen (``stolen_share``), are in ``throughput.json``'s ``machine``, with ``busy``. On a 2-core
CPU a round of ``--configs plain app ddp`` takes 3.6 to 5.7 minutes (docs/speed.md), so the defaults take 20
minutes to 2 hours: 54 minutes (15 rounds) to within ±3% on a quiet machine; ``--within 0`` runs exactly ``--rounds``.

and writes the figures to ``<out>/throughput.json`` and a chart to ``<out>/throughput.png``.
"""

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from machine import machine, this_cpu

from multigpu.model.architectures import DEFAULT_ARCH
from multigpu.planning.bar_chart import write_bar_chart
from multigpu.timing.busy_cores import note_if_busy, read_cpu_clock
from multigpu.timing.intervals import median_interval
from multigpu.timing.step_timer import step_timer
from multigpu.timing.timed_runs import RunFailed, last_error, run
from multigpu.timing.timed_runs import fit_command as timed_fit_command

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
FAST = ["--trainer.precision=bf16-mixed", "--model.channels_last=true"]


@dataclass(frozen=True)
class Config:
    """One row of the table: the plain loop (``plain`` arguments), a strategy's plain PyTorch counterpart (``peer``
    arguments) or the application (``app`` arguments)."""

    name: str
    description: str
    plain: list[str] | None = None
    peer: list[str] | None = None  # of plain_peers.py
    app: list[str] | None = None
    multi_process: bool = False  # one process per device: scaling efficiency against `one_process`
    one_process: str = "app"
    reference: str = "plain"  # the plain loop it is compared with
    counterpart: str | None = None  # the peer row of the same strategy: `vs peer` is img/s over its img/s
    fast: bool = field(default=False)  # bf16 and channels_last, whatever --precision says


def configs(processes: int) -> dict[str, Config]:
    spread, each = [f"--trainer.devices={processes}"], f"{processes} process{'es' * (processes != 1)}"
    peers = [f"--processes={processes}"]
    every = [
        Config("plain", "plain PyTorch loop, synthetic batches on the device", plain=[]),
        Config(
            "plain-torchvision", "plain loop, torchvision augmentations in CPU workers", plain=["--data=torchvision"]
        ),
        Config("app", "main.py fit, one process", app=[]),
        Config(
            "ddp",
            f"main.py fit, ddp, {each}",
            app=["--trainer.strategy=ddp", *spread],
            multi_process=True,
            counterpart="plain-ddp",
        ),
        Config(
            "pipeline",
            f"main.py fit, pipeline, {processes} stages, 4 micro-batches",
            app=["--trainer.strategy=pipeline", *spread],
            multi_process=True,
            counterpart="plain-pipeline",
        ),
        Config(
            "fsdp",
            f"main.py fit, fsdp (FSDP2), {each}",
            app=["--trainer.strategy=fsdp", *spread],
            multi_process=True,
            counterpart="plain-fsdp",
        ),
        Config("dp", f"main.py fit, dp over {processes} devices", app=["--trainer.strategy=dp", *spread]),
        Config(
            "manual_model_parallel",
            f"main.py fit, manual_model_parallel over {processes} devices",
            app=["--trainer.strategy=manual_model_parallel", *spread],
            counterpart="plain-mmp",
        ),
        # Each strategy's plain PyTorch counterpart (plain_peers.py), the loop a user writes without Lightning.
        Config(
            "plain-ddp",
            f"plain PyTorch loop, DistributedDataParallel, {each}",
            peer=["ddp", *peers],
            multi_process=True,
            one_process="plain",
        ),
        Config(
            "plain-fsdp",
            f"plain PyTorch loop, fully_shard per block, {each}",
            peer=["fsdp", *peers],
            multi_process=True,
            one_process="plain",
        ),
        Config(
            "plain-pipeline",
            f"plain PyTorch loop, torch.distributed.pipelining, {processes} stages, 1F1B, 4 micro-batches",
            peer=["pipeline", *peers],
            multi_process=True,
            one_process="plain",
        ),
        Config(
            "plain-mmp",
            f"plain PyTorch loop, the network cut over {processes} devices in one process",
            peer=["mmp", *peers],
        ),
        Config("app-16", "main.py fit, 16-mixed (float16, gradient scaler)", app=["--trainer.precision=16-mixed"]),
        Config("plain-fast", "plain loop, bf16 + channels_last", plain=["--channels-last"], fast=True),
        Config("fast", "main.py fit, bf16 + channels_last", app=[], fast=True, reference="plain-fast"),
        Config(
            "fast-compiled",
            "main.py fit, bf16 + channels_last + torch.compile",
            app=["--model.compile=true"],
            fast=True,
            reference="plain-fast",
        ),
        Config(
            "fast-on-device",
            "configs/fast.yaml: bf16 + channels_last + compile + data on the GPU",
            app=["--config", str(REPO / "configs" / "fast.yaml")],
            fast=True,
            reference="plain-fast",
        ),
    ]
    return {config.name: config for config in every}


def network_name(arch: str, stem: str) -> str:
    """The network a table is about, in words: ``ResNet-50 (cifar stem)``, or ``--model.arch``'s name."""
    return f"ResNet-50 ({stem} stem)" if arch == DEFAULT_ARCH else arch


def default_configs(cuda: bool) -> list[str]:
    if cuda:
        names = ["plain-torchvision", "plain", "app", "plain-fast", "fast", "fast-compiled", "fast-on-device"]
        return names + (["ddp"] if torch.cuda.device_count() > 1 else [])
    return ["plain", "app", "ddp", "pipeline"]


def command(config: Config, args: argparse.Namespace, folder: Path) -> list[str]:
    out = folder / f"{config.name}.json"
    precision = "bf16-mixed" if config.fast else args.precision
    loop = [
        f"--device={'cuda' if args.cuda else 'cpu'}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--precision={precision}",
        f"--stem={args.stem}",
        f"--arch={args.arch}",
        f"--out={out}",
    ]
    if config.plain is not None:
        return [sys.executable, str(HERE / "plain_loop.py"), *loop, f"--workers={args.workers}", *config.plain]
    if config.peer is not None:
        return [sys.executable, str(HERE / "plain_peers.py"), *config.peer, *loop]
    options = [*(FAST if config.fast else []), *config.app]
    return fit_command(
        config.name,
        folder,
        args,
        args.warmup + args.steps,
        args.processes,
        precision,
        options,
        step_timer(args.warmup, out),
    )


def fit_command(
    name: str,
    folder: Path,
    args: argparse.Namespace,
    steps: int,
    processes: int,
    precision: str,
    options: list[str],
    callbacks: list[str],
) -> list[str]:
    """``main.py fit`` for ``steps`` optimizer steps on synthetic data, with ``options`` and ``callbacks``."""
    benchmark = [
        f"--data.batch_size={args.batch_size}",
        f"--trainer.accelerator={'cuda' if args.cuda else 'cpu'}",
        f"--data.num_workers={args.workers if args.cuda else 0}",
        f"--trainer.precision={precision}",
        f"--model.stem={args.stem}",
        f"--model.arch={args.arch}",
        "--model.warmup_epochs=0",
    ]
    return timed_fit_command(
        REPO / "main.py",
        [*benchmark, *options],
        folder,
        f"bench-{name}",
        steps,
        args.batch_size * processes * (steps + 1),
        callbacks,
    )


def measure(
    names: list[str],
    args: argparse.Namespace,
    keep_going: bool = False,
    after_round: Callable[[list[dict], int], None] | None = None,
    enough: Callable[[list[dict]], bool] | None = None,
) -> list[dict]:
    """Every configuration once per round, the rounds' orders rotated, so that a slow period of the machine falls
    on all of them alike; each row holds its median round's figures and the intervals of its rounds. It runs
    ``args.rounds`` rounds, and with ``enough`` more, until ``enough(rows)`` holds or ``args.max_rounds`` have run.
    A failed run ends the benchmark, or with ``keep_going`` becomes its configuration's row (the round and the line
    that says why), the configuration left out of later rounds; ``after_round`` gets the rows and the rounds
    finished."""
    table = configs(args.processes)
    threads = None if args.cuda else args.threads
    runs: dict[str, list[dict]] = {name: [] for name in names}
    failed: dict[str, dict] = {}
    rows: list[dict] = []
    planned = f"{args.rounds}" if enough is None else f"{args.rounds}-{args.max_rounds}"
    round_index = 0
    with tempfile.TemporaryDirectory() as tmp:
        while round_index < args.rounds or (enough and round_index < args.max_rounds and not enough(rows)):
            folder = Path(tmp) / f"round{round_index}"
            folder.mkdir()
            live = [name for name in names if name not in failed]
            shift = round_index % max(1, len(live))
            for name in live[shift:] + live[:shift]:
                out, log = folder / f"{name}.json", folder / f"{name}.log"
                try:
                    result = run(command(table[name], args, folder), out, log, threads, [HERE], REPO, args.timeout_s)
                except RunFailed as failure:
                    if not keep_going:
                        sys.exit(f"error: {failure}")
                    reason = str(failure) if "still running" in str(failure) else last_error(log.read_text())
                    failed[name] = {"name": name, "description": table[name].description, "failed_in_round":
                                    round_index + 1, "error": reason}  # fmt: skip
                    del runs[name]
                    print(f"  {name} failed: {reason}", flush=True)
                    continue
                runs[name].append(result)
            figures = ", ".join(f"{name} {runs[name][-1]['images_per_s']:.1f}" for name in runs)
            rows = [failed.get(name) or summary(name, table, runs, args.processes) for name in names]
            widest = f"; widest interval {spread(rows)}" if enough else ""
            print(f"  round {round_index + 1} of {planned} (img/s): {figures}{widest}", flush=True)
            round_index += 1
            if after_round is not None:
                after_round(rows, round_index)
    return rows


def widest_interval(rows: list[dict]) -> tuple[float, str]:
    """The largest distance from a ratio's median to an end of its interval, as a share of the median, and whose
    it is: what ``--within`` bounds. The ratios are the claims, each taken within a round so that the machine's
    drift from round to round cancels: a multi-process row's efficiency, another row's ratio to its plain loop (a
    multi-process row's own follows from the two), and a strategy's ratio to its plain PyTorch counterpart. A set
    without any (no plain loop, no one-process run, no counterpart) is judged by its images per second."""
    claims = [
        (name, row)
        for row in rows
        for name in ("efficiency" if row.get("efficiency") is not None else "vs_plain", "vs_peer")
    ]
    spans = [
        (row[name], row[f"{name}_interval"], f"{row['name']} {name.replace('_', ' ')}")
        for name, row in claims
        if row.get(name) is not None
    ] or [
        (row["images_per_s"], row["images_per_s_interval"], f"{row['name']} img/s")
        for row in rows
        if "error" not in row
    ]
    return max((max(median - low, high - median) / median, label) for median, (low, high), label in spans)


def claims_within(share: float) -> Callable[[list[dict]], bool]:
    """``--within``'s test of a round's rows: every claim's interval within ``share`` of its median."""
    return lambda rows: widest_interval(rows)[0] <= share


def spread(rows: list[dict]) -> str:
    share, label = widest_interval(rows)
    return f"±{share:.1%} of its median ({label})"


def summary(name: str, table: dict[str, Config], runs: dict[str, list[dict]], processes: int) -> dict:
    """``name``'s row: the figures of its median round, and the median and 95% interval of its images per second,
    of its ratio to its plain loop, of its scaling efficiency and of its ratio to its counterpart, each taken round
    by round."""
    config, own = table[name], [figures["images_per_s"] for figures in runs[name]]
    median_round = sorted(range(len(own)), key=own.__getitem__)[(len(own) - 1) // 2]
    row = {"name": name, "description": config.description, **runs[name][median_round]}
    throughput = median_interval(own)
    row["images_per_s_interval"] = [throughput.low, throughput.high]
    row["rounds_images_per_s"], row["interval_coverage"] = own, throughput.coverage
    pairs = {
        "vs_plain": (config.reference, 1) if name != config.reference else None,
        "efficiency": (config.one_process, processes) if config.multi_process else None,
        "vs_peer": (config.counterpart, 1) if config.counterpart else None,
    }
    for field_name, pair in pairs.items():
        row[field_name] = row[f"{field_name}_interval"] = None
        if pair is not None and pair[0] in runs:
            other = [figures["images_per_s"] for figures in runs[pair[0]]]
            ratio = median_interval([mine / (pair[1] * theirs) for mine, theirs in zip(own, other, strict=True)])
            row[field_name], row[f"{field_name}_interval"] = ratio.median, [ratio.low, ratio.high]
    return row


def print_table(rows: list[dict]) -> None:
    """Each figure of the median round; ratios as their median over the rounds, with their 95% interval."""

    def ratio(row: dict, name: str) -> str:
        if row[name] is None:
            return "-"
        low, high = row[f"{name}_interval"]
        return f"{row[name]:.3f} [{low:.3f}, {high:.3f}]"

    print(
        f"\n{'config':<22} {'img/s':>9} {'img/s interval':>17} {'step ms':>9} {'peak MiB':>16} "
        f"{'vs plain':>22} {'efficiency':>22} {'vs peer':>22}"
    )
    for row in rows:
        memory = "/".join(f"{value / 2**20:.0f}" for value in row["peak_memory_bytes"])
        low, high = row["images_per_s_interval"]
        print(
            f"{row['name']:<22} {row['images_per_s']:>9.1f} {f'[{low:.1f}, {high:.1f}]':>17} "
            f"{row['step_time_s'] * 1000:>9.1f} {memory:>16} {ratio(row, 'vs_plain'):>22} "
            f"{ratio(row, 'efficiency'):>22} {ratio(row, 'vs_peer'):>22}"
        )


def markdown(data: dict) -> str:
    """``throughput.json``'s table for the docs: each figure with its interval."""

    def with_interval(row: dict, name: str) -> str:
        if row.get(name) is None:
            return "- | -"
        low, high = row[f"{name}_interval"]
        return f"{row[name]:.3f} | {low:.3f}-{high:.3f}"

    settings, rows = data["settings"], data["results"]
    share, label = widest_interval(rows)
    peers = any(row.get("vs_peer") is not None for row in rows)  # a column only where a counterpart ran
    target = (
        f" (asked: ±{settings['within']:.1%}, in at most {settings['max_rounds']} rounds)" if settings["within"] else ""
    )
    lines = [
        f"{network_name(settings.get('arch', DEFAULT_ARCH), settings['stem'])}, batch {settings['batch_size']} per "
        f"process, {settings['precision']}, "
        f"{settings['warmup']} warm-up + {settings['steps']} timed steps, {data['rounds']} rounds in "
        f"{data['minutes']:.0f} minutes; each figure the median of its rounds, each interval holds that median "
        f"{rows[0]['interval_coverage']:.0%} of the time; the widest lies within ±{share:.1%} of its median "
        f"({label}){target}:",
        "",
        "| config | img/s | interval | vs plain | interval | efficiency | interval |"
        + (" vs peer | interval |" if peers else "")
        + " step ms | peak MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if peers else "") + " ---: | ---: |",
    ]
    for row in rows:
        low, high = row["images_per_s_interval"]
        memory = "/".join(f"{value / 2**20:,.0f}" for value in row["peak_memory_bytes"])
        lines.append(
            f"| {row['name']} | {row['images_per_s']:.1f} | {low:.1f}-{high:.1f} | {with_interval(row, 'vs_plain')} "
            f"| {with_interval(row, 'efficiency')} |"
            + (f" {with_interval(row, 'vs_peer')} |" if peers else "")
            + f" {row['step_time_s'] * 1000:,.0f} | {memory} |"
        )
    return "\n".join(lines) + "\n"


def write_chart(rows: list[dict], title: str, path: Path) -> None:
    notes = []
    for row in rows:
        parts = [f"{row['vs_plain']:.2f}x plain"] if row["vs_plain"] is not None else []
        parts += [f"eff. {row['efficiency']:.2f}"] if row["efficiency"] is not None else []
        parts += [f"{row['vs_peer']:.2f}x peer"] if row["vs_peer"] is not None else []
        notes.append(", ".join(parts))
    write_bar_chart(
        [row["name"] for row in rows],
        [row["images_per_s"] for row in rows],
        notes,
        title,
        path,
        grey=[row["name"].startswith("plain") for row in rows],
    )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of how each configuration runs, shared with ``memory.py``."""
    parser.add_argument(
        "--accelerator",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to train (auto: CUDA when it is visible)",
    )
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--stem", choices=["cifar", "imagenet"], default="cifar")
    parser.add_argument(
        "--arch",
        default=DEFAULT_ARCH,
        help="the network (--model.arch): a small one at a small batch shows the time each step spends outside it",
    )
    parser.add_argument("--threads", type=int, default=1, help="threads per process on the CPU")
    parser.add_argument("--workers", type=int, default=8, help="loader workers on GPUs")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="folder for JSON and PNG")


def add_round_options(parser: argparse.ArgumentParser, rounds: int) -> None:
    """How many rounds, and how long a run may take: shared with ``cuda_paths.py``."""
    parser.add_argument(
        "--rounds", type=int, default=rounds, help=f"runs of every configuration, interleaved (default {rounds})"
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="a run still going after this is stopped")


def check_rounds(args: argparse.Namespace) -> None:
    if args.rounds < 1:
        sys.exit("error: --rounds must be at least 1.")


def where(args: argparse.Namespace) -> str:
    """Set ``args.cuda`` from ``--accelerator``; the device in words."""
    args.cuda = args.accelerator == "cuda" or (args.accelerator == "auto" and torch.cuda.is_available())
    return torch.cuda.get_device_name(0) if args.cuda else this_cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", help="configurations to run, in order (default: see --list)")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument(
        "--processes",
        type=int,
        help="processes (devices) of the multi-process configurations (default: every GPU, at least 2; on the CPU 2)",
    )
    # On the CPU: the recipe's batch. With the freed memory kept (main.py, the plain loop) one process runs only its
    # first step slower (23 s against 19-21 at batch 128), but ddp rebuilds its gradient buckets at its second step
    # (in the order the first one's gradients came): its first step after one warm-up ran 7% and 13% slower than the
    # median of its later ones in two runs (docs/speed.md). Two warm-up steps leave it out of the timed steps.
    parser.add_argument("--batch-size", type=int, help="per process (default: 512 on GPUs, 128 on the CPU)")
    parser.add_argument("--steps", type=int, help="timed steps (default: 30 on GPUs, 3 on the CPU)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 10 on GPUs, 2 on the CPU)")
    add_round_options(parser, 5)
    parser.add_argument(
        "--within",
        type=float,
        default=0.03,
        help="after --rounds, more rounds until every claim's interval (an efficiency, a ratio to the plain loop) lies "
        "within this share of its median (default 0.03; 0: exactly --rounds)",
    )
    parser.add_argument(
        "--max-rounds", type=int, help="the most rounds --within runs (default: 20, or --rounds if more)"
    )
    add_run_options(parser)
    args = parser.parse_args()
    device = where(args)
    gpu_or_cpu = {
        "processes": (max(2, torch.cuda.device_count()), 2),
        "batch_size": (512, 128),
        "steps": (30, 3),
        "warmup": (10, 2),
    }
    for name, (gpu, cpu) in gpu_or_cpu.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu if args.cuda else cpu)
    table = configs(args.processes)
    if args.list:
        for config in table.values():
            print(f"{config.name:<22} {config.description}")
        return
    check_rounds(args)
    args.max_rounds = max(20, args.rounds) if args.max_rounds is None else args.max_rounds
    if args.within < 0 or (args.within and args.max_rounds < args.rounds):
        sys.exit("error: --within must be at least 0, and with it --max-rounds at least --rounds.")
    names = args.configs or default_configs(args.cuda)
    if unknown := [name for name in names if name not in table]:
        sys.exit(f"error: unknown configuration {unknown[0]!r}; --list shows them all.")
    title = (
        f"{network_name(args.arch, args.stem)}, batch {args.batch_size} per process, {args.precision}, {device}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, "
        + (
            f"{args.rounds} to {args.max_rounds} rounds, until within ±{args.within:.1%}"
            if args.within
            else f"{args.rounds} rounds"
        )
    )
    print(title, flush=True)
    # On the CPU, the cores before and after the rounds: another process on them is measured too, so it is said.
    start = time.monotonic()
    before = None if args.cuda else note_if_busy("throughput", "before the rounds")
    clock = None if args.cuda else read_cpu_clock()
    enough = claims_within(args.within) if args.within else None
    rows = measure(names, args, enough=enough)
    after = None if args.cuda else note_if_busy("throughput", "after the rounds", since=clock)
    minutes = (time.monotonic() - start) / 60
    print_table(rows)
    rounds = len(rows[0]["rounds_images_per_s"])
    print(f"\n{rounds} rounds in {minutes:.0f} minutes; widest interval {spread(rows)}", end="")
    if enough:
        wide = (
            f", not within ±{args.within:.1%} after --max-rounds {args.max_rounds}: raise it, or use a quieter machine"
        )
        print(f": within ±{args.within:.1%}" if enough(rows) else wide, end="")
    print()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    where_it_ran = machine(device)
    if before and after:
        where_it_ran["cores_share"] = {"before": round(before.share, 3), "after": round(after.share, 3)}
        where_it_ran["busy"] = before.busy or after.busy
        where_it_ran["stolen_share"] = None if after.stolen is None else round(after.stolen, 3)
    (args.out / "throughput.json").write_text(
        json.dumps(
            {"machine": where_it_ran, "settings": settings, "rounds": rounds, "minutes": minutes, "results": rows},
            indent=2,
        )
    )
    write_chart(rows, title, args.out / "throughput.png")
    print(f"\nwrote {args.out / 'throughput.json'} and {args.out / 'throughput.png'}")


if __name__ == "__main__":
    main()
