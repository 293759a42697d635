"""The code's map, as docs/code-map.md promises it: no import cycle, and no private torch or Lightning name
outside the compat module."""

import ast
import importlib
import importlib.util
import inspect
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import HELPERS_ENV, REPO, SMOKE, run_args, run_cli

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


def test_no_package_imports_one_that_imports_it():
    """The packages and the foundations form layers (docs/code-map.md): no package reaches, through others, one
    that reaches it, so that nothing imports back up."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        top = module.split(".")[1] if "." in module else module
        graph.setdefault(top, set()).update(
            name.split(".")[1] for name in _imports(path) if "." in name and name.split(".")[1] != top
        )
    reached = {}
    for package in graph:
        seen, todo = set(), [package]
        while todo:
            for other in graph.get(todo.pop(), ()):
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        reached[package] = seen
    circles = sorted(package for package in graph if package in reached[package])
    assert not circles, f"packages that import themselves through others: {circles}"


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


def _constants(paths, names) -> list[str]:
    """``file:line: 'name'`` for each string constant among ``names`` in ``paths``, but the packages' names in
    ``strategies.PACKAGES`` (the registration: a package's name may be its strategy's)."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        registration = {
            id(constant)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["PACKAGES"]
            for constant in ast.walk(node.value)
        }
        found += [
            f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in registration
        ]
    return found


def test_each_strategy_is_named_only_inside_its_own_package_and_plan_names_none():
    """Our strategies' names appear as strings only in their own packages (each states its ``SPECS``); ``plan`` asks
    every strategy's ``Layout`` class through ``SPECS`` and compares no name, Lightning's ``ddp`` included."""
    from multigpu.strategies import PLANNED_STRATEGIES, SPECS

    for spec in SPECS:
        if spec.strategy is None:
            continue
        home = SOURCE / "strategies" / spec.strategy.__module__.split(".")[2]
        elsewhere = [path for path in SOURCE.rglob("*.py") if home not in path.parents]
        assert _constants(elsewhere, {spec.name}) == [], spec.name
    assert _constants((SOURCE / "planning").rglob("*.py"), set(PLANNED_STRATEGIES)) == []


def test_the_readme_table_of_strategies_is_the_one_the_specs_make():
    from multigpu.strategies import strategies_table

    assert strategies_table() in (REPO / "README.md").read_text()


TOY_STRATEGY = '''"""``toy``: one device under a name of its own, added as a new strategy is (docs/code-map.md)."""

from lightning.pytorch.strategies import SingleDeviceStrategy

from multigpu.strategies.layout import Layout
from multigpu.strategies.spec import StrategySpec


class ToyStrategy(SingleDeviceStrategy):
    """One device, by another name."""

    strategy_name = "toy"


class ToyLayout(Layout):
    @classmethod
    def offered(cls, request, refuse):
        return [cls(cls.strategy, 1, 1, request.batch_size)]

    def step_seconds(self, forward, backward, update, links, memory, profile):
        return sum(forward) + sum(backward) + sum(update)


SPECS = (StrategySpec(ToyStrategy.strategy_name, "one device", layout=ToyLayout, strategy=ToyStrategy),)
'''


