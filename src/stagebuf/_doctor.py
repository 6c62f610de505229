"""``stagebuf doctor``: what this machine can do, the tier chosen, and why.

It never ends in a traceback for a setting that cannot work here (``STAGEBUF_TIER``
or ``--device``): it prints one screen naming the setting, the cause, the allowed
values and the fix, and exits with status 2 (``--json``: an object with ``error``
and ``fix``). Only a bug in stagebuf may end in a traceback.

``rich`` draws the table where it is installed; without it the same report is
plain text (``render_text``). It needs nothing beyond
what ``import stagebuf`` needs.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from ._capabilities import Capabilities, torch_build
from ._constants import (
    ENV_CHECK,
    ENV_KERNEL,
    ENV_QUARANTINE,
    ENV_TIER,
    ENV_VLLM,
    check_mode,
    quarantine,
    write_kernel,
)
from ._errors import SetupError
from ._probe import capabilities

EXIT_OK = 0
EXIT_SETUP = 2
"""Exit status when a setting cannot work here (as for a usage error)."""


@dataclass(frozen=True)
class Problem:
    """A setting that stops the probe, explained for a person and for a machine."""

    setting: str
    """``STAGEBUF_TIER`` or ``--device``."""
    value: str
    error: str
    """What was asked and why it cannot work here, in one sentence."""
    cause: str | None
    allowed: tuple[str, ...]
    fix: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "setting": self.setting,
            "value": self.value,
            "cause": self.cause,
            "allowed": list(self.allowed),
            "fix": self.fix,
            "torch": torch.__version__,
            "torch_build": torch_build(),
            "cuda_available": torch.cuda.is_available(),
        }


def _problem(e: SetupError) -> Problem:
    error = e.problem + (f": {e.cause}" if e.cause else "")
    if e.setting == "device":
        allowed = ("(omit --device)", *e.allowed)
        fix = (
            "omit --device (stagebuf then uses the current accelerator, else the CPU) or pass "
            f"one of: {', '.join(e.allowed)}"
        ) + (f"; or {e.hint}" if e.hint else "")
        error = error.replace(f"device={e.value!r}", f"--device {e.value}", 1)
        return Problem("--device", str(e.value), error, e.cause, allowed, fix)
    setting = e.setting or ENV_TIER
    return Problem(setting, str(e.value), error, e.cause, e.allowed, e.fix or "see the error")


def diagnose(device: str | None = None) -> Capabilities | Problem:
    """The capabilities of ``device``, or the Problem that stops the probe."""
    try:
        return capabilities(device)
    except SetupError as e:
        return _problem(e)


# --- the report ------------------------------------------------------------------------------


def _limit(v: int | None) -> str:
    if v is None:
        return "unlimited"
    return f"{v} bytes ({v / (1 << 20):.1f} MiB)"


def build_text(build: str) -> str:
    """``build``, and whether a GPU build sees its GPU: "CUDA 13.0 build (sees no driver or GPU)"."""
    if build != "CPU build" and not torch.cuda.is_available():
        return f"{build} (sees no driver or GPU)"
    return build


def rows(caps: Capabilities) -> list[tuple[str, str]]:
    """The report's (item, value) rows, shared by the rich and the plain renderings."""
    v = caps.versions
    device = f"{caps.device}" + (f" ({v['device_name']})" if "device_name" in v else "")
    return [
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
        # (both were checked by the probe: a bad value is the problem screen instead)
        (ENV_CHECK, "1: check mode on" if check_mode() else "off"),
        (ENV_QUARANTINE, f"{quarantine()} (check mode: steps a released slot stays poisoned)"),
        (ENV_KERNEL, f"{write_kernel()} (the staged-write kernel)"),
    ]


