"""What a user's ``plan`` does: the smoke plan on 2 CPU devices, with its default time budget, in runs.

    python benchmarks/smoke_plan.py                 # 5 runs (about 10 minutes on 2 cores)
    python benchmarks/smoke_plan.py --runs 3 --out /tmp/smoke-plan

It runs ``python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu --trainer.devices=N``
``--runs`` times, as a user types it (the default ``--plan.budget_s``), and records of each run: its wall time,
Python's start included; how many layouts it chose to measure and how many it measured (the others named as left
by the time budget); each measured layout's forecast error (forecast over measured, minus one); the layout it
chose and whether it declared a tie. Writes ``smoke_plan.json`` (with the first run's printout) to ``--out``; its
``markdown`` is the paragraph of docs/plan.md that describes these runs.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from machine import machine

from multigpu.planning.intervals import median_interval

REPO = Path(__file__).resolve().parents[1]
PLAN = "python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu --trainer.devices={devices}"


def one_run(devices: int) -> dict:
    """One ``plan``, in an empty folder as a user's first: its time, what it measured and chose, its printout."""
    options = PLAN.format(devices=devices).split()[5:]
    command = [
        sys.executable,
        str(REPO / "main.py"),
        "plan",
        "--config",
        str(REPO / "configs" / "smoke.yaml"),
        *options,
    ]
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        result = subprocess.run(command, cwd=folder, stdout=subprocess.PIPE, text=True)
        seconds = time.monotonic() - started
        print(result.stdout, flush=True)
        if result.returncode != 0:
            sys.exit(f"error: {PLAN.format(devices=devices)} failed with exit status {result.returncode}: see above.")
        rows = json.loads((Path(folder) / "logs" / "smoke" / "plan.json").read_text())["results"]
    selected = re.search(r"^measuring (\d+) of (\d+) layouts(?:, within (\d+) s in all)?", result.stdout, re.M)
    left = re.search(r"not measured, the time budget spent: (.*) \(raise", result.stdout)
    measured = [row for row in rows if row["images_per_s"]]
    return {
        "seconds": seconds,
        "budget_s": float(selected[3]) if selected[3] else None,
        "layouts": len(rows),
        "selected": int(selected[1]),
        "measured": len(measured),
        "left_by_budget": left[1].split(", ") if left else [],
        "errors": {row["layout"]: row["forecast"] / row["images_per_s"] - 1 for row in measured if row["forecast"]},
        "chosen": next(row["layout"] for row in rows if row["chosen"]),
        "tied": [row["layout"] for row in measured if row["tied_with_fastest"] and not row["chosen"]],
        "busy": "the cores are busy" in result.stdout,
        "printout": result.stdout.strip(),
    }


def summary(runs: list[dict]) -> dict:
    """The figures over the runs that the docs quote."""
    seconds = median_interval([run["seconds"] for run in runs])
    errors = [(abs(error), layout) for run in runs for layout, error in run["errors"].items()]
    return {
        "seconds": [seconds.median, seconds.low, seconds.high],
        "seconds_coverage": seconds.coverage,
        "within_budget": sum(run["budget_s"] is None or run["seconds"] <= run["budget_s"] for run in runs),
        "largest_error": max(errors),
        "median_error": statistics.median(error for error, _ in errors),
        "within_10": sum(error <= 0.10 for error, _ in errors),
        "within_15": sum(error <= 0.15 for error, _ in errors),
        "errors": len(errors),
        "choices": Counter(run["chosen"] for run in runs).most_common(),
    }


