"""``stagebuf doctor``: what this machine can do, the tier chosen, and why.

A setting that cannot work (any ``STAGEBUF_*``, or ``--device``) gets one screen naming the setting, cause,
allowed values and fix (``--json``: an object with ``error``, ``kind`` and ``fix``) and exit status 2, never a
traceback; its headline says whether the value is not a valid one (a typo: no machine takes it) or one this
machine cannot serve. A reader that closes the pipe early ends it quietly. ``rich`` draws the table where
installed. Below the table: every binding the vLLM plugin replaces, per vLLM module; nano-vllm's row says
whether the installed package imports, and if not, why and what to do.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from .. import __version__, nanovllm
from .._bytes.buffers import tier_class
from .._common.errors import SettingValueError, SetupError, UnknownDeviceError
from .._engines import vllm as _vllm
from .._engines.vllm_check import REPLACED
from .._rings.staged_write.kernel import triton_usable
from .._tiers.capabilities import Capabilities, torch_build
from .._tiers.probe import capabilities
from .._tiers.settings import (
    ENV_CHECK,
    ENV_KERNEL,
    ENV_QUARANTINE,
    ENV_TIER,
    ENV_VLLM,
    ENV_WSL_PIN,
    MAX_QUARANTINE,
    check_mode,
    quarantine,
    quarantine_cost,
    write_kernel,
)


@dataclass(frozen=True)
class Problem:
    """A setting that stops the probe, explained for a person and for a machine."""

    setting: str
    """The environment variable (``STAGEBUF_TIER``, ``STAGEBUF_VLLM``, ...) or ``--device``."""
    value: str
    error: str
    """What was asked and why it cannot work here, in one sentence."""
    cause: str | None
    allowed: tuple[str, ...]
    fix: str
    invalid: bool = False
    """The value is not one the setting takes (a typo), rather than one this machine cannot serve."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "kind": "invalid_value" if self.invalid else "unavailable",
            "setting": self.setting,
            "value": self.value,
            "cause": self.cause,
            "allowed": list(self.allowed),
            "fix": self.fix,
            "stagebuf": __version__,
            "torch": torch.__version__,
            "torch_build": torch_build(),
            "cuda_available": torch.cuda.is_available(),
        }


def _problem(e: SetupError) -> Problem:
    error = e.problem + (f": {e.cause}" if e.cause else "")
    invalid = isinstance(e, (SettingValueError, UnknownDeviceError))  # no machine takes the value
    if e.setting == "device":
        allowed = ("(omit --device)", *e.allowed)
        fix = (
            "omit --device (stagebuf then uses the current accelerator, else the CPU) or pass "
            f"one of: {', '.join(e.allowed)}"
        ) + (f"; or {e.hint}" if e.hint else "")
        error = error.replace(f"device={e.value!r}", f"--device {e.value}", 1)
        return Problem("--device", str(e.value), error, e.cause, allowed, fix, invalid)
    setting = e.setting or ENV_TIER
    return Problem(setting, str(e.value), error, e.cause, e.allowed, e.fix or "see the error", invalid)


def diagnose(device: str | None = None) -> Capabilities | Problem:
    """The capabilities of ``device``, or the Problem that stops the probe or the vLLM plugin's ``plan()``."""
    try:
        caps = capabilities(device)
        _vllm.plan()
    except SetupError as e:
        return _problem(e)
    return caps


def _limit(v: int | None) -> str:
    return "unlimited" if v is None else f"{v} bytes ({v / (1 << 20):.1f} MiB)"


def build_text(build: str) -> str:
    """``build``, and whether a GPU build sees its GPU: "CUDA 13.0 build (sees no driver or GPU)"."""
    if build != "CPU build" and not torch.cuda.is_available():
        return f"{build} (sees no driver or GPU)"
    return build


def kernel_in_use(caps: Capabilities) -> tuple[str, str | None]:
    """The staged-write kernel a tensor on ``caps.device`` would use, and why it is not the setting's."""
    setting = write_kernel()
    if caps.device.type == "cpu" and not tier_class(caps.tier).copies:  # the target is the host memory
        why = f"tier {caps.tier.name}: a staged write is one numpy assignment, no kernel"
        return "host", (why if setting == "triton" else None)
    if setting == "triton" and not triton_usable(caps.device):
        where = "the CPU without TRITON_INTERPRET=1" if caps.device.type == "cpu" else str(caps.device)
        return "scatter", f"Triton cannot run on {where}: the scatter kernel is used (logged once)"
    return setting, None


