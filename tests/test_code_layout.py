"""The code's layout, as docs/code-layout.md promises it: no import cycle, and no private torch or Lightning name
outside the compat module."""

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

from helpers import REPO

SOURCE = REPO / "src" / "multigpu"
FOREIGN = ("torch", "torchvision", "lightning")
PUBLIC_PYTHON = {"os._exit"}  # Python's own, public despite the underscore


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Our modules that ``path`` imports, anywhere in it (inside functions too), with the packages that run first."""
    this = _module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                for alias in node.names
            ]
        for name in names:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                module = ".".join(parts[:end])
                if module in MODULES and not (this == module or this.startswith(module + ".")):
                    found.add(module)
    return found


def test_no_module_imports_itself_through_others():
    graph = {module: _imports(path) for module, path in MODULES.items()}
    cycles = []

    def visit(module: str, trail: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in trail:
                cycles.append(" -> ".join([*trail[trail.index(imported) :], imported]))
            elif imported not in done:
                visit(imported, [*trail, imported])
        done.add(module)

    done: set[str] = set()
    for module in MODULES:
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _foreign_names(cls: type) -> set[str]:
    """The private names the torch or Lightning classes that ``cls`` derives from define or set on ``self``."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in FOREIGN:
            names |= {name for name in vars(base) if _private(name)}
            try:
                names |= set(re.findall(r"self\.(_\w+)", inspect.getsource(base)))
            except (OSError, TypeError):
                pass
    return names


def _loaded(path: Path):
    """The module in ``path``, a file outside the package (a test's probe)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def private_names_used(paths: list[Path]) -> list[str]:
    """``file:line: what`` for each private torch, torchvision or Lightning name the files use: imported, read on an
    object, or overridden or read on ``self`` in a class derived from theirs."""
    trees = {path: ast.parse(path.read_text()) for path in paths}
    ours, found = set(), []
    for path, tree in trees.items():
        module = importlib.import_module(_module_name(path)) if path.is_relative_to(SOURCE) else None
        if not path.is_relative_to(REPO):  # a test's probe
            module = _loaded(path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _private(node.name):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                ours.add(node.id)
            elif isinstance(node, ast.ClassDef):
                cls = getattr(module, node.name, None)
                foreign = _foreign_names(cls) if isinstance(cls, type) else set()
                for inner in ast.walk(node):
                    name = (
                        inner.name
                        if isinstance(inner, ast.FunctionDef)
                        else (
                            inner.attr
                            if isinstance(inner, ast.Attribute)
                            and isinstance(inner.value, ast.Name)
                            and inner.value.id == "self"
                            else None
                        )
                    )
                    if name and _private(name):
                        if name in foreign:
                            found.append(f"{_shown(path)}:{inner.lineno}: {name}, of {cls.__mro__[1].__name__}")
                        else:
                            ours.add(name)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
                names = [part for part in node.module.split(".") if _private(part)]
                names += [alias.name for alias in node.names if _private(alias.name)]
                found += [f"{_shown(path)}:{node.lineno}: {name}, from {node.module}" for name in names]
            elif isinstance(node, ast.Import):
                found += [
                    f"{_shown(path)}:{node.lineno}: {alias.name}"
                    for alias in node.names
                    if alias.name.split(".")[0] in FOREIGN and any(map(_private, alias.name.split(".")))
                ]
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
                on = node.value.id if isinstance(node.value, ast.Name) else None
                if on != "self" and f"{on}.{node.attr}" not in PUBLIC_PYTHON:
                    found.append(f"{_shown(path)}:{node.lineno}: .{node.attr}")
    return sorted(set(found))


def test_no_private_torch_or_lightning_name_outside_the_compat_module():
    paths = [path for path in MODULES.values() if path.name != "compat.py"]
    paths += [*sorted((REPO / "benchmarks").glob("*.py")), REPO / "main.py"]
    used = private_names_used(paths)
    assert not used, "private torch/Lightning names outside multigpu/compat.py (put them there):\n" + "\n".join(used)


def test_the_private_name_check_finds_one(tmp_path):
    """The check above, on a file that reads a private Lightning attribute and overrides a private torch method."""
    path = tmp_path / "private_name_probe.py"
    path.write_text(
        "from torch import nn\n\nclass Probe(nn.Module):\n    def _apply(self, fn, recurse=True):\n"
        "        return self\n\ndef stop(trainer):\n    trainer._signal_connector.received_sigterm = True\n"
    )
    used = private_names_used([path])
    assert [entry.split(": ", 1)[1] for entry in used] == ["_apply, of Module", "._signal_connector"]


def test_docs_testing_lists_every_test_beside_its_promise():
    """docs/testing.md's table (``scripts/testing_table.py``) names every test of tests/, each once, and no other."""
    spec = importlib.util.spec_from_file_location("testing_table", REPO / "scripts" / "testing_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    listed = table.table_rows((REPO / "docs" / "testing.md").read_text())
    assert sorted(listed) == sorted(table.test_functions()), "run python scripts/testing_table.py"
    assert all(row[0] and row[2] for row in listed.values())  # each with its promise and network


def _strategy_probes(path: Path) -> list[str]:
    """``getattr``/``hasattr`` calls on a strategy (an expression named ``strategy`` or ending in ``.strategy``) in
    ``path``, but of Lightning's ``cluster_environment``: what ``contracts.Parallelism`` states instead."""
    probes = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target, name = node.args[0], node.args[1] if len(node.args) > 1 else None
            on_strategy = (isinstance(target, ast.Name) and target.id == "strategy") or (
                isinstance(target, ast.Attribute) and target.attr == "strategy"
            )
            if on_strategy and not (isinstance(name, ast.Constant) and name.value == "cluster_environment"):
                probes.append(f"{path.name}:{node.lineno}")
    return probes


def test_run_and_cli_read_strategies_through_the_written_contract_not_by_probing(tmp_path):
    probes = [probe for folder in ("run", "cli") for path in (SOURCE / folder).rglob("*.py") for probe in
              _strategy_probes(path)]  # fmt: skip
    assert probes == []
    probing = tmp_path / "probing.py"
    probing.write_text("micro_batches = getattr(trainer.strategy, 'micro_batches', 1)\n")
    assert _strategy_probes(probing) == ["probing.py:1"]  # the check finds one


def test_planning_knows_no_strategy_by_name():
    """``plan`` asks every registered strategy's ``Layout`` class (``strategies/layouts/``) and compares no name."""
    from multigpu.strategies.layouts import PLANNED_STRATEGIES

    named = [
        f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}"
        for path in (SOURCE / "planning").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in PLANNED_STRATEGIES
    ]
    assert named == []
