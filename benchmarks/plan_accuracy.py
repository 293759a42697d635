"""How well ``plan`` forecasts: every layout measured, each forecast set against its measurement.

    python benchmarks/plan_accuracy.py                     # the smoke recipe on 2 CPU devices (about 6 minutes)
    python benchmarks/plan_accuracy.py --devices 4 --out docs/figures
    python benchmarks/plan_accuracy.py --plan-json logs/smoke/plan.json    # a plan run with --plan.measure=all

It runs ``python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu
--trainer.devices=N --plan.measure=all --plan.budget_s=null`` (every layout trained, as ``plan`` did before it
forecast), reads the ``plan.json`` it writes, and prints for every layout its forecast
images per second, the measured median and range of its windows, and the forecast's error.
Below the table: the largest and the median error, the rank correlation between forecasts and
measurements (Spearman's), and whether the layout forecast fastest measured within the tie
interval of the layout measured fastest. Writes ``plan_accuracy.json``, the table as
``plan_accuracy.md`` and the chart ``plan_accuracy.png`` (forecast against measured, with the
band of ``FORECAST_ERROR``) to ``--out``.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from multigpu.planning.ranking import FORECAST_ERROR

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


def accuracy(results: list[dict]) -> dict:
    """The figures of the module's docstring, from ``plan.json``'s results."""
    rows = [
        {
            "layout": row["layout"],
            "forecast": row["forecast"],
            "measured": row["images_per_s"],
            "interval": row["interval"],
            "error": row["forecast"] / row["images_per_s"] - 1,
        }
        for row in results
        if row.get("images_per_s") and row.get("forecast")
    ]
    rows.sort(key=lambda row: -row["measured"])
    fastest = rows[0]
    forecast_best = max(rows, key=lambda row: row["forecast"])
    errors = [abs(row["error"]) for row in rows]
    return {
        "rows": rows,
        "largest_error": max(errors),
        "median_error": statistics.median(errors),
        "within_band": sum(error <= FORECAST_ERROR for error in errors),
        "spearman": spearman([row["forecast"] for row in rows], [row["measured"] for row in rows]),
        "forecast_best": forecast_best["layout"],
        "measured_best": fastest["layout"],
        "forecast_best_ties": forecast_best["interval"][1] >= fastest["interval"][0],
    }


def print_table(figures: dict) -> None:
    print(f"{'layout':<44} {'forecast':>9} {'measured':>9} {'range':>13} {'error':>7}")
    for row in figures["rows"]:
        low, high = row["interval"]
        print(
            f"{row['layout']:<44} {row['forecast']:>9.1f} {row['measured']:>9.1f} "
            f"{f'{low:.1f}-{high:.1f}':>13} {row['error']:>+7.0%}"
        )
    count = len(figures["rows"])
    print(
        f"\nlargest error {figures['largest_error']:.0%}, median {figures['median_error']:.0%}; "
        f"{figures['within_band']} of {count} within {FORECAST_ERROR:.0%}; "
        f"rank correlation (Spearman) {figures['spearman']:.2f}"
    )
    ties = "within" if figures["forecast_best_ties"] else "outside"
    print(
        f"forecast fastest: {figures['forecast_best']}; measured fastest: {figures['measured_best']}; "
        f"the forecast fastest measured {ties} the fastest one's range"
    )


def markdown(figures: dict) -> str:
    """The table as Markdown, for docs/plan.md."""
    lines = ["| layout | forecast img/s | measured img/s | range | error |", "| --- | ---: | ---: | ---: | ---: |"]
    for row in figures["rows"]:
        low, high = row["interval"]
        lines.append(
            f"| {row['layout']} | {row['forecast']:.1f} | {row['measured']:.1f} | {low:.1f}-{high:.1f} | "
            f"{row['error']:+.0%} |"
        )
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
    axes.set_xlabel("measured images per second (median of the windows; bars: slowest to fastest)")
    axes.set_ylabel("forecast images per second")
    axes.set_title(
        f"{title}\nSpearman {figures['spearman']:.2f}, largest error {figures['largest_error']:.0%}", fontsize=9
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices (processes) to plan for")
    parser.add_argument("--plan-json", type=Path, help="read this plan.json instead of running plan")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for plan_accuracy.json and .png")
    args = parser.parse_args()
    if args.plan_json is None:
        run = REPO / "logs" / "plan-accuracy"
        shutil.rmtree(run, ignore_errors=True)
        command = [
            sys.executable,
            str(REPO / "main.py"),
            "plan",
            "--config",
            str(REPO / "configs" / "smoke.yaml"),
            "--trainer.accelerator=cpu",
            f"--trainer.devices={args.devices}",
            "--plan.measure=all",
            "--plan.budget_s=null",
            "--run_name=plan-accuracy",
        ]
        subprocess.run(command, cwd=REPO, check=True)
        args.plan_json = run / "plan.json"
    plan = json.loads(args.plan_json.read_text())
    figures = accuracy(plan["results"])
    print()
    print_table(figures)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_accuracy.json").write_text(json.dumps({"title": plan["title"], **figures}, indent=2))
    (args.out / "plan_accuracy.md").write_text(markdown(figures))
    write_chart(figures, f"plan's forecasts: {plan['title']}", args.out / "plan_accuracy.png")
    print(f"\nwrote plan_accuracy.json, .md (the table) and .png in {args.out}")


if __name__ == "__main__":
    main()