def settings(caps: Capabilities) -> list[dict[str, Any]]:
    """Every stagebuf setting (checked already): its name, raw value (None: unset), value in effect, note."""
    kernel, kernel_why = kernel_in_use(caps)
    k = quarantine()
    wsl_pin = os.environ.get(ENV_WSL_PIN)
    out = [
        (ENV_TIER, caps.forced or "auto", "a cap on the tier" if caps.forced else "the best tier that works"),
        (ENV_CHECK, "1" if check_mode() else "0", "check mode on" if check_mode() else "check mode off"),
        (
            ENV_QUARANTINE,
            str(k),
            f"check mode: a released slot stays poisoned {k} more uses, at most {MAX_QUARANTINE}; "
            + quarantine_cost(k),
        ),
        (
            ENV_KERNEL,
            write_kernel(),
            f"the staged-write kernel; in use: {kernel}" + (f" ({kernel_why})" if kernel_why else ""),
        ),
        (
            ENV_WSL_PIN,
            "1" if (wsl_pin or "").strip() == "1" else "0",
            "pinned memory under WSL2" + ("" if caps.wsl else "; not WSL: no effect"),
        ),
        (ENV_VLLM, os.environ.get(ENV_VLLM) or "0", "the vLLM plugin: see its rows"),
    ]
    return [{"name": n, "value": os.environ.get(n), "effective": eff, "note": note} for n, eff, note in out]


def rows(caps: Capabilities) -> list[tuple[str, str]]:
    """The report's (item, value) rows, shared by the rich and the plain renderings."""
    v = caps.versions
    device = f"{caps.device}" + (f" ({v['device_name']})" if "device_name" in v else "")
    out = [
        ("stagebuf", __version__),
        ("torch", v.get("torch", torch.__version__)),
        ("torch build", build_text(caps.torch_build or torch_build())),
        ("CUDA runtime (torch)", v.get("cuda_runtime", "none")),
        ("CUDA driver API", v.get("cuda_driver_api", "unknown")),
        ("cuda-bindings", v.get("cuda_bindings", "not installed")),
        ("triton", v.get("triton", "not installed")),
        ("device", device),
        ("WSL", "yes" if caps.wsl else "no"),
        ("memlock limit", _limit(caps.memlock_limit)),
        ("pinned memory", "yes" if caps.pin_memory else "no"),
        ("UVA probe", "passed" if caps.uva else "not available"),
        (f"forced by {ENV_TIER}", caps.forced or "no"),
        ("chosen tier", caps.tier.name),
    ]
    for st in settings(caps):
        if st["name"] == ENV_TIER:
            continue  # the two rows above
        out.append((st["name"], f"{st['effective']} ({st['note']})"))
    return out


# --- nano-vllm: installed, and importable ------------------------------------------------------------

NANOVLLM_PACKAGE = "nanovllm"
"""The package nano-vllm's distributions install; :func:`stagebuf.nanovllm.attach` takes its runners."""


def _import_error(package: str) -> BaseException | None:
    """What ``import package`` raises here, or None where it imports."""
    try:
        importlib.import_module(package)
    except (Exception, SystemExit) as e:  # a package can fail at import in any way: doctor reports it
        return e
    return None