@pytest.mark.slow
def test_a_new_strategy_is_one_package_and_one_name_and_fit_and_plan_find_it(tmp_path):
    """The steps of docs/code-map.md on a copy of the package: a folder under strategies/ and its name in
    ``PACKAGES``; then ``fit --trainer.strategy=toy`` trains with it, and ``plan`` offers its layout."""
    copy = tmp_path / "src" / "multigpu"
    shutil.copytree(SOURCE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "strategies" / "toy").mkdir()
    (copy / "strategies" / "toy" / "__init__.py").write_text(TOY_STRATEGY)
    registry = copy / "strategies" / "__init__.py"
    packages = re.search(r"^PACKAGES = \((.*)\)$", registry.read_text(), re.MULTILINE)
    registry.write_text(registry.read_text().replace(packages[1], packages[1] + ', "toy"'))
    env = {"PYTHONPATH": os.pathsep.join([str(copy.parent), HELPERS_ENV["PYTHONPATH"]])}

    fit = run_cli("fit", "--config", SMOKE, *run_args(tmp_path), "--trainer.strategy=toy", env=env, fresh=True)
    assert fit.returncode == 0, fit.stdout
    saved = torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt", weights_only=True)
    assert saved["multigpu"]["strategy"] == "ToyStrategy"  # the record of how the run trained
    plan = run_cli(
        "plan", "--config", SMOKE, *run_args(tmp_path), "--trainer.devices=1", "--plan.dry_run=true",
        "--plan.strategies=[toy]", "--plan.if_busy=go", env=env, fresh=True,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout
    assert re.search(r"^\s+toy\s+[\d.]+\s+-", plan.stdout, re.MULTILINE), plan.stdout


def _option_names() -> set[str]:
    """Every name an option goes by: a section of a command's config and each option of its own (what
    ``add_argument``, ``add_lightning_class_args`` and ``add_class_arguments`` give, and ``subcommand``); each
    parameter of the model, the data module, Lightning's ``Trainer``, ``plan`` and our strategies (``--model.*``,
    ``--data.*``, ``--trainer.*``, ``--plan.*``, ``--trainer.strategy.*``); and the two sections of a checkpoint
    that hold saved options."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry

    from multigpu.data.datamodule import ImageDataModule
    from multigpu.model.classifier import ImageClassifier
    from multigpu.planning.options import PlanOptions

    importlib.import_module("multigpu.strategies")  # registers ours
    names = {"subcommand", "hyper_parameters", "datamodule_hyper_parameters"}
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                given = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
                if node.func.attr == "add_argument":
                    names |= {name.lstrip("-") for name in given if name.startswith("--")}
                elif node.func.attr in ("add_lightning_class_args", "add_class_arguments"):
                    names |= set(given)
    ours = [entry["strategy"] for entry in StrategyRegistry.values()]
    ours = [strategy for strategy in ours if strategy.__module__.startswith("multigpu.")]
    for cls in (ImageClassifier, ImageDataModule, Trainer, PlanOptions, *ours):
        names |= set(inspect.signature(cls).parameters) - {"self", "args", "kwargs"}
    return names


def option_reads(paths: list[Path], names: set[str]) -> list[str]:
    """The string-key reads of options in ``paths``: a subscript ``x["name"]`` that is read (not assigned), or a call
    ``x.get("name", ...)`` or ``x.pop("name", ...)``, whose key is the literal name of an option (``_option_names``),
    or a dotted path through one (jsonargparse's ``config["trainer.num_nodes"]``).

    The rule looks at the key, not at what holds it: renaming ``config`` or ``hparams`` hides nothing, and a dict whose
    keys are options is one of options whatever it is called (Lightning's registry entry ``["strategy"]`` and a
    torch parameter group's ``["lr"]`` count too). Builders that read a dict by their fields' names
    (``dataclasses.fields``) have no literal key, so what is left are the reads written out by hand."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key = node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                key = node.args[0] if node.func.attr in ("get", "pop") else None
            else:
                continue
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and names & set(key.value.split(".")):
                found.append(f"{_shown(path)}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


# 169 at ca48a3c; issue 90 asks for 20 at most. What is left: the sections of a config where the typed objects are
# built from them, a checkpoint's sections where its saved options are read, and keys that are options' names but
# not options (a Lightning registry entry, CIFAR's pickle).
MOST_OPTION_READS = 19


def test_options_are_read_as_typed_attributes_not_string_keys(tmp_path):
    """Options become typed objects where they enter (the CLI's config, a checkpoint's saved options, a plan's
    config): at most ``MOST_OPTION_READS`` string-key reads of them are left in ``src/`` (``option_reads``)."""
    names = _option_names()
    reads = option_reads(sorted(SOURCE.rglob("*.py")), names)
    assert len(reads) <= MOST_OPTION_READS, f"{len(reads)} string-key reads of options:\n" + "\n".join(reads)
    probe = tmp_path / "renamed.py"
    probe.write_text("size = settings['batch_size'] + settings.get('max_epochs', 1)\nsettings['batch_size'] = 1\n")
    assert len(option_reads([probe], names)) == 2  # the check finds them under any name
