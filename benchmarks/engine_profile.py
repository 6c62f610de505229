"""``python -m benchmarks.engine_profile``: where each setup's buffer work goes, part by part, with calls.

The engine workload's timed lockstep run of the chosen setups and the floor (µs per step of each part), then
each setup again under ``cProfile``, one profile per part (``engine.SECTIONS``): the functions with the most
own time, their calls and µs per step. Own-API setups are not profiled. On a CPU: ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import cProfile
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

from . import engine as E
from . import vllm_mrv2
from .harness import commit, ints

DEFAULT_SETUPS = {
    "cuda": "vllm_uva,vllm_nopin,stagebuf_dropin_uva,stagebuf_dropin_pageable,stagebuf_step_uva,"
    "stagebuf_step_pageable",
    "cpu": "vllm_uva,stagebuf_dropin_pageable,stagebuf_step_host,stagebuf_step_pageable",
}  # The setups profiled unless ``--setups`` names others (the floor is always timed).


def _profiled(f: Callable[..., Any], prof: cProfile.Profile) -> Callable[..., Any]:
    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        with prof:  # enabled for the call
            return f(*args, **kwargs)

    return call


def _name(key: tuple[str, int, str]) -> str:
    """A function's name: a C function's as cProfile gives it, else ``parts/of/file.py:line(name)``."""
    file, line, func = key
    return func if file == "~" else f"{'/'.join(Path(file).parts[-3:])}:{line}({func})"


def top(prof: cProfile.Profile, steps: int, k: int) -> dict[str, Any]:
    """The ``k`` functions of ``prof`` with the most own time: calls and own µs per step; the total."""
    prof.create_stats()  # (pstats.Stats refuses a profile that never ran: a part with no calls)
    st = {key: v for key, v in prof.stats.items() if "_lsprof.Profiler" not in key[2]}  # type: ignore[attr-defined]
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:k]
    top = [{"function": _name(key), "calls": v[1] / steps, "own_us": v[2] / steps * 1e6} for key, v in rows]
    return {"profiled_us": sum(v[2] for v in st.values()) / steps * 1e6, "top": top}


def run(
    device: torch.device,
    names: list[str],
    groups: tuple[int, ...],
    modes: tuple[bool, ...],
    steps: int,
    warmup: int,
    k: int,
    trace: dict[str, Any] | None = None,
    release: str = vllm_mrv2.NEWEST,
) -> dict[str, Any]:
    """The lockstep timings and the per-part profiles of the setups ``names``."""
    cuda = device.type == "cuda"
    every = E.setups(["uva", "pinned", "pageable"] if cuda else ["host", "pageable"], cuda)
    known = {s.name: s for s in every if s.api != "own" and s.layer != "floor"}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}; allowed: {', '.join(known)}", param_hint="--setups")
    chosen = [known[n] for n in names]
    cycles = E.sleep_cycles_for(E.BUSY_MS, device) if cuda else 0
    out: dict[str, Any] = {
        "steps": steps,
        "warmup": warmup,
        "setups": names,
        "vllm_version": release,
        "runs": {},
    }

    def profile(s: E.Setup, cfg: E.TraceConfig, plans: list[E.StepPlan], busy: int) -> dict[str, Any]:
        """One setup alone over ``plans``, each part's calls profiled after the warm-up."""
        profs = {p: cProfile.Profile() for p in E.SECTIONS}

        def hook(i: int, engines: list[Any]) -> None:
            if i == warmup:
                eng = engines[0]
                for obj, part in zip((eng.req_states, eng.sampling, eng.block_tables), E.SECTIONS[:3]):
                    obj.apply_staged_writes = _profiled(obj.apply_staged_writes, profs[part])
                eng.h2d = _profiled(eng.h2d, profs[E.SECTIONS[3]])

        E.run_lockstep([s], cfg, device, plans, busy, warmup, before_step=hook, release=release)
        return {part: top(profs[part], max(len(plans) - warmup, 1), k) for part in E.SECTIONS}

    try:
        for g in groups:
            cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:g], **{**(trace or {}), "steps": steps})
            plans = E.make_trace(cfg)
            for busy in modes:
                setups = [*chosen, E.Setup("floor", "floor")]
                timed = E.run_lockstep(setups, cfg, device, plans, cycles * busy, warmup, release=release)
                for s in chosen:
                    out["runs"][f"{s.name}|g{g}|{'busy' if busy else 'idle'}"] = {
                        "sections_us": timed[s.name]["sections_us"],
                        "parts": profile(s, cfg, plans, cycles * busy),
                        "floor_us": timed["floor"]["sections_us"],
                    }
    finally:
        E.close_plugin_modules()
    return out


@click.command()
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False), help="The report.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), help="Also the report as Markdown.")
@click.option("--setups", help="Comma-separated setup names (default: DEFAULT_SETUPS of the device).")
@click.option("--groups", default="1,2", show_default=True, callback=ints, help="KV-cache groups (1 to 4).")
@click.option("--mode", type=click.Choice(["both", "busy", "idle"]), default="both", show_default=True)
@click.option("--steps", default=80, show_default=True, help="Steps of the trace, warm-up included.")
@click.option("--warmup", default=20, show_default=True, help="Steps before timing and profiling.")
@click.option("--top", "k", default=12, show_default=True, help="Functions kept per part.")
@vllm_mrv2.release_option("The vLLM release whose MRV2 modules run.")
def main(
    json_path: str,
    md_path: str | None,
    setups: str | None,
    groups: tuple[int, ...],
    mode: str,
    steps: int,
    warmup: int,
    k: int,
    release: str,
) -> None:
    """Profile the engine workload's buffer work, part by part (see the module docstring)."""
    from .report import profile_markdown

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise click.UsageError("on a CPU, vLLM's Triton kernels need TRITON_INTERPRET=1")
    if warmup >= steps:
        raise click.BadParameter(f"{warmup} >= --steps {steps}: fewer, please", param_hint="--warmup")
    modes = {"both": (False, True), "busy": (True,), "idle": (False,)}[mode]
    names = [n.strip() for n in (setups or DEFAULT_SETUPS[device.type]).split(",") if n.strip()]
    report = run(device, names, groups, modes, steps, warmup, k, release=release)
    report["commit"] = commit() or "unknown"
    report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(json_path).write_text(json.dumps(report, indent=1))
    md = profile_markdown(report)
    if md_path:
        Path(md_path).write_text(md)
    click.echo(md)


if __name__ == "__main__":
    main()
