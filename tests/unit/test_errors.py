"""One exception base: everything stagebuf raises for its own conditions is a StagebufError,
and keeps the builtin parent that ``except`` clauses written before it expect.

That nothing else escapes a misuse of a public object is checked by behaviour, in
``test_misuse.py`` (it replaced a scan of the source for ``raise Name(...)``, which missed
``buf.device = x`` raising a bare AttributeError from a helper). That every StagebufError
subclass the package raises (or builds to raise) is exported is read from the source with
``ast``, as ``test_layout.py`` reads the imports.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import stagebuf
from stagebuf import (
    DeviceParamTable,
    StagebufError,
    StagedWriteTensor,
    StepStager,
    UvaBufferPool,
)


def test_every_exported_exception_has_the_base():
    classes = [getattr(stagebuf, n) for n in stagebuf.__all__]
    errors = [c for c in classes if isinstance(c, type) and issubclass(c, BaseException)]
    assert len(errors) >= 14
    for c in errors:
        assert issubclass(c, StagebufError), c
        builtin = {ValueError, TypeError, RuntimeError, AttributeError, KeyError}
        assert c is StagebufError or c is stagebuf.SetupError or builtin & set(c.__mro__), c


MISUSES = [
    pytest.param(lambda: UvaBufferPool(-1, torch.int32), ValueError, id="pool-size-negative"),
    pytest.param(lambda: UvaBufferPool(4, "no-such-dtype"), TypeError, id="pool-bad-dtype"),
    pytest.param(lambda: StagedWriteTensor((4, 4), torch.int8), ValueError, id="sw-dtype"),
    pytest.param(lambda: StepStager(capacity=0), ValueError, id="stager-capacity"),
    pytest.param(lambda: DeviceParamTable(2, {"a": torch.int32}, "cpu")["b"], KeyError, id="table-field"),
]


@pytest.mark.parametrize(("call", "builtin"), MISUSES)
def test_misuse_raises_the_base_and_the_builtin(cpu_tier, call, builtin):
    with pytest.raises(StagebufError) as ei:
        call()
    assert isinstance(ei.value, builtin)


def test_order_and_attribute_misuse(cpu_tier):
    stager = StepStager()
    st = stager.step()
    with pytest.raises(StagebufError) as ei:
        stager.step()  # the step before is still open
    assert isinstance(ei.value, RuntimeError) and "still open" in str(ei.value)
    st.flush()
    with pytest.raises(StagebufError) as ei:
        st.stage(np.arange(3))  # a flushed step
    assert isinstance(ei.value, RuntimeError)
    with pytest.raises(StagebufError) as ei:
        stager.device = torch.device("cpu")  # looks writable, would be ignored
    assert isinstance(ei.value, AttributeError)


def test_buffer_attributes_refuse_writes_with_the_base_error(cpu_tier) -> None:
    """buf.device = x raises ReadOnlyAttributeError (a StagebufError), not a bare AttributeError."""
    buf = stagebuf.make_buffer(4, torch.int32)
    for name, value in (("device", torch.device("cpu")), ("tier", stagebuf.Tier.HOST), ("shape", (8,))):
        with pytest.raises(stagebuf.ReadOnlyAttributeError, match=f"{name} is read-only") as e:
            setattr(buf, name, value)
        assert isinstance(e.value, stagebuf.StagebufError) and isinstance(e.value, AttributeError)
    with pytest.raises(stagebuf.ReadOnlyAttributeError, match="cannot be deleted"):
        del buf.dev


def test_an_unknown_field_raises_the_same_error_both_ways(cpu_tier) -> None:
    table = stagebuf.DeviceParamTable(4, {"top_k": torch.int32})
    for get in (lambda: table["topk"], lambda: table.fields["topk"]):
        with pytest.raises(stagebuf.UnknownFieldError, match="no field 'topk'; fields: top_k") as e:
            get()
        assert isinstance(e.value, KeyError)
    assert table.fields["top_k"] is table["top_k"] and list(table.fields) == ["top_k"]
    assert len(table.fields) == 1 and "top_k" in table.fields


# --- every error type the package makes is exported ------------------------------------------

PKG = Path(__file__).resolve().parents[2] / "src" / "stagebuf"


def _package_sources() -> dict[str, str]:
    """Module name -> source, for every module of the package."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = ("stagebuf", *p.relative_to(PKG).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p.read_text()
    return out


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _made_name(node: ast.AST) -> str | None:
    """The name that ``X(...)`` calls or ``raise X`` raises, if ``node`` is one of them."""
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Raise) and node.exc is not None:
        return _name(node.exc)
    return None


def made_errors(sources: dict[str, str]) -> dict[str, str]:
    """The StagebufError subclasses that ``sources`` raise or build (``raise X(...)``, ``raise X``, or
    ``X(...)`` made to be raised by a caller), each with the module that defines it."""
    defined: dict[str, tuple[str, set[str]]] = {}
    made: set[str] = set()
    for mod, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                defined[node.name] = (mod, {n for b in node.bases if (n := _name(b))})
            elif n := _made_name(node):
                made.add(n)
    errors = {"StagebufError"}
    while grown := {c for c, (_, bases) in defined.items() if bases & errors} - errors:
        errors |= grown
    return {c: defined[c][0] for c in sorted(errors & made)}


def _all_of(source: str) -> set[str]:
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_name(t) == "__all__" for t in targets) and node.value is not None:
                return set(ast.literal_eval(node.value))
    return set()


def unexported(sources: dict[str, str]) -> list[str]:
    """The errors of ``made_errors`` missing from their public module's ``__all__``: ``stagebuf``
    for those defined in a private module, else the (public) module that defines them."""
    out = []
    for name, mod in made_errors(sources).items():
        public = "stagebuf" if any(p.startswith("_") for p in mod.split(".")) else mod
        if name not in _all_of(sources[public]):
            out.append(f"{name} (defined in {mod}, not in {public}.__all__)")
    return out


def test_every_error_the_package_raises_is_exported() -> None:
    sources = _package_sources()
    made = made_errors(sources)
    some = {"SettingValueError", "UnknownDeviceError", "StagedWriteError", "NanoVllmVersionError"}
    assert some <= set(made), set(made)
    assert not unexported(sources)
    for name, mod in made.items():
        public = stagebuf if mod.startswith("stagebuf._") else importlib.import_module(mod)
        assert getattr(public, name) is getattr(importlib.import_module(mod), name), name


def test_the_export_check_can_fail() -> None:
    """An error dropped from ``__all__``, or a new one raised but not exported, is reported."""
    sources = _package_sources()
    dropped, n = re.subn(r'"SettingValueError",\s*', "", sources["stagebuf"])
    assert n == 1
    cut = dict(sources, stagebuf=dropped)
    assert unexported(cut) == [
        "SettingValueError (defined in stagebuf._common.errors, not in stagebuf.__all__)"
    ]
    late = (
        "from ._common.errors import UsageError\n\n"
        "class LateError(UsageError):\n    pass\n\nraise LateError('x')\n"
    )
    assert unexported(dict(sources, **{"stagebuf._late": late})) == [
        "LateError (defined in stagebuf._late, not in stagebuf.__all__)"
    ]
    # built by a helper, raised by its caller
    built = late.replace("raise LateError('x')", "def f():\n    return LateError('x')")
    assert unexported(dict(sources, **{"stagebuf._late": built}))
    unused = late.replace("raise LateError('x')", "")
    assert not unexported(dict(sources, **{"stagebuf._late": unused}))
