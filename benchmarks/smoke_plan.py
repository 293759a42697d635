"""What a user's ``plan`` does: the smoke plan on 2 CPU devices, with its default time budget, in runs.

    python benchmarks/smoke_plan.py                 # 5 runs (about 10 minutes on 2 cores)
    python benchmarks/smoke_plan.py --runs 3 --out /tmp/smoke-plan

It runs ``python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu --trainer.devices=N``
``--runs`` times, as a user types it (the default ``--plan.budget_s``), and records of each run: its wall time,
Python's start included; how many layouts it chose to measure and how many it measured (the others named as left
by the time budget); each measured layout's forecast error (forecast over measured, minus one); the layout it
chose and whether it declared a tie; of a run that writes no plan (on busy cores ``plan`` may refuse), its time and
the reason; and when it began measuring (what ``plan`` prints, after Python's start-up, the profile and the links).
Writes ``smoke_plan.json`` (with the printouts) to ``--out``; its ``markdown`` is the paragraph of
docs/plan.md that describes these runs, with the first printout that chose a layout.
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

from multigpu.planning.ranking import FORECAST_ERROR
from multigpu.timing.intervals import median_interval

REPO = Path(__file__).resolve().parents[1]
PLAN = "python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu --trainer.devices={devices}"


def one_run(devices: int) -> dict:
    """One ``plan``, in an empty folder as a user's first: its time, what it measured and chose, its printout; a
    run that wrote no plan (refused on busy cores, every layout failed) keeps its time, printout and last line."""
    options = PLAN.format(devices=devices).split()[5:]
    command = [sys.executable, str(REPO / "main.py"), "plan", "--config", str(REPO / "configs" / "smoke.yaml")]
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        result = subprocess.run([*command, *options], cwd=folder, capture_output=True, text=True)
        seconds = time.monotonic() - started
        print(result.stdout, flush=True)
        # The configs' folder as the user types it: each run ran in an empty folder, given the folder's full path
        result.stdout = result.stdout.replace(f"{REPO / 'configs'}/", "configs/")
        plan_json = Path(folder) / "logs" / "smoke" / "plan.json"
        plan = json.loads(plan_json.read_text()) if plan_json.exists() else None
    busy = "the cores are busy" in result.stdout + result.stderr
    if result.returncode != 0 or plan is None:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"no plan written (exit status {result.returncode}): {last}", flush=True)
        return {"seconds": seconds, "refused": last, "busy": busy, "printout": result.stdout.strip()}
    rows = plan["results"]
    measured = [row for row in rows if row["images_per_s"]]
    began = re.search(r"^measuring \d+ of \d+ layouts.*\((\d+) s so far", result.stdout, re.MULTILINE)
    return {
        "seconds": seconds,
        "began_measuring_s": float(began.group(1)) if began else None,
        "budget_s": plan["budget_s"],
        "layouts": len(rows),
        "selected": sum(row["selected"] for row in rows),
        "measured": len(measured),
        "left_by_budget": [row["layout"] for row in rows if row["left_by_budget"]],
        "errors": {row["layout"]: row["error"] for row in measured if row["error"] is not None},
        "chosen": next(row["layout"] for row in rows if row["chosen"]),
        "tied": [row["layout"] for row in measured if row["tied_with_fastest"] and not row["chosen"]],
        "by_forecast": plan["chosen_by"] == "forecast",
        "busy": busy,
        "printout": result.stdout.strip(),
    }


def summary(runs: list[dict]) -> dict:
    """The figures over the runs that the docs quote: time over every run, the rest over those that chose."""
    seconds = median_interval([run["seconds"] for run in runs])
    chose = [run for run in runs if "chosen" in run]
    errors = [(error, layout) for run in chose for layout, error in run["errors"].items()]
    return {
        "seconds": [seconds.median, seconds.low, seconds.high],
        "seconds_coverage": seconds.coverage,
        "within_budget": sum(run["budget_s"] is None or run["seconds"] <= run["budget_s"] for run in chose),
        "largest_error": max(errors, key=lambda pair: abs(pair[0]), default=None),
        "median_error": statistics.median(abs(error) for error, _ in errors) if errors else None,
        "within_10": sum(abs(error) <= 0.10 for error, _ in errors),
        "within_15": sum(abs(error) <= 0.15 for error, _ in errors),
        "errors": len(errors),
        "refused": sum("refused" in run for run in runs),
        "began_measuring_s": [min(began), max(began)] if (began := _began(chose)) else None,
    }


def _began(runs: list[dict]) -> list[float]:
    """When each run began measuring, if every one said (runs before ``plan`` printed it did not)."""
    began = [run.get("began_measuring_s") for run in runs]
    return [] if None in began else began


def _choices(runs: list[dict]) -> str:
    """Which layout the runs chose, and with which ties."""
    parts = []
    for chosen, count in Counter(run["chosen"] for run in runs).most_common():
        own = [run for run in runs if run["chosen"] == chosen]
        by_forecast = sum(run.get("by_forecast", False) for run in own)  # runs before plan chose by forecast: none
        alone = sum(not run["tied"] for run in own) - by_forecast
        tied = Counter(layout for run in own for layout in run["tied"])
        with_ties = ", ".join(f"{layout} in {n}" for layout, n in tied.most_common())
        alone_part = f", {alone} of them" if count > 1 else ""
        parts.append(
            f"{count} chose `{chosen}`"
            + (f"{alone_part} with no other median within its range" if alone else "")
            + (f" (tied with {with_ties}, and the simplest)" if with_ties else "")
            + (f" ({by_forecast} by forecast: every layout measured on busy cores)" if by_forecast else "")
        )
    return "; ".join(parts)


def abridged(printout: str) -> str:
    """``printout`` with the list of layouts the budget left cut after two, its table after the measured layouts
    (those with a place) and the first one left (then the last one), and its fit options after the measured
    layouts'."""
    lines, kept, position, placed = printout.splitlines(), [], 0, 0
    while position < len(lines):
        line = lines[position]
        position += 1
        if line.lstrip().startswith("not measured, the time budget spent: "):
            head, names = line.split(": ", 1)
            names, rest = names.split(" (raise", 1)
            if names.count(", ") > 1:
                line = f"{head}: {', '.join(names.split(', ')[:2])}, ... (raise{rest}"
        kept.append(line)
        if line.lstrip().startswith("#  layout"):
            table = []
            while position < len(lines) and lines[position].strip():
                table.append(lines[position])
                position += 1
            placed = sum(row[:5].strip() != "" for row in table)
            kept += table[: placed + 1]
            if len(table) > placed + 2:
                kept += [f"      ... ({len(table) - placed - 2} more, down to)", table[-1]]
            elif len(table) == placed + 2:
                kept.append(table[-1])
        elif line == "fit options:":
            options = []
            while position < len(lines) and lines[position].strip():
                options.append(lines[position])
                position += 1
            kept += options[:placed] + (["  ..."] if len(options) > placed else [])
    return "\n".join(kept)