def _exception_text(e: BaseException) -> str:
    """``Type: message``, the message's first line, at most 300 characters."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:300]


def _import_fix(e: BaseException, package: str) -> str:
    """What to do about ``e``, raised by ``import package``."""
    check = f"python -c 'import {package}'"
    missing = e.name if isinstance(e, ModuleNotFoundError) and e.name else None
    if missing is None:
        return f"run {check} to see the whole traceback, and repair the install (see its last line)"
    top = missing.split(".")[0]
    if top == "flash_attn":
        return (
            "install flash-attn, which nano-vllm's attention imports: pip install flash-attn "
            f"--no-build-isolation (it needs a CUDA build of torch and an NVIDIA GPU); then {check}"
        )
    return f"install the package that provides the module {top!r} in this environment; then {check}"


def nanovllm_status() -> dict[str, Any]:
    """:func:`stagebuf.nanovllm.status`; where nano-vllm is installed but does not import, also
    ``importable`` (False), ``import_error`` and ``fix``, and a ``note`` that says so."""
    st = nanovllm.status()
    if not st["installed"]:
        return st
    e = _import_error(NANOVLLM_PACKAGE)
    if e is None:
        return st
    error = _exception_text(e)
    tested = "a tested version" if st["tested"] else "not a tested version"
    note = (
        f"{st['distribution']} {st['version']} ({tested}) is installed but cannot be imported ({error}): "
        "stagebuf.nanovllm.attach() cannot be used"
    )
    return {
        **st,
        "note": note,
        "importable": False,
        "import_error": error,
        "fix": _import_fix(e, NANOVLLM_PACKAGE),
    }


def nanovllm_rows() -> list[tuple[str, str]]:
    st = nanovllm_status()
    return [("nano-vllm", st["note"])] + ([("nano-vllm fix", st["fix"])] if "fix" in st else [])


# --- what the vLLM plugin replaces -----------------------------------------------------------------


@dataclass(frozen=True)
class Bindings:
    """What the vLLM plugin replaces (or would): every binding, per vLLM module, and what is not known."""

    title: str
    groups: dict[str, list[str]]
    """vLLM module name to the attributes replaced there (``Class.method`` for a class's)."""
    notes: tuple[str, ...]
    summary: str
    """The "vLLM plugin patches" row."""


def _binding(owner: Any, attr: str) -> tuple[str, str]:
    """(module name, attribute) of a replacement of ``owner.attr``; a class's attribute is ``Class.attr``."""
    if isinstance(owner, type):
        return owner.__module__, f"{owner.__qualname__}.{attr}"
    return str(getattr(owner, "__name__", "?")), attr


def plan_bindings(plan: Any) -> list[tuple[str, str]]:
    """The plan's own bindings: its ``replacements``, else the ``module.attribute`` of its ``patches``."""
    reps = getattr(plan, "replacements", None)
    if reps is not None:
        return [_binding(owner, attr) for owner, attr, _old, _new in reps]
    return [(m, a) for m, _, a in (str(x).rpartition(".") for x in plan.as_dict().get("patches") or [])]


def vllm_source() -> Path | None:
    """The ``vllm`` package's folder (from its ``buffer_utils``' file where that is imported), found without
    importing vLLM; None where there is none."""
    file = getattr(sys.modules.get(_vllm.TARGET), "__file__", None)
    if isinstance(file, str):
        return Path(file).resolve().parents[_vllm.TARGET.count(".") - 1]
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):  # ValueError: a 'vllm' in sys.modules without a spec
        return None
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(where[0]) if where else None


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: Iterable[ast.stmt]) -> Iterator[ast.ImportFrom]:
    """The ``from ... import`` statements a module runs at import (not in a function, a class or under
    ``if TYPE_CHECKING``)."""
    for node in body:
        if isinstance(node, ast.ImportFrom):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        elif isinstance(node, ast.If) and _type_checking(node.test):
            yield from _module_level_imports(node.orelse)
        else:
            for _field, value in ast.iter_fields(node):
                if isinstance(value, list):
                    yield from _module_level_imports(v for v in value if isinstance(v, ast.stmt))
                    for h in value:
                        if isinstance(h, ast.ExceptHandler):
                            yield from _module_level_imports(h.body)


def _imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module ``node`` imports from, inside ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _file_bindings(path: Path, root: Path, wanted: set[str]) -> list[tuple[str, str]]:
    """(module, name) for each name of ``wanted`` the vLLM module at ``path`` binds at import from
    ``buffer_utils`` (``as`` renames the binding; ``*`` binds them all)."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text) if _vllm.TARGET.rpartition(".")[2] in text else None
    except (OSError, SyntaxError, ValueError):  # UnicodeDecodeError is a ValueError
        return []
    if tree is None:
        return []
    parts = path.relative_to(root.parent).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    package = module if parts[-1] == "__init__" else module.rpartition(".")[0]
    found: list[tuple[str, str]] = []
    for node in _module_level_imports(tree.body):
        if _imported_from(node, package) == _vllm.TARGET:
            for a in node.names:
                names = sorted(wanted) if a.name == "*" else [a.asname or a.name] if a.name in wanted else []
                found += [(module, n) for n in names]
    return found


def _group(pairs: Iterable[tuple[str, str]], groups: dict[str, list[str]]) -> None:
    for module, attr in pairs:
        names = groups.setdefault(module, [])
        if attr not in names:
            names.append(attr)


def source_bindings(root: Path, names: Iterable[str] = REPLACED) -> dict[str, list[str]]:
    """Per module of the ``vllm`` package at ``root``, the names of ``names`` (the plugin's
    :data:`~stagebuf._engines.vllm_check.REPLACED`) it binds at import from ``buffer_utils``, read from its
    source: what the plugin's plan finds in the modules vLLM has imported when it runs."""
    wanted = set(names)
    groups: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        _group(_file_bindings(path, root, wanted), groups)
    return groups


