"""Does the application learn as well as a plain PyTorch loop? Both train from the same weights, seed by seed.

    python benchmarks/learning.py --seeds 1 2 3                 # the subset, the recipe of docs/learning.md (~50 min)
    python benchmarks/learning.py --protocol paired --seeds 1 2 3 4 5

For each seed, interleaved, it writes torchvision ``resnet50(num_classes=10)`` weights drawn from that seed, then
trains from them (one process each, one after the other):

- ``app``: ``python main.py fit --config configs/subset.yaml`` with ``--seed_everything SEED`` and
  ``--model.init_from`` those weights; its figures come from its TensorBoard logs;
- ``plain`` (``--protocol paired``): ``benchmarks/plain_cifar10.py`` on the app's order of the images and
  augmentation seeds (``--order app``): the same images, augmented the same way, so that any difference is
  the training's, not the data's draw;
- ``plain`` (``--protocol independent``): the same loop on its own ``DataLoader(shuffle=True)`` order and
  augmentation, as people write it: the difference then includes the draw of the data, which moves a run's
  best accuracy by several points on this subset.

It prints each run's best top-1 on the test split, and per protocol the mean difference (app minus plain)
with its 95% interval (Student's t over the seeds), and writes ``learning.json`` and ``learning.png`` (loss
and accuracy per epoch, both sides) under ``--out``.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torchvision
from machine import machine

REPO = Path(__file__).resolve().parents[1]
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def interval(differences: list[float]) -> tuple[float, float, float]:
    """Mean and 95% interval of the mean (Student's t); a single value has no interval (its bounds are the value)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return mean, mean, mean
    half = T95.get(len(differences) - 1, 1.96) * statistics.stdev(differences) / len(differences) ** 0.5
    return mean, mean - half, mean + half


def app_figures(logs: Path) -> list[dict]:
    """Per epoch: the mean training loss over its steps and the validation (test split) top-1, from TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(logs.rglob("events.out.tfevents.*")).parent)).Reload()
    # The run's logger writes ``epoch`` once per epoch, at the epoch's first step: an epoch's steps run from there to
    # the next epoch's first. Each epoch ends with one validation, in order.
    starts = sorted((event.step, int(event.value)) for event in events.Scalars("epoch"))
    losses: dict[int, list[float]] = {}
    for event in events.Scalars("train/loss"):
        epoch = max((epoch for start, epoch in starts if start <= event.step), default=0)
        losses.setdefault(epoch, []).append(event.value)
    validations = sorted(events.Scalars("val/acc"), key=lambda event: event.step)
    accuracy = {epoch: event.value for epoch, event in enumerate(validations)}
    return [
        {"epoch": epoch, "train_loss": statistics.fmean(values), "test_acc": accuracy.get(epoch)}
        for epoch, values in sorted(losses.items())
    ]


def run(command: list[str], log: Path) -> None:
    with open(log, "w") as file:
        result = subprocess.run(command, cwd=REPO, stdout=file, stderr=subprocess.STDOUT)
    if result.returncode:
        sys.exit(f"error: {' '.join(command[:3])} ... failed; its output is in {log}")


def train_app(args, seed: int, init: Path, out: Path) -> list[dict]:
    name = f"app-seed{seed}"
    shutil.rmtree(out / "runs" / name, ignore_errors=True)
    run(
        [
            sys.executable, "main.py", "fit", "--config", "configs/subset.yaml", f"--seed_everything={seed}",
            f"--model.init_from={init}", f"--model.stem={args.stem}", f"--data.data_dir={args.data_dir}",
            f"--data.batch_size={args.batch_size}", f"--trainer.max_epochs={args.epochs}",
            f"--model.warmup_epochs={args.warmup_epochs}", "--trainer.accelerator=cpu", f"--run_name={name}",
            "--trainer.log_every_n_steps=1",  # every step's loss, for the epoch's mean the plain loop reports
            f"--checkpoint_root={out / 'runs' / name / 'checkpoints'}",
            f"--trainer.default_root_dir={out / 'runs' / name / 'logs'}",
        ],
        out / f"{name}.log",
    )  # fmt: skip
    shutil.rmtree(out / "runs" / name / "checkpoints")  # ResNet-50 checkpoints: only the logs are read
    return app_figures(out / "runs" / name / "logs")


def train_plain(args, seed: int, init: Path, out: Path, protocol: str) -> list[dict]:
    name = f"plain-{protocol}-seed{seed}"
    order = ["--order=app", f"--shuffle-seed={seed}"] if protocol == "paired" else ["--order=shuffle"]
    run(
        [
            sys.executable, "benchmarks/plain_cifar10.py", f"--data-dir={args.data_dir}", f"--epochs={args.epochs}",
            f"--batch-size={args.batch_size}", f"--warmup-epochs={args.warmup_epochs}", f"--stem={args.stem}",
            f"--seed={seed}", f"--init={init}", *order, f"--out={out / (name + '.json')}",
        ],
        out / f"{name}.log",
    )  # fmt: skip
    return json.loads((out / f"{name}.json").read_text())["epochs"]


def best(epochs: list[dict]) -> float:
    return max(row["test_acc"] for row in epochs if row.get("test_acc") is not None)


def markdown(data: dict) -> str:
    """``learning.json``'s tables: each run's best top-1, and each protocol's difference with its interval."""
    seeds, sides = data["recipe"]["seeds"], ["app", *(f"plain-{protocol}" for protocol in data["summary"])]
    best_of = {(run["side"], run["seed"]): run["best_acc"] for run in data["runs"]}
    lines = ["| seed | " + " | ".join(sides) + " |", "| --- |" + " ---: |" * len(sides)]
    lines += [f"| {seed} | " + " | ".join(f"{best_of[side, seed]:.4f}" for side in sides) + " |" for seed in seeds]
    means = [statistics.fmean(best_of[side, seed] for seed in seeds) for side in sides]
    lines += ["| mean | " + " | ".join(f"{mean:.4f}" for mean in means) + " |", ""]
    lines += [
        f"| protocol | application minus plain, mean (points) | 95% interval (Student's t, {len(seeds)} seeds) |",
        "| --- | ---: | ---: |",
    ]
    for protocol, figures in data["summary"].items():
        low, high = figures["interval"]
        lines.append(f"| {protocol} | {figures['mean_difference']:+.2f} | {low:+.2g} to {high:+.2g} |")
    return "\n".join(lines) + "\n"


def draw(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, acc_axis) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {seed: f"C{i}" for i, seed in enumerate(sorted({r["seed"] for r in runs}))}
    styles = {"app": "-", "plain-paired": "--", "plain-independent": ":"}
    for entry in runs:
        epochs = [row["epoch"] + 1 for row in entry["epochs"]]
        label = f"{entry['side']} seed {entry['seed']}"
        style = dict(color=colours[entry["seed"]], linestyle=styles[entry["side"]], label=label)
        loss_axis.plot(epochs, [row["train_loss"] for row in entry["epochs"]], **style)
        acc_axis.plot(epochs, [row["test_acc"] for row in entry["epochs"]], **style)
    loss_axis.set(xlabel="epoch", ylabel="training loss (mean over the epoch)", yscale="log")
    acc_axis.set(xlabel="epoch", ylabel="test top-1")
    acc_axis.legend(fontsize=7, ncol=2)
    figure.suptitle("the application (solid) against a plain PyTorch loop from the same weights")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = os.environ.get("MULTIGPU_CIFAR10_SUBSET", str(REPO.parent / "shared" / "data" / "cifar10-subset"))
    parser.add_argument("--data-dir", default=default_data, help="the folder that holds cifar-10-batches-py/")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--protocol", choices=["paired", "independent", "both"], default="both")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--warmup-epochs", type=float, default=2.0)
    parser.add_argument("--stem", choices=["cifar", "imagenet"], default="imagenet")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "learning"))
    args = parser.parse_args()
    if not (Path(args.data_dir) / "cifar-10-batches-py").is_dir():
        sys.exit(f"error: no cifar-10-batches-py/ in {args.data_dir}: point --data-dir at the folder that holds it.")
    args.data_dir = str(Path(args.data_dir).resolve())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    protocols = ["paired", "independent"] if args.protocol == "both" else [args.protocol]

    runs = []
    for seed in args.seeds:  # interleaved: a slow period of the machine falls on both sides of a seed
        torch.manual_seed(seed)
        init = out / f"init-seed{seed}.pt"
        torch.save(torchvision.models.resnet50(num_classes=10).state_dict(), init)
        sides = [("app", lambda: train_app(args, seed, init, out))]
        sides += [(f"plain-{p}", lambda p=p: train_plain(args, seed, init, out, p)) for p in protocols]
        for side, train in sides:
            epochs = train()
            runs.append({"seed": seed, "side": side, "best_acc": best(epochs), "epochs": epochs})
            print(f"seed {seed} {side:18} best top-1 {runs[-1]['best_acc']:.4f}", flush=True)

    best_of = {(r["side"], r["seed"]): r["best_acc"] for r in runs}
    summary = {}
    print(f"\n{'protocol':12} {'app mean':>9} {'plain mean':>11} {'app - plain':>12}  95% interval (points)")
    for protocol in protocols:
        differences = [100 * (best_of["app", s] - best_of[f"plain-{protocol}", s]) for s in args.seeds]
        mean, low, high = interval(differences)
        app_mean = statistics.fmean(best_of["app", s] for s in args.seeds)
        plain_mean = statistics.fmean(best_of[f"plain-{protocol}", s] for s in args.seeds)
        summary[protocol] = {"mean_difference": mean, "interval": [low, high], "differences": differences,
                             "app_mean": app_mean, "plain_mean": plain_mean}  # fmt: skip
        print(f"{protocol:12} {app_mean:9.4f} {plain_mean:11.4f} {mean:+12.2f}  [{low:+.2f}, {high:+.2f}]")
    recipe = {key: getattr(args, key) for key in ("epochs", "batch_size", "warmup_epochs", "stem", "seeds")}
    data = {"machine": machine(), "recipe": recipe, "summary": summary, "runs": runs}
    (out / "learning.json").write_text(json.dumps(data, indent=1))
    draw(runs, out / "learning.png")
    print(f"wrote {out / 'learning.json'} and {out / 'learning.png'}")


if __name__ == "__main__":
    main()
