"""The package as a whole: its import graph has no cycle (module-level or deferred imports), it
knows its version, and it finds its shipped assets from a source checkout and from a wheel."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HANG_GUARD_S

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mem"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in it (a deferred import inside a
    function still makes a cycle: it only postpones the half-initialised module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            # `from pkg import module` needs the module; the package's own __init__ is already
            # initialising when one of its modules imports a sibling that way.
            found.update(submodules if submodules else {base})
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: _imports(path, name, known) for name, path in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import each other, directly or through others (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_sees_a_deferred_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_export_imports_the_checkpoint_format_not_the_fsdp2_strategy():
    graph = import_graph()
    assert "lightning_mem.checkpointing" in graph["lightning_mem.export"]
    assert "lightning_mem.strategies.fsdp2" not in graph["lightning_mem.export"]


def test_the_package_has_no_import_cycle():
    assert import_cycles(import_graph()) == []


# ---------------------------------------------------------------- version and shipped assets


def _pyproject_version() -> str:
    import tomllib

    return tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["version"]


def test_version_is_the_source_trees_own():
    import lightning_mem

    assert lightning_mem.__version__ == _pyproject_version()


def test_assets_are_the_projects_folder_through_the_package():
    from lightning_mem.assets import ASSETS, HUB_ASSETS, TINY_MODEL

    assert ASSETS.resolve() == (PACKAGE.parent / "assets").resolve()
    assert (TINY_MODEL / "tokenizer.json").is_file() and (HUB_ASSETS / "Qwen/Qwen2.5-1.5B/config.json").is_file()


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """The project built into a wheel (from a copy of its sources, offline) and installed with
    ``pip install --no-deps --target``: a site folder holding the package and nothing above it."""
    pytest.importorskip("setuptools", minversion="70.1")  # builds wheels without the `wheel` package
    root = tmp_path_factory.mktemp("wheel")
    source, dist, site = root / "source", root / "dist", root / "site"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PACKAGE.parent / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("lightning_mem", "recipes", "assets"):
        shutil.copytree(PACKAGE.parent / name, source / name, symlinks=True, ignore=ignore)
    build = "import sys, setuptools.build_meta as b; b.build_wheel(sys.argv[1])"
    subprocess.run([sys.executable, "-c", build, str(dist)], cwd=source, check=True, capture_output=True, timeout=HANG_GUARD_S)
    (wheel,) = dist.glob("lightning_mem-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=HANG_GUARD_S)
    return site


def test_an_installed_wheel_finds_its_assets_and_knows_its_version(installed_wheel, tmp_path):
    # Run away from the project (another cwd, the wheel first on the path): nothing of the source
    # tree may be reachable, so a lookup that assumed it would fail here.
    probe = (
        "import json, lightning_mem, lightning_mem.assets as a;"
        "print(json.dumps({'file': lightning_mem.__file__, 'version': lightning_mem.__version__,"
        " 'hub': sorted(str(p.relative_to(a.HUB_ASSETS)) for p in a.HUB_ASSETS.rglob('config.json')),"
        " 'tiny': sorted(p.name for p in a.TINY_MODEL.iterdir())}))"
    )
    env = {**os.environ, "PYTHONPATH": str(installed_wheel)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    got = json.loads(out.stdout)
    assert Path(got["file"]).is_relative_to(installed_wheel)
    assert got["version"] == _pyproject_version()  # from the wheel's metadata: no pyproject.toml is near
    shipped = PACKAGE.parent / "assets"
    assert got["hub"] == sorted(str(p.relative_to(shipped / "hub")) for p in (shipped / "hub").rglob("config.json"))
    assert got["tiny"] == sorted(p.name for p in (shipped / "tiny-llama").iterdir())


def test_the_estimators_hub_lookup_works_from_an_installed_wheel(installed_wheel, tmp_path):
    probe = (
        "from lightning_mem.estimate.recipe_config import config_folder;"
        "print(config_folder('meta-llama/Llama-3.1-8B', key='model.name_or_path'))"
    )
    env = {**os.environ, "PYTHONPATH": str(installed_wheel), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    folder = Path(out.stdout.strip().splitlines()[-1])
    assert folder.is_relative_to(installed_wheel) and (folder / "config.json").is_file()
