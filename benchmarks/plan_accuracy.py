"""How well ``plan`` forecasts: every layout measured, each forecast set against its measurement, in runs.

    python benchmarks/plan_accuracy.py                     # the smoke recipe on 2 CPU devices, 3 runs (25 minutes)
    python benchmarks/plan_accuracy.py --devices 4 --runs 5 --out docs/figures
    python benchmarks/plan_accuracy.py --plan-json logs/a/plan.json logs/b/plan.json   # plans of --plan.measure=all

It runs ``python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu
--trainer.devices=N --plan.measure=all --plan.budget_s=null`` ``--runs`` times (every layout profiled,
forecast and trained in each run), reads the ``plan.json`` each writes, and prints for every layout the
median over the runs of its forecast images per second, of its measured ones (each run's figure is the median of
its windows) and of the forecast's error in each run, with the order-statistic interval of each median
(``multigpu.timing.intervals``: with 3 runs, the lowest and the highest, which hold the true median 3 times in
4; with 5, 15 in 16). Below the table: the largest error of any layout in any run, the median error, the rank
correlation between the median forecasts and measurements (Spearman's), whether the layout forecast
fastest measured within the interval of the layout measured fastest, and how much the same layout's measurements
differed between runs (every pair of runs): the machine's own repeat, which a forecast made minutes before its
measurement meets too. Writes ``plan_accuracy.json`` (with each run's ``basis``, the profile and links its
forecasts came from), the table as
``plan_accuracy.md`` and the chart ``plan_accuracy.png`` (forecast against measured, with the
band of ``FORECAST_ERROR``) to ``--out``.
"""

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from machine import machine

from multigpu.planning.ranking import FORECAST_ERROR
from multigpu.timing.intervals import median_interval

REPO = Path(__file__).resolve().parents[1]


def ranks(values: Sequence[float]) -> list[float]:
    """Each value's rank from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks."""
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def accuracy(runs: list[list[dict]]) -> dict:
    """The figures of the module's docstring, from each run's ``plan.json`` results."""
    measured_in = [
        {row["layout"]: row for row in results if row.get("images_per_s") and row.get("forecast")} for results in runs
    ]
    layouts = [layout for layout in measured_in[0] if all(layout in run for run in measured_in)]
    rows = []
    for layout in layouts:
        own = [run[layout] for run in measured_in]
        forecast = median_interval([row["forecast"] for row in own])
        measured = median_interval([row["images_per_s"] for row in own])
        errors = [row["forecast"] / row["images_per_s"] - 1 for row in own]
        error = median_interval(errors)
        rows.append(
            {
                "layout": layout,
                "forecast": forecast.median,
                "forecast_interval": [forecast.low, forecast.high],
                "measured": measured.median,
                "interval": [measured.low, measured.high],
                "error": error.median,
                "error_interval": [error.low, error.high],
                "errors": errors,
                "measured_runs": [row["images_per_s"] for row in own],
                "coverage": measured.coverage,
            }
        )
    rows.sort(key=lambda row: -row["measured"])
    fastest = rows[0]
    forecast_best = max(rows, key=lambda row: row["forecast"])
    errors = [abs(error) for row in rows for error in row["errors"]]
    repeats = [max(pair) / min(pair) - 1 for row in rows for pair in itertools.combinations(row["measured_runs"], 2)]
    return {
        "runs": len(runs),
        "rows": rows,
        "largest_error": max(errors),
        "median_error": statistics.median(errors),
        "within_band": sum(error <= FORECAST_ERROR for error in errors),
        "measurements": len(errors),
        "spearman": spearman([row["forecast"] for row in rows], [row["measured"] for row in rows]),
        "forecast_best": forecast_best["layout"],
        "measured_best": fastest["layout"],
        "forecast_best_ties": forecast_best["interval"][1] >= fastest["interval"][0],
        "repeat_median": statistics.median(repeats) if repeats else None,
        "repeat_largest": max(repeats, default=None),
        "busy_measurements": sum(bool(run[layout].get("busy")) for run in measured_in for layout in layouts),
    }


def busy_line(figures: dict) -> str:
    """How many measurements ran on busy cores (``plan`` measures such a run again once where it can, then marks
    it), and how many plans forecast from a profile on busy cores (with ``--plan.if_busy=go``, or no time to
    profile again), or nothing."""
    said = []
    if busy := figures.get("busy_measurements"):
        said.append(
            f"{busy} of the {figures['measurements']} measurements ran on busy cores (another process, or a virtual "
            "machine's host stealing their time; `busy` in its plan.json) and measured that too"
        )
    if profiles := figures.get("busy_profiles"):
        said.append(f"{profiles} plan(s) forecast from a profile on busy cores (`basis.busy` in its plan.json)")
    return "; ".join(said)


def repeat_line(figures: dict) -> str:
    """How much the same layout's measurements differed between runs, or nothing with a single run."""
    if figures.get("repeat_median") is None:
        return ""
    return (
        f"the same layout measured in two runs differed by median {figures['repeat_median']:.0%}, largest "
        f"{figures['repeat_largest']:.0%}: the machine's own repeat, which a forecast made minutes before its "
        "measurement meets too"
    )


def _span(low: float, high: float, form: str = ".1f") -> str:
    return f"{low:{form}}..{high:{form}}"


