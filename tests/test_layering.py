"""The package's layering, read from its source: no import cycle (imports inside functions
included) and no module too big to hold in one's head (docs/design.md, "Layers"); docs that
describe what is."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import fsdp_compile

pytestmark = pytest.mark.structure

PACKAGE = Path(fsdp_compile.__file__).parent
MAX_MODULE_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports anywhere in its body. ``from package import
    name`` counts as importing the submodule ``name`` where there is one, else the package."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            found.update(submodules if len(submodules) == len(node.names) else {base, *submodules})
    return (found & modules) - {name}


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as the modules along it, or [] when there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once explored
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return [*path[path.index(imported) :], imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        state[module] = "done"
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def test_the_package_has_no_import_cycle():
    """Records at the bottom, ``fully_shard`` orchestrating, the compiler apart: a module
    never reaches itself through its imports, lazy ones included (a function-level import
    that closes a cycle still ties the modules along it into one)."""
    cycle = _a_cycle(_graph())
    assert not cycle, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_lazy_import_cycle():
    """The check above can fail: imports inside functions are read (simulate.py imports the
    test transformer inside a function only), and a cycle one closes is found."""
    graph = _graph()
    assert "fsdp_compile.testing.models" in graph["fsdp_compile.simulate"]
    graph["fsdp_compile.records"] = graph["fsdp_compile.records"] | {"fsdp_compile.api"}
    cycle = _a_cycle(graph)
    assert cycle[0] == cycle[-1] and {"fsdp_compile.api", "fsdp_compile.records"} <= set(cycle), cycle


def test_no_module_is_over_450_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES}, sorted(sizes.items(), key=lambda x: -x[1])[:5]


def test_the_performance_doc_holds_current_numbers_in_at_most_400_lines_and_no_commit_names():
    """docs/performance.md is the current numbers, not their history (git keeps that), and no
    doc or the README names a commit (issue 38, item 6): a hash goes stale as the code moves."""
    root = PACKAGE.parent
    assert len((root / "docs" / "performance.md").read_text().splitlines()) <= 400
    hashes = {
        str(doc.relative_to(root)): [
            word for word in re.findall(r"\b[0-9a-f]{7,40}\b", doc.read_text())
            if re.search(r"[a-f]", word) and re.search(r"[0-9]", word)  # not a number, not a word
        ]
        for doc in [root / "README.md", *(root / "docs").glob("*.md")]
    }
    assert not {doc: found for doc, found in hashes.items() if found}, hashes
