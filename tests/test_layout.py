"""The tree against the picture in docs/design.md §6: every import allowed by its table, and no
import cycle between modules (imports inside functions included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "inference", "tools", "agent_server")


def allowed_imports() -> dict[str, list[str]]:
    """unit -> the units it may import, from the table in docs/design.md §6."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## 6. Layout") : text.index("## 7.")]
    table = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([\w.]+)` \| (.*) \|$", line)
        if m:
            table[m.group(1)] = re.findall(r"`([\w.*]+)`", m.group(2))
    return table


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports, anywhere in its file (relative imports resolved)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `from a.b import C`: the module is a.b
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def unit_of(module: str, units) -> str:
    matches = [u for u in units if module == u or module.startswith(u + ".")]
    assert matches, f"{module} belongs to no unit of docs/design.md §6"
    return max(matches, key=len)


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_every_import_is_allowed_by_the_design():
    table = allowed_imports()
    assert {"schemas", "inference", "tools", "agent_server", "inference.engine"} <= set(table)
    wrong = []
    for module, targets in import_graph().items():
        unit = unit_of(module, table)
        for target in targets:
            target_unit = unit_of(target, table)
            ok = target_unit == unit or any(
                target_unit == a or (a.endswith(".*") and (target_unit == a[:-2] or target_unit.startswith(a[:-1])))
                for a in table[unit]
            )
            if not ok:
                wrong.append(f"{module} ({unit}) imports {target} ({target_unit})")
    assert not wrong, "imports the design does not allow:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = import_graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_a_bad_import(tmp_path, monkeypatch):
    """The two checks above fail on an upward import and on a cycle (so a pass means something)."""
    graph = {"inference.ops.rmsnorm": {"inference.engine.core"}, "inference.engine.core": {"inference.ops.rmsnorm"}}
    table = allowed_imports()
    assert unit_of("inference.ops.rmsnorm", table) == "inference.ops"
    assert "inference.engine" not in table["inference.ops"]
    monkeypatch.setattr("tests.test_layout.import_graph", lambda: graph)
    import pytest

    with pytest.raises(AssertionError, match="imports the design does not allow"):
        test_every_import_is_allowed_by_the_design()
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles()