def print_table(figures: dict) -> None:
    print(
        f"{'layout':<40} {'forecast':>9} {'measured':>9} {'interval':>11} {'error':>6} {'interval':>11}"
        f"   ({figures['runs']} runs, the intervals hold the median {figures['rows'][0]['coverage']:.0%} of the time)"
    )
    for row in figures["rows"]:
        print(
            f"{row['layout']:<40} {row['forecast']:>9.1f} {row['measured']:>9.1f} {_span(*row['interval']):>11} "
            f"{row['error']:>+6.0%} {_span(*row['error_interval'], '+.0%'):>11}"
        )
    print(
        f"\nlargest error {figures['largest_error']:.0%}, median {figures['median_error']:.0%} (every layout in every "
        f"run); {figures['within_band']} of {figures['measurements']} within {FORECAST_ERROR:.0%}; "
        f"rank correlation (Spearman) {figures['spearman']:.2f}"
    )
    ties = "within" if figures["forecast_best_ties"] else "outside"
    print(
        f"forecast fastest: {figures['forecast_best']}; measured fastest: {figures['measured_best']}; "
        f"the forecast fastest measured {ties} the fastest one's interval"
    )
    for line in (repeat_line(figures), busy_line(figures)):
        if line:
            print(line)


def markdown(figures: dict) -> str:
    """The table as Markdown, for docs/plan.md, and the figures below it."""
    lines = [
        f"{figures['runs']} runs of `plan`, each profiling, forecasting and measuring every layout anew; each figure "
        f"the median of the runs, each interval holds that median {figures['rows'][0]['coverage']:.0%} of the time:",
        "",
        "| layout | forecast img/s | measured img/s | interval | error | interval |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in figures["rows"]:
        lines.append(
            f"| {row['layout']} | {row['forecast']:.1f} | {row['measured']:.1f} | {_span(*row['interval'])} | "
            f"{row['error']:+.0%} | {_span(*row['error_interval'], '+.0%')} |"
        )
    ties = "within" if figures["forecast_best_ties"] else "outside"
    lines += [
        "",
        f"Largest error {figures['largest_error']:.0%}, median {figures['median_error']:.0%} (every layout in every "
        f"run); {figures['within_band']} of {figures['measurements']} within {FORECAST_ERROR:.0%}; rank correlation "
        f"(Spearman) {figures['spearman']:.2f}; forecast fastest: {figures['forecast_best']}, measured fastest: "
        f"{figures['measured_best']} (the forecast fastest measured {ties} its interval)."
        + "".join(f" {line[0].upper()}{line[1:]}." for line in (repeat_line(figures), busy_line(figures)) if line),
    ]
    return "\n".join(lines) + "\n"


def write_chart(figures: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figures["rows"]
    top = max(max(row["measured"] for row in rows), max(row["forecast"] for row in rows)) * 1.1
    figure, axes = plt.subplots(figsize=(7, 6))
    axes.plot([0, top], [0, top], color="#333333", linewidth=1, label="forecast = measurement")
    axes.fill_between(
        [0, top], [0, top * (1 - FORECAST_ERROR)], [0, top * (1 + FORECAST_ERROR)], color="#dddddd", label="±20%"
    )
    kinds = {"1 device": "#999999", "ddp": "#3b75af", "fsdp": "#8c564b", "model parallel": "#2ca02c"}
    for row in rows:
        kind = next((k for k in kinds if row["layout"].startswith(k)), "pipeline")
        low, high = row["interval"]
        axes.errorbar(
            row["measured"],
            row["forecast"],
            xerr=[[row["measured"] - low], [high - row["measured"]]],
            fmt="o",
            color=kinds.get(kind, "#ff7f0e"),
            markersize=4,
            label=kind,
        )
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left")
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.set_xlabel(f"measured images per second (median of {figures['runs']} runs; bars: its interval)")
    axes.set_ylabel("forecast images per second")
    axes.set_title(
        f"{title}\nSpearman {figures['spearman']:.2f}, largest error {figures['largest_error']:.0%}", fontsize=9
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plan_runs(devices: int, runs: int) -> list[Path]:
    """``plan`` over every layout, ``runs`` times; the ``plan.json`` of each."""
    paths = []
    for index in range(runs):
        name = f"plan-accuracy-{index + 1}"
        shutil.rmtree(REPO / "logs" / name, ignore_errors=True)
        command = [
            sys.executable,
            str(REPO / "main.py"),
            "plan",
            "--config",
            str(REPO / "configs" / "smoke.yaml"),
            "--trainer.accelerator=cpu",
            f"--trainer.devices={devices}",
            "--plan.measure=all",
            "--plan.budget_s=null",
            f"--run_name={name}",
        ]
        print(f"run {index + 1} of {runs}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, cwd=REPO, check=True)
        paths.append(REPO / "logs" / name / "plan.json")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices (processes) to plan for")
    parser.add_argument("--runs", type=int, default=3, help="runs of plan, each profiling and measuring anew")
    parser.add_argument("--plan-json", type=Path, nargs="+", help="read these plan.json instead of running plan")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for plan_accuracy.json and .png")
    args = parser.parse_args()
    if args.runs < 1:
        sys.exit("error: --runs must be at least 1.")
    paths = args.plan_json or plan_runs(args.devices, args.runs)
    plans = [json.loads(path.read_text()) for path in paths]
    figures = accuracy([plan["results"] for plan in plans])
    figures["busy_profiles"] = sum(bool((plan.get("basis") or {}).get("busy")) for plan in plans)
    print()
    print_table(figures)
    args.out.mkdir(parents=True, exist_ok=True)
    bases = [plan.get("basis") for plan in plans]
    data = {"machine": machine(), "title": plans[0]["title"], **figures, "bases": bases}
    (args.out / "plan_accuracy.json").write_text(json.dumps(data, indent=2))
    (args.out / "plan_accuracy.md").write_text(markdown(figures))
    write_chart(figures, f"plan's forecasts: {plans[0]['title']}", args.out / "plan_accuracy.png")
    print(f"\nwrote plan_accuracy.json, .md (the table) and .png in {args.out}")


if __name__ == "__main__":
    main()