_TITLES = {"patch": "it would replace", "patched": "it replaced"}


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def vllm_bindings(plan: Any) -> Bindings | None:
    """Every binding the vLLM plugin replaces under ``plan`` (:func:`stagebuf._engines.vllm.plan`), per
    vLLM module: the plan's own, and those vLLM's source makes in modules this process has not imported
    (the plan sees only imported ones). None where ``STAGEBUF_VLLM`` does not ask for the plugin."""
    d = plan.as_dict()
    if not d.get("enabled"):
        return None
    action, setting = d.get("action"), f"{ENV_VLLM}={d.get('requested')}"
    groups: dict[str, list[str]] = {}
    _group(plan_bindings(plan), groups)
    _group(((_vllm.TARGET, n) for n in REPLACED), groups)  # known without vLLM: the plugin's own names
    root = vllm_source()
    notes: list[str] = []
    if root is not None:
        found = source_bindings(root)
        _group(((m, n) for m, names in found.items() for n in names), groups)
        if any(m not in sys.modules for m in found):
            notes.append(
                f"Modules this process has not imported were read from vLLM's source ({root}): the plugin "
                "replaces their bindings in those vLLM imported before it ran, and those imported after "
                "bind stagebuf's objects."
            )
    else:
        notes.append(
            "vLLM modules that bind these names are replaced too: which they are is known only with "
            "vLLM installed (doctor reads them from its source)."
        )
        if d.get("requested") == "step":
            notes.append(
                f"Step mode also patches {_vllm.STEP_TARGET} (the model runner's step): known only with "
                "vLLM installed."
            )
    counted = (
        f"{_count(sum(len(v) for v in groups.values()), 'binding')} in {_count(len(groups), 'module')}, "
        "listed below the table"
    )
    if action in _TITLES:
        title, summary = f"{_TITLES[action]}, per vLLM module:", counted
    else:
        title = "where it applies, per vLLM module (none here):"
        summary = f"none here (see why); where it applies: {counted}"
    if root is None:
        summary += "; the rest known only with vLLM installed"
    return Bindings(f"vLLM plugin bindings ({setting}) {title}", groups, tuple(notes), summary)


def binding_lines(b: Bindings, width: int = 100) -> list[str]:
    """``b`` as lines of at most ``width`` columns (a name longer than that alone on its line), never
    breaking a name: ``  module: name, name, ...``, continued deeper-indented, then the notes."""

    def wrap(text: str, first: str, more: str) -> list[str]:
        return textwrap.wrap(
            text, width, initial_indent=first, subsequent_indent=more,
            break_long_words=False, break_on_hyphens=False,
        )  # fmt: skip

    lines = wrap(b.title, "", "")
    for module, names in b.groups.items():
        lines += wrap(f"{module}: {', '.join(names)}", "  ", "      ")
    for note in b.notes:
        lines += wrap(note, "", "")
    return lines


def vllm_report() -> tuple[list[tuple[str, str]], Bindings | None]:
    """The vLLM plugin's rows (:func:`stagebuf._engines.vllm.rows`, its patches row a count) and nano-vllm's,
    and the plugin's bindings (None where it is not asked for)."""
    b = vllm_bindings(_vllm.plan())
    out = [(k, b.summary if b is not None and k == "vLLM plugin patches" else v) for k, v in _vllm.rows()]
    return out + nanovllm_rows(), b


def vllm_rows() -> list[tuple[str, str]]:
    """The vLLM plugin's rows and nano-vllm's (:func:`vllm_report`)."""
    return vllm_report()[0]