def _span(counts: list[int]) -> str:
    return f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)} to {max(counts)}"


def markdown(data: dict) -> str:
    """The paragraph of docs/plan.md on these runs, and the printout of the first run that chose a layout."""
    runs = data["runs"]
    figures = summary(runs)
    median, low, high = figures["seconds"]
    chose = [run for run in runs if "chosen" in run]
    text = (
        f"`{PLAN.format(devices=data['devices'])}` ran {len(runs)} times: median {median:.0f} s, interval "
        f"{low:.0f}-{high:.0f} s ({figures['seconds_coverage']:.0%}), Python's start included."
    )
    if figures["refused"]:
        reasons = Counter(run["refused"] for run in runs if "refused" in run)
        text += (
            f" {figures['refused']} wrote no plan: " + "; ".join(f"{n}x `{line}`" for line, n in reasons.items()) + "."
        )
    if not chose:
        return text + "\n"
    budgets = {run["budget_s"] for run in chose}
    if budgets != {None}:
        budget = f"{budgets.pop():.0f} s budget" if len(budgets) == 1 else "time budget"
        text += f" {figures['within_budget']} of {len(chose)} finished within its {budget}."
    if figures["began_measuring_s"]:
        began = _span([round(seconds) for seconds in figures["began_measuring_s"]])
        text += f" They began measuring {began} s after the start (Python's start-up, the profile and the links)."
    left = [len(run["left_by_budget"]) for run in chose]
    text += (
        f" Each chose {_span([run['selected'] for run in chose])} of {chose[0]['layouts']} layouts to measure (the "
        f"reference, the best forecast ones and every one forecast within {FORECAST_ERROR:.0%} of the best) and "
        f"measured {_span([run['measured'] for run in chose])}"
        + (f", leaving {_span(left)} to the time budget." if any(left) else ".")
    )
    if figures["errors"]:
        error, layout = figures["largest_error"]
        text += (
            f" Their forecasts were within 10% of the measured medians {figures['within_10']} of "
            f"{figures['errors']} times, within 15% {figures['within_15']} times (largest {error:+.1%}, `{layout}`; "
            f"median {figures['median_error']:.1%})."
        )
    busy = sum(run["busy"] for run in runs)
    text += f" Of the {len(chose)} that chose, {_choices(chose)}." + (f" {busy} found the cores busy." if busy else "")
    return "\n".join([text, "", "The first printed:", "", "```", abridged(chose[0]["printout"]), "```"]) + "\n"


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