def vllm_rows() -> list[tuple[str, str]]:
    """vLLM and the plugin: installed or not, its version, switched on or not, what it would do.

    vLLM is imported only when ``STAGEBUF_VLLM=1`` (to check its buffer layer's API).
    """
    from . import _vllm

    version = _vllm.vllm_version()
    raw = os.environ.get(ENV_VLLM)
    try:
        on = _vllm.setting()
    except SetupError as e:
        return [("vLLM", version or "not installed"), ("vLLM plugin", f"invalid setting: {e}")]
    rows_ = [("vLLM", f"{version} (tested: {', '.join(_vllm.TESTED)})" if version else "not installed")]
    if not on:
        state = f"off ({ENV_VLLM}={raw!r})" if raw is not None else f"off ({ENV_VLLM} unset)"
        rows_.append(("vLLM plugin", state + "; set STAGEBUF_VLLM=1 to make stagebuf MRV2's buffer layer"))
        return rows_
    if version is None:
        rows_.append(("vLLM plugin", "on, but vLLM is not installed: nothing to do"))
        return rows_
    p = _vllm.plan()
    verb = {"patch": "would replace MRV2's buffer layer", "patched": "replaced MRV2's buffer layer"}
    rows_.append(("vLLM plugin", f"on: {verb.get(p.action, 'would leave vLLM as it is')}: {p.why}"))
    return rows_


def vllm_report() -> dict[str, Any]:
    """The vLLM part of ``doctor --json``."""
    from . import _vllm

    out: dict[str, Any] = {"installed": _vllm.vllm_version() is not None, "version": _vllm.vllm_version()}
    out["tested"] = list(_vllm.TESTED)
    out["setting"] = os.environ.get(ENV_VLLM)
    try:
        on = _vllm.setting()
    except SetupError as e:
        out.update(enabled=None, action="invalid", why=str(e))
        return out
    if on and out["installed"]:
        out.update(_vllm.plan().as_dict())
    else:
        why = "vLLM is not installed" if on else f"{ENV_VLLM} is not set to 1"
        out.update(enabled=on, action="off" if not on else "none", why=why)
    return out


def render_text(caps: Capabilities) -> str:
    """The report as plain text (no rich needed)."""
    table = rows(caps) + vllm_rows()
    width = max(len(k) for k, _ in table)
    lines = ["stagebuf doctor", ""]
    lines += [f"  {k.ljust(width)}  {val}" for k, val in table]
    lines += ["", "reasons (one per decision):"]
    lines += [f"  - {r}" for r in caps.reasons]
    return "\n".join(lines)


def render_problem_text(p: Problem, prog: str = "stagebuf doctor") -> str:
    """A setting that cannot work here: one screen, plain text."""
    sep = " " if p.setting.startswith("--") else "="
    lines = [
        f"{prog}: {p.setting}{sep}{p.value} cannot work on this machine",
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
    console = console or console_cls()
    t = table_cls(title="stagebuf doctor", show_header=True, header_style="bold")
    t.add_column("item")
    t.add_column("value", overflow="fold")
    for k, val in rows(caps) + vllm_rows():
        t.add_row(k, f"[bold]{val}[/bold]" if k == "chosen tier" else val)
    console.print(t)
    r = table_cls(title="reasons (one per decision)", show_header=False)
    r.add_column("reason", overflow="fold")
    for line in caps.reasons:
        r.add_row(line)
    console.print(r)


def to_json(caps: Capabilities) -> str:
    return json.dumps({**caps.as_dict(), "vllm": vllm_report()}, indent=2)


def run(device: str | None = None, as_json: bool = False, out: TextIO | None = None) -> int:
    """Probe, print the report (or the problem) and return the exit status."""
    out = out or sys.stdout
    found = diagnose(device)
    if isinstance(found, Problem):
        text = json.dumps(found.as_dict(), indent=2) if as_json else render_problem_text(found)
        print(text, file=out)
        return EXIT_SETUP
    if as_json:
        print(to_json(found), file=out)
    elif out is sys.stdout:
        render(found)
    else:
        print(render_text(found), file=out)
    return EXIT_OK
