"""The package's shape: no module over 450 lines, no import circle, no ``sys.path`` edit, one ``__setattr__``.

Read from the source with ``ast`` (imports inside functions count), so a change that
tangles the modules again fails here, on a CPU.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "stagebuf"
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = ("stagebuf", *p.relative_to(PKG).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (``from . import x`` counts as module ``x`` when it is one)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for cand in (target, *(f"{target}.{a.name}" for a in node.names)):
                if cand in known and cand != name:
                    found.add(cand)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known and a.name != name}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (the package root, which re-exports everything, left out), or None."""
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u] - {"stagebuf"}):
            if state.get(v) == 1:
                return [*path[path.index(v) :], v]
            if not state.get(v) and (c := visit(v, path)):
                return c
        path.pop()
        state[u] = 2
        return None

    for m in sorted(graph):
        if m != "stagebuf" and not state.get(m) and (c := visit(m, [])):
            return c
    return None


def test_no_module_is_over_450_lines() -> None:
    long = {
        str(p.relative_to(PKG)): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_import_circle() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    assert graph["stagebuf._staged_write.fused"] >= {
        "stagebuf._staged_write.api",
        "stagebuf._staged_write.launcher",
    }
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def test_the_circle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "stagebuf": {"a"}}) is None


def test_no_sys_path_edit_and_one_setattr() -> None:
    setattrs = []
    for p in PKG.rglob("*.py"):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "sys"), (
                    f"sys.path in {p.name}"
                )
            if isinstance(node, ast.FunctionDef) and node.name == "__setattr__":
                setattrs.append(p.name)
    assert setattrs == ["_sealed.py"]