# --- rendering ------------------------------------------------------------------------------------------


def render_text(caps: Capabilities) -> str:
    """The report as plain text (no rich needed)."""
    plugin, bindings = vllm_report()
    table = rows(caps) + plugin
    width = max(len(k) for k, _ in table)
    lines = ["stagebuf doctor", ""]
    lines += [f"  {k.ljust(width)}  {val}" for k, val in table]
    if bindings is not None:
        lines += ["", *binding_lines(bindings)]
    lines += ["", "reasons (one per decision):"]
    lines += [f"  - {r}" for r in caps.reasons]
    return "\n".join(lines)


def headline(p: Problem, prog: str = "stagebuf doctor") -> str:
    """The problem screen's first line: a value no machine takes is called invalid, with the allowed
    values; a valid one this machine cannot serve is said to be that."""
    sep = " " if p.setting.startswith("--") else "="
    asked = f"{p.setting}{sep}{p.value}"
    if not p.invalid:
        return f"{prog}: {asked} cannot work on this machine"
    return (
        f"{prog}: {asked} cannot work anywhere: {p.value!r} is not a valid value of {p.setting}; "
        f"allowed: {', '.join(p.allowed)}"
    )


def render_problem_text(p: Problem, prog: str = "stagebuf doctor") -> str:
    """A setting that cannot work: one screen, plain text."""
    lines = [
        headline(p, prog),
        "",
        f"  problem      {p.error}",
        f"  allowed      {', '.join(p.allowed)}",
        f"  fix          {p.fix}",
        f"  torch        {torch.__version__}",
        f"  torch build  {build_text(torch_build())}",
    ]
    return "\n".join(lines)


def _rich() -> tuple[Any, Any] | None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return None
    return Console, Table


def render(caps: Capabilities, console: Any = None) -> None:
    """Print the report: a rich table where rich is installed, plain text otherwise."""
    rich = _rich()
    if rich is None:
        print(render_text(caps), file=getattr(console, "file", None) or sys.stdout)
        return
    console_cls, table_cls = rich
    if console is None:
        console = console_cls()
        console.on_broken_pipe = _broken_pipe  # rich's hook (it would exit 1): run() ends quietly
    plugin, bindings = vllm_report()
    t = table_cls(title="stagebuf doctor", show_header=True, header_style="bold")
    t.add_column("item")
    t.add_column("value", overflow="fold")
    for k, val in rows(caps) + plugin:
        t.add_row(k, f"[bold]{val}[/bold]" if k == "chosen tier" else val)
    console.print(t)
    if bindings is not None:  # plain lines, wrapped here between names: rich would fold a long one
        for line in binding_lines(bindings, console.width):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    r = table_cls(title="reasons (one per decision)", show_header=False)
    r.add_column("reason", overflow="fold")
    for line in caps.reasons:
        r.add_row(line)
    console.print(r)


def to_json(caps: Capabilities) -> str:
    b = vllm_bindings(_vllm.plan())
    plugin = {
        **_vllm.report(),
        "bindings": {} if b is None else b.groups,
        "bindings_notes": [] if b is None else list(b.notes),
    }
    report = {"stagebuf": __version__, **caps.as_dict(), "settings": settings(caps), "vllm": plugin}
    return json.dumps({**report, "nanovllm": nanovllm_status()}, indent=2, default=str)


def _broken_pipe() -> None:
    raise BrokenPipeError


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so that the interpreter's last flush is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test's StringIO)
        pass


def run(device: str | None = None, as_json: bool = False, out: TextIO | None = None) -> int:
    """Probe, print the report (or the problem) and return the exit status, even if the reader stops early."""
    out = out or sys.stdout
    found = diagnose(device)
    status = 2 if isinstance(found, Problem) else 0  # 2: a setting cannot work here, as for a usage error
    try:
        if isinstance(found, Problem):
            text = json.dumps(found.as_dict(), indent=2) if as_json else render_problem_text(found)
            print(text, file=out)
        elif as_json:
            print(to_json(found), file=out)
        elif out is sys.stdout:
            render(found)
        else:
            print(render_text(found), file=out)
        out.flush()
    except BrokenPipeError:
        _quiet_stdout()
    return status
