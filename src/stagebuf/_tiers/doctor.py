"""``stagebuf doctor``: what this machine can do, the tier chosen, and why.

A setting that cannot work here (any ``STAGEBUF_*``, or ``--device``) gets one screen naming the setting,
cause, allowed values and fix (``--json``: an object with ``error`` and ``fix``) and exit status 2, never a
traceback; a reader that closes the pipe early ends it quietly. ``rich`` draws the table where installed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from .. import __version__, nanovllm
from .._common.errors import SetupError
from .._common.tier import Tier
from .._engines import vllm as _vllm
from .._rings.staged_write.kernel import triton_usable
from .capabilities import Capabilities, torch_build
from .probe import capabilities
from .settings import (
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

    def as_dict(self) -> dict[str, Any]:
        return {
            "error": self.error,
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
    if caps.tier is Tier.HOST:
        why = "tier HOST: a staged write is one numpy assignment, no kernel"
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


def vllm_rows() -> list[tuple[str, str]]:
    """The vLLM plugin's rows (:func:`stagebuf._engines.vllm.rows`) and nano-vllm's status."""
    return [*_vllm.rows(), ("nano-vllm", nanovllm.status()["note"])]


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
    if console is None:
        console = console_cls()
        console.on_broken_pipe = _broken_pipe  # rich's hook (it would exit 1): run() ends quietly
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
    report = {"stagebuf": __version__, **caps.as_dict(), "settings": settings(caps), "vllm": _vllm.report()}
    return json.dumps({**report, "nanovllm": nanovllm.status()}, indent=2, default=str)


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