def _choices(runs: list[dict]) -> str:
    """Which layout the runs chose, and with which ties."""
    parts = []
    for chosen, count in Counter(run["chosen"] for run in runs).most_common():
        own = [run for run in runs if run["chosen"] == chosen]
        alone = sum(not run["tied"] for run in own)
        tied = Counter(layout for run in own for layout in run["tied"])
        with_ties = ", ".join(f"{layout} in {n}" for layout, n in tied.most_common())
        alone_part = f", {alone} of them" if count > 1 else ""
        parts.append(
            f"{count} chose `{chosen}`"
            + (f"{alone_part} with no other range overlapping its range" if alone else "")
            + (f" (tied with {with_ties}, and the simplest)" if with_ties else "")
        )
    return "; ".join(parts)


def abridged(printout: str, measured: int) -> str:
    """``printout`` with its table cut after the measured layouts and the first one left (then the last one), and
    its fit options after the measured layouts'."""
    lines, kept, position = printout.splitlines(), [], 0
    while position < len(lines):
        line = lines[position]
        kept.append(line)
        position += 1
        if line.lstrip().startswith("#  layout"):
            table = []
            while position < len(lines) and lines[position].strip():
                table.append(lines[position])
                position += 1
            kept += table[: measured + 1]
            if len(table) > measured + 2:
                kept += [f"      ... ({len(table) - measured - 2} more, down to)", table[-1]]
            elif len(table) == measured + 2:
                kept.append(table[-1])
        elif line == "fit options:":
            options = []
            while position < len(lines) and lines[position].strip():
                options.append(lines[position])
                position += 1
            kept += options[:measured] + (["  ..."] if len(options) > measured else [])
    return "\n".join(kept)


def _span(counts: list[int]) -> str:
    return f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)} to {max(counts)}"


def markdown(data: dict) -> str:
    """The paragraph of docs/plan.md on these runs, and the first run's printout."""
    runs, figures = data["runs"], data["summary"]
    median, low, high = figures["seconds"]
    largest, worst = figures["largest_error"]
    budgets = {run["budget_s"] for run in runs}
    budget = f"{budgets.pop():.0f} s budget" if len(budgets) == 1 else "time budget"
    left = [len(run["left_by_budget"]) for run in runs]
    measured = [run["measured"] for run in runs]
    busy = sum(run["busy"] for run in runs)
    lines = [
        f"`{PLAN.format(devices=data['devices'])}` took {min(run['seconds'] for run in runs):.0f} to "
        f"{max(run['seconds'] for run in runs):.0f} s in {len(runs)} runs (median {median:.0f} s, interval "
        f"{low:.0f}-{high:.0f} s, {figures['seconds_coverage']:.0%}), Python's start included; "
        f"{figures['within_budget']} of {len(runs)} within its {budget}. Each measured {_span(measured)} of "
        f"{runs[0]['layouts']} layouts and named the {_span(left)} others that it had chosen to measure and the "
        f"budget left. Their forecasts were within 10% of the measured medians "
        f"{figures['within_10']} of {figures['errors']} times, within 15% {figures['within_15']} times (largest "
        f"{largest:.1%}, `{worst}`; median {figures['median_error']:.1%}). Of the {len(runs)} runs, "
        f"{_choices(runs)}." + (f" {busy} found the cores busy." if busy else ""),
        "",
        "The first printed:",
        "",
        "```",
        abridged(runs[0]["printout"], runs[0]["measured"]),
        "```",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices (processes) to plan for")
    parser.add_argument("--runs", type=int, default=5, help="runs of plan")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for smoke_plan.json")
    args = parser.parse_args()
    if args.runs < 1:
        sys.exit("error: --runs must be at least 1.")
    runs = []
    for index in range(args.runs):
        print(f"run {index + 1} of {args.runs}: {PLAN.format(devices=args.devices)}", flush=True)
        runs.append(one_run(args.devices))
    data = {"machine": machine(), "devices": args.devices, "runs": runs, "summary": summary(runs)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "smoke_plan.json").write_text(json.dumps(data, indent=2))
    print(markdown(data).split("\n\nThe first printed")[0])
    print(f"\nwrote smoke_plan.json in {args.out}")


if __name__ == "__main__":
    main()
