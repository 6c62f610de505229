"""``stagebuf doctor``: what this machine can do, the tier chosen, and why."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from .probe import Capabilities


def _limit(v: int | None) -> str:
    if v is None:
        return "unlimited"
    return f"{v} bytes ({v / (1 << 20):.1f} MiB)"


def render(caps: Capabilities, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title="stagebuf doctor", show_header=True, header_style="bold")
    t.add_column("item")
    t.add_column("value", overflow="fold")
    v = caps.versions
    t.add_row("torch", v.get("torch", "?"))
    t.add_row("CUDA runtime (torch)", v.get("cuda_runtime", "none"))
    t.add_row("CUDA driver API", v.get("cuda_driver_api", "unknown"))
    t.add_row("cuda-bindings", v.get("cuda_bindings", "not installed"))
    t.add_row("triton", v.get("triton", "not installed"))
    t.add_row("device", f"{caps.device}" + (f" ({v['device_name']})" if "device_name" in v else ""))
    t.add_row("WSL", "yes" if caps.wsl else "no")
    t.add_row("memlock limit", _limit(caps.memlock_limit))
    t.add_row("pinned memory", "yes" if caps.pin_memory else "no")
    t.add_row("UVA probe", "passed" if caps.uva else "not available")
    t.add_row("forced by STAGEBUF_TIER", caps.forced or "no")
    t.add_row("chosen tier", f"[bold]{caps.tier.name}[/bold]")
    console.print(t)
    r = Table(title="reasons (one per decision)", show_header=False)
    r.add_column("reason", overflow="fold")
    for line in caps.reasons:
        r.add_row(line)
    console.print(r)


def to_json(caps: Capabilities) -> str:
    return json.dumps(caps.as_dict(), indent=2)
