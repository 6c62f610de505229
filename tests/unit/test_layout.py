"""The package's shape: rooms by concept, imports only downward, no private name across rooms.

Rooms, each a folder of ``src/stagebuf``, lowest first (``ROOMS``): ``_common``, ``_device`` (host and
device memory, the UVA view), ``_tiers`` (deciding the tier), ``_bytes`` (the per-tier buffers, moving
bytes), ``_rings`` (the slot rings and their users), ``_engines`` (the integrations), ``_tools`` (doctor,
the command line) beside the public faces. Read from the source with ``ast`` (imports inside functions
count), so a change that tangles the rooms fails here, on a CPU. No import circle, no ``sys.path`` edit,
one ``__setattr__``, no module reading another's private members, no tier branch above the tier rooms.
A module is as long as its one concept needs: there is no line cap.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "stagebuf"


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


ROOMS = ("_common", "_device", "_tiers", "_bytes", "_rings", "_engines", "_tools")
"""The floors, lowest first: a room imports only from itself and the floors below it."""
FACES = {"stagebuf", "stagebuf.nanovllm", "stagebuf.__main__"}
"""The public faces: the top floor, beside ``_tools`` (doctor and the command line)."""


def _room(module: str) -> str | None:
    if module in FACES:
        return ROOMS[-1]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def _private_imports(name: str, path: Path, known: set[str]) -> set[tuple[str, str]]:
    """(module, name) for every underscore name ``name`` imports from another package module."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
            target = ".".join([*base, *([node.module] if node.module else [])])
            for a in node.names:
                if (
                    a.name.startswith("_")
                    and not a.name.startswith("__")
                    and f"{target}.{a.name}" not in known
                ):
                    found.add((target, a.name))
    return found


def test_every_module_lives_in_a_room() -> None:
    loose = [m for m in _modules() if m not in {f"stagebuf.{r}" for r in ROOMS} and not _room(m)]
    assert not loose, f"modules outside the rooms {ROOMS}: {loose}"


def _upward(mods: dict[str, Path]) -> list[str]:
    bad = []
    for m, p in mods.items():
        if m in FACES:
            continue
        for dep in _imports(m, p, set(mods)):
            r_from, r_to = _room(m), _room(dep)
            if dep == f"stagebuf.{r_to}":  # a room's (empty) package
                continue
            if ROOMS.index(r_to) > ROOMS.index(r_from or ""):
                bad.append(f"{m} -> {dep}")
    return bad


def test_rooms_import_only_downward() -> None:
    bad = _upward(_modules())
    assert not bad, f"imports from a higher room: {bad}"


def test_no_private_name_crosses_a_room() -> None:
    mods = _modules()
    bad = []
    for m, p in mods.items():
        for target, nm in _private_imports(m, p, set(mods)):
            if _room(target) != _room(m) and m not in FACES:
                bad.append(f"{m} imports {target}.{nm}")
    assert not bad, f"private names across rooms: {bad}"


def _private_members(name: str, path: Path, known: set[str]) -> set[str]:
    """``alias._x`` uses in ``name`` where ``alias`` is another package module it imported."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
            target = ".".join([*base, *([node.module] if node.module else [])])
            for a in node.names:
                if f"{target}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        if node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.add(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_reads_another_modules_private_members() -> None:
    mods = _modules()
    bad = {m: sorted(f) for m, p in mods.items() if (f := _private_members(m, p, set(mods)))}
    assert not bad, f"private members of other modules: {bad}"


def test_the_room_checks_can_fail(tmp_path: Path) -> None:
    """A probe importing a ring's module, and a private name taken from another room, are both found."""
    probe, pool = tmp_path / "probe.py", tmp_path / "pool.py"
    probe.write_text("from .._rings.pool import _secret\nfrom .._rings import pool\nx = pool._cache\n")
    pool.write_text("_secret = 1\n")
    mods = {"stagebuf._tiers.probe": probe, "stagebuf._rings.pool": pool}
    assert _upward(mods) == ["stagebuf._tiers.probe -> stagebuf._rings.pool"]
    got = _private_imports("stagebuf._tiers.probe", probe, set(mods))
    assert got == {("stagebuf._rings.pool", "_secret")}
    mods["stagebuf._rings"] = pool  # (a package: makes ``pool`` a module name for the resolver)
    assert _private_members("stagebuf._tiers.probe", probe, set(mods)) == {"stagebuf._rings.pool._cache"}


def test_no_import_circle() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    assert graph["stagebuf._rings.staged_write.writers"] >= {
        "stagebuf._rings.staged_write.staging",
        "stagebuf._rings.staged_write.launcher",
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
    assert setattrs == ["sealed.py"]


TIER_ROOMS = ("_common", "_device", "_tiers", "_bytes")
"""Where the tier is decided and carried: every module above them asks a buffer (its flags, ``uva()``,
``poison()``, ``fallback()``) instead of branching on the tier."""


def _tier_branches(path: Path) -> list[str]:
    """Tier members named (``Tier.HOST``), a tier's flags read (``x.tier.copies``), or a tier compared
    (``x.tier is y``) in ``path``; reading ``x.tier.name`` for a report is not a branch."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            v = node.value
            if isinstance(v, ast.Name) and v.id == "Tier" and node.attr.isupper():
                found.append(f"{path.name}:{node.lineno} Tier.{node.attr}")
            elif isinstance(v, ast.Attribute) and v.attr == "tier" and node.attr != "name":
                found.append(f"{path.name}:{node.lineno} .tier.{node.attr}")
        elif isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if any(isinstance(x, ast.Attribute) and x.attr == "tier" for x in sides):
                found.append(f"{path.name}:{node.lineno} compares a .tier")
    return sorted(found)


def test_only_the_tier_rooms_branch_on_the_tier() -> None:
    bad = [b for m, p in _modules().items() if _room(m) not in TIER_ROOMS for b in _tier_branches(p)]
    assert not bad, f"tier branches outside {TIER_ROOMS}: {bad}"


def test_the_tier_branch_check_can_fail(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("if buf.tier is Tier.HOST or ring.tier.copies:\n    x = caps.tier.name\n")
    assert _tier_branches(p) == ["m.py:1 .tier.copies", "m.py:1 Tier.HOST", "m.py:1 compares a .tier"]


TIER_FILES = ("_common/tier.py", "_bytes/buffers.py", "_tiers/probe.py")
"""Where a tier is named: its name and flags, its buffer class, when it works. Adding one touches these."""


def test_a_tier_is_named_in_three_files() -> None:
    named = {
        p.relative_to(PKG).as_posix()
        for p in _modules().values()
        if any(" Tier." in b for b in _tier_branches(p))
    }
    assert named == set(TIER_FILES), f"tier members named in {sorted(named)}; expected only {TIER_FILES}"


def test_no_private_name_crosses_a_module() -> None:
    """Stricter than the rooms: a name another module imports is that module's public name."""
    mods = _modules()
    bad = [f"{m} imports {t}.{nm}" for m, p in mods.items() for t, nm in _private_imports(m, p, set(mods))]
    assert not bad, f"private names imported from another module: {bad}"
