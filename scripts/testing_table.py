"""Write docs/testing.md's table of promises: each test of tests/, the promise its name states, the network it trains
and its seconds in a run of the suite.

    pytest -n 2 --dist loadfile --durations=0 | tee durations.log
    python scripts/testing_table.py durations.log

The seconds are the items' own (setup, call and teardown, every parametrisation together) from the log's
``--durations=0`` lines; without a log, the table keeps the seconds it has. The network is read from the test's
source, and from the fixtures it asks for: the names below, "tiny ResNet" where it takes ``helpers.run_args`` and
names no other network, then "none" (a test that trains nothing, or builds no network).
tests/test_code_map.py checks that the table names every test and no other.
"""

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTING = REPO / "docs" / "testing.md"
BEGIN, END = "<!-- promises -->", "<!-- end promises -->"

# What a test's source says, the network it trains: the first of each group that matches.
NETWORKS = [
    (
        # A benchmark's harness trains its default, ResNet-50, unless the test names another (--arch=).
        r"RESNET50|resnet50_|models\.resnet50|ImageClassifier\((?!arch)[^)]*\)|\"(throughput|memory|pipeline_efficiency|"
        r"learning)\.py\"(?![\s\S]*\"--arch=)|PLAIN",
        "ResNet-50",
    ),
    (r"resnet18", "ResNet-18"),
    (r"mobilenet_v3_small", "MobileNet V3"),
    (r"convnext_tiny", "ConvNeXt-Tiny"),
    (r"_resumable_run|bottleneck_|tiny_resnet|TINY\b", "tiny ResNet"),
    (r"ARCHS|network_training", "every torchvision family, small"),
    (r"train_setup|_train\(|layout_training|bare_trainer|strategy_training", "small blocks"),
]


def test_functions() -> dict[str, ast.FunctionDef]:
    """``file.py::name`` of every test function, with its definition."""
    found = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found[f"{path.name}::{node.name}"] = node
    return found


def _fixture_sources() -> dict[str, str]:
    """Every fixture of tests/ by name: its source."""
    sources = {}
    for path in sorted((REPO / "tests").glob("*.py")):
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in node.decorator_list):
                sources[node.name] = ast.get_source_segment(text, node) or ""
    return sources


def network(test: ast.FunctionDef, source: str, fixtures: dict[str, str]) -> str:
    text = source + "".join(fixtures.get(argument.arg, "") for argument in test.args.args)
    names = [name for pattern, name in NETWORKS if re.search(pattern, text)]
    if not names and "run_args" in text:  # its network, unless the test names another after it
        names = ["tiny ResNet"]
    return " + ".join(dict.fromkeys(names)) or "none"


def promise(name: str) -> str:
    words = name.removeprefix("test_").replace("_", " ")
    return words[0].upper() + words[1:]


def seconds_of(log: str) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for found, nodeid in re.findall(r"^([\d.]+)s (?:call|setup|teardown)\s+tests/(\S+)", log, re.MULTILINE):
        test = nodeid.split("[")[0]
        seconds[test] = seconds.get(test, 0.0) + float(found)
    return seconds


def table_rows(page: str) -> dict[str, list[str]]:
    """The table's rows now, by test."""
    rows = {}
    for line in page.partition(BEGIN)[2].partition(END)[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`"):
            rows[cells[1].strip("`")] = cells
    return rows


def main(log: Path | None) -> None:
    page = TESTING.read_text()
    kept = table_rows(page)
    seconds = seconds_of(log.read_text()) if log else {}
    fixtures = _fixture_sources()
    lines = ["| promise | test | network | seconds |", "| --- | --- | --- | ---: |"]
    for test, node in test_functions().items():
        path = REPO / "tests" / test.split("::")[0]
        source = ast.get_source_segment(path.read_text(), node) or ""
        time = f"{seconds[test]:.1f}" if test in seconds else (kept[test][3] if test in kept else "")
        lines.append(f"| {promise(node.name)} | `{test}` | {network(node, source, fixtures)} | {time} |")
    before, _, rest = page.partition(BEGIN)
    after = rest.partition(END)[2]
    TESTING.write_text(f"{before}{BEGIN}\n{chr(10).join(lines)}\n{END}{after}")
    print(f"wrote {len(lines) - 2} promises into {TESTING}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
