"""``python -m benchmarks.engine_profile``: where each setup's buffer work goes, part by part, with calls.

The engine workload (:mod:`benchmarks.engine`: vLLM's own MRV2 input path, ``--release``'s, default
``vllm_mrv2.NEWEST``), in one process:

1. the timed lockstep run of the chosen setups and the floor (``run_lockstep``, as the bench runs it):
   µs per step of each part, unprofiled;
2. each setup again over the same trace under ``cProfile``, one profile per part (``engine.SECTIONS``):
   the functions with the most own time, with calls and µs per step. cProfile's overhead inflates
   Python functions; a C call (a launch, a copy, an event record) keeps about its own cost;
3. with ``--timers``, each setup once more with wall-clock timers on stagebuf's step functions
   (``TIMED``) instead: calls, own µs (less the timed calls inside) and total µs per step and part,
   at the cost of one timer per call.

The parts are the calls the bench times: ``RequestState``, ``SamplingStates`` and ``BlockTables``'
``apply_staged_writes``, and the step's ``async_tensor_h2d`` copies (in step mode the last one
flushes the step's batch). Own-API setups time other calls and are not profiled here.

    PYTHONPATH=src:. python -m benchmarks.engine_profile --json out/profile.json  # a CPU: TRITON_INTERPRET=1
"""

from __future__ import annotations

import cProfile
import functools
import importlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

from . import engine as E
from . import vllm_mrv2

DEFAULT_SETUPS = {
    "cuda": "vllm_uva,vllm_nopin,stagebuf_dropin_uva,stagebuf_dropin_pageable,"
    "stagebuf_step_uva,stagebuf_step_pageable",
    "cpu": "vllm_uva,stagebuf_dropin_pageable,stagebuf_step_host,stagebuf_step_pageable",
}
"""The setups profiled unless ``--setups`` names others (the floor is always timed)."""


def _profiled(f: Callable[..., Any], prof: cProfile.Profile) -> Callable[..., Any]:
    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        prof.enable()
        try:
            return f(*args, **kwargs)
        finally:
            prof.disable()

    return call


def _hook(eng: E.Engine, wrap: Callable[[Callable[..., Any], str], Callable[..., Any]]) -> None:
    """Wrap each part's calls of ``eng``: ``wrap(call, part)``."""
    parts = zip((eng.req_states, eng.sampling, eng.block_tables), E.SECTIONS[:3])
    for obj, part in parts:
        obj.apply_staged_writes = wrap(obj.apply_staged_writes, part)
    eng.h2d = wrap(eng.h2d, E.SECTIONS[3])


TIMED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("stagebuf._engines.vllm_step", "", ("close_window",)),
    ("stagebuf._engines.vllm_step_batch", "", ("launch_at",)),
    ("stagebuf._engines.vllm_step_batch", "StepBatch", ("flush", "open_step", "add", "add_whole")),
    ("stagebuf._rings.staged_write.writers", "", ("check",)),
    ("stagebuf._rings.staged_write.check", "", ("list_values",)),
    ("stagebuf._rings.staged_write.launcher", "", ("launch_at",)),
    ("stagebuf._rings.staged_write.launcher", "_Launcher", ("apply",)),
    ("stagebuf._rings.stager", "StepStager", ("step",)),
    ("stagebuf._rings.stager", "Step", ("stage", "reserve", "flush")),
    ("stagebuf._rings.ring", "Ring", ("acquire", "publish")),
    ("stagebuf._rings.guard", "StepClock", ("record", "done")),
    ("stagebuf._rings.pool", "UvaBufferPool", ("copy_to_uva",)),
)
"""(module, class or "" for a module's function, names): the functions ``--timers`` times, where callers
look them up (a function imported by name is timed in the importing module)."""


class Timers:
    """Wall-clock timers on ``TIMED``'s functions, counted for the part that is running (``part``)."""

    def __init__(self) -> None:
        self.part: str | None = None
        self.stats: dict[str, dict[str, list[float]]] = {p: {} for p in E.SECTIONS}
        """Per part and function: calls, own seconds, total seconds."""
        self._inner: list[float] = []  # per timed call running: the time of the timed calls inside it
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        """Put a timer on each of ``TIMED``'s functions (AttributeError if one is missing)."""
        for module, cls, names in TIMED:
            owner: Any = importlib.import_module(module)
            if cls:
                owner = getattr(owner, cls)
            for name in names:
                f = owner.__dict__.get(name) if cls else getattr(owner, name, None)
                if not callable(f):
                    raise AttributeError(f"TIMED: {module} has no function {cls + '.' if cls else ''}{name}")
                label = f"{cls or module.rsplit('.', 1)[1]}.{name}"
                self._undo.append((owner, name, f))
                setattr(owner, name, self._timed(label, f))

    def remove(self) -> None:
        """Put every timed function back."""
        while self._undo:
            owner, name, f = self._undo.pop()
            setattr(owner, name, f)

    def _timed(self, label: str, f: Callable[..., Any]) -> Callable[..., Any]:
        inner, clock = self._inner, time.perf_counter

        @functools.wraps(f)
        def timed(*args: Any, **kwargs: Any) -> Any:
            part = self.part
            if part is None:
                return f(*args, **kwargs)
            t = clock()
            inner.append(0.0)
            try:
                return f(*args, **kwargs)
            finally:
                d = clock() - t
                s = self.stats[part].setdefault(label, [0, 0.0, 0.0])
                s[0] += 1
                s[1] += d - inner.pop()
                s[2] += d
                if inner:
                    inner[-1] += d

        return timed

    def during(self, f: Callable[..., Any], part: str) -> Callable[..., Any]:
        """``f``, counting the timed calls it makes for ``part``."""

        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.part = part
            try:
                return f(*args, **kwargs)
            finally:
                self.part = None

        return call

    def report(self, steps: int) -> dict[str, list[dict[str, Any]]]:
        """Per part, every timed function that part called: calls, own and total µs per step."""
        return {
            part: [
                {"function": fn, "calls": c / steps, "own_us": o / steps * 1e6, "total_us": t / steps * 1e6}
                for fn, (c, o, t) in sorted(fns.items(), key=lambda kv: -kv[1][1])
            ]
            for part, fns in self.stats.items()
        }


def _name(key: tuple[str, int, str]) -> str:
    file, line, func = key
    if file == "~":  # a C function: cProfile names it "<built-in method ...>" or "<method ... of ...>"
        return func
    return f"{'/'.join(Path(file).parts[-3:])}:{line}({func})"  # the file's last three path parts


def top(prof: cProfile.Profile, steps: int, k: int) -> dict[str, Any]:
    """The ``k`` functions of ``prof`` with the most own time: calls and own µs per step; the total."""
    prof.create_stats()  # (pstats.Stats refuses a profile that never ran: a part with no calls)
    st = {key: v for key, v in prof.stats.items() if "_lsprof.Profiler" not in key[2]}  # type: ignore
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])
    total = sum(v[2] for v in st.values())
    return {
        "profiled_us": total / steps * 1e6,
        "top": [
            {"function": _name(key), "calls": v[1] / steps, "own_us": v[2] / steps * 1e6}
            for key, v in rows[:k]
        ],
    }


def _run_hooked(
    setup: E.Setup, cfg: E.TraceConfig, device: torch.device, plans: list[E.StepPlan], busy_cycles: int,
    warmup: int, wrap: Callable[[Callable[..., Any], str], Callable[..., Any]],
    release: str = vllm_mrv2.NEWEST,
) -> int:  # fmt: skip
    """One setup alone over ``plans`` (``run_lockstep``), its parts wrapped (``_hook``) after ``warmup``
    steps; the steps after it."""

    def hook(i: int, engines: list[Any]) -> None:
        if i == warmup:
            _hook(engines[0], wrap)

    E.run_lockstep([setup], cfg, device, plans, busy_cycles, warmup, before_step=hook, release=release)
    return max(len(plans) - warmup, 1)


def profile_setup(
    setup: E.Setup, cfg: E.TraceConfig, device: torch.device, plans: list[E.StepPlan], busy_cycles: int,
    warmup: int, k: int, release: str = vllm_mrv2.NEWEST,
) -> dict[str, Any]:  # fmt: skip
    """One setup alone over ``plans``, each part profiled after ``warmup`` steps."""
    profs = {p: cProfile.Profile() for p in E.SECTIONS}
    steps = _run_hooked(
        setup, cfg, device, plans, busy_cycles, warmup, lambda f, p: _profiled(f, profs[p]), release
    )
    return {part: top(profs[part], steps, k) for part in E.SECTIONS}


def time_setup(
    setup: E.Setup, cfg: E.TraceConfig, device: torch.device, plans: list[E.StepPlan], busy_cycles: int,
    warmup: int, release: str = vllm_mrv2.NEWEST,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """One setup alone over ``plans``, ``TIMED``'s functions timed per part after ``warmup`` steps."""
    timers = Timers()
    timers.install()
    try:
        steps = _run_hooked(setup, cfg, device, plans, busy_cycles, warmup, timers.during, release)
    finally:
        timers.remove()
    return timers.report(steps)


def run(
    device: torch.device, names: list[str], groups: tuple[int, ...], modes: tuple[bool, ...], steps: int,
    warmup: int, k: int, busy_ms: float = 3.0, trace: dict[str, Any] | None = None, timers: bool = False,
    release: str = vllm_mrv2.NEWEST,
) -> dict[str, Any]:  # fmt: skip
    """The lockstep timings and the per-part profiles of the setups ``names`` (with the floor); ``trace``:
    ``TraceConfig`` fields other than the default's (tests run a small one); ``timers``: also each
    setup's ``TIMED`` functions per part (``time_setup``)."""
    cuda = device.type == "cuda"
    have = E.setups(cuda, have_uva=True, have_pinned=True)
    known = {s.name: s for s in have}
    unknown = [n for n in names if n not in known or known[n].api == "own" or n == "floor"]
    if unknown:
        allowed = ", ".join(n for n, s in known.items() if s.api != "own" and n != "floor")
        raise click.BadParameter(f"{', '.join(unknown)}; allowed: {allowed}", param_hint="--setups")
    chosen = [known[n] for n in names]
    cycles = E.sleep_cycles_for(busy_ms, device) if cuda else 0
    out: dict[str, Any] = {
        "steps": steps,
        "warmup": warmup,
        "setups": names,
        "vllm_version": release,
        "runs": {},
    }
    try:
        for g in groups:
            cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:g], **{**(trace or {}), "steps": steps})
            plans = E.make_trace(cfg)
            for busy in modes:
                mode = "busy" if busy else "idle"
                timed = E.run_lockstep(
                    [*chosen, E.Setup("floor", "floor")],
                    cfg,
                    device,
                    plans,
                    cycles * busy,
                    warmup,
                    release=release,
                )
                for s in chosen:
                    prof = profile_setup(s, cfg, device, plans, cycles * busy, warmup, k, release)
                    one = out["runs"][f"{s.name}|g{g}|{mode}"] = {
                        "sections_us": timed[s.name]["sections_us"],
                        "floor_us": timed["floor"]["sections_us"],
                        "parts": prof,
                    }
                    if timers:
                        one["timers"] = time_setup(s, cfg, device, plans, cycles * busy, warmup, release)
    finally:
        E.close_plugin_modules()
    return out


def render(report: dict[str, Any], k: int = 6) -> str:
    """The report as Markdown: per run, each part's µs (unprofiled), its floor, and its top functions."""
    lines = []
    for key, r in report["runs"].items():
        lines += [
            f"#### {key}",
            "",
            "part | µs | floor µs | top functions (calls, own µs per step)",
            "---|---|---|---",
        ]
        for part in E.SECTIONS:
            fns = "; ".join(
                f"`{t['function']}` {t['calls']:.1f}, {t['own_us']:.1f}" for t in r["parts"][part]["top"][:k]
            )
            lines.append(f"{part} | {r['sections_us'][part]:.1f} | {r['floor_us'][part]:.1f} | {fns}")
        lines.append("")
        if "timers" in r:
            lines += ["part | timed functions (calls, own µs, total µs per step)", "---|---"]
            for part in E.SECTIONS:
                fns = "; ".join(
                    f"`{t['function']}` {t['calls']:.1f}, {t['own_us']:.1f}, {t['total_us']:.1f}"
                    for t in r["timers"][part]
                )
                lines.append(f"{part} | {fns}")
            lines.append("")
    return "\n".join(lines)


@click.command()
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False), help="The report.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), help="Also the report as Markdown.")
@click.option("--setups", help="Comma-separated setup names (default: DEFAULT_SETUPS of the device).")
@click.option("--groups", default="1,2", show_default=True, help="KV-cache groups, comma-separated.")
@click.option("--mode", type=click.Choice(["both", "busy", "idle"]), default="both", show_default=True)
@click.option("--steps", default=80, show_default=True, help="Steps of the trace, warm-up included.")
@click.option("--warmup", default=20, show_default=True, help="Steps before timing and profiling.")
@click.option("--top", "k", default=12, show_default=True, help="Functions kept per part.")
@click.option("--timers", is_flag=True, help="Also time TIMED's functions per part, one more run a setup.")
@vllm_mrv2.release_option("The vLLM release whose MRV2 modules run.")
def main(
    json_path: str,
    md_path: str | None,
    setups: str | None,
    groups: str,
    mode: str,
    steps: int,
    warmup: int,
    k: int,
    timers: bool,
    release: str,
) -> None:
    """Profile the engine workload's buffer work, part by part (see the module docstring)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise click.UsageError("on a CPU, vLLM's Triton kernels need TRITON_INTERPRET=1")
    if warmup >= steps:
        raise click.BadParameter(
            f"{warmup} >= --steps {steps}; allowed: fewer than --steps", param_hint="--warmup"
        )
    modes = {"both": (False, True), "busy": (True,), "idle": (False,)}[mode]
    names = [n.strip() for n in (setups or DEFAULT_SETUPS[device.type]).split(",") if n.strip()]
    gs = tuple(int(g) for g in groups.split(","))
    report = run(device, names, gs, modes, steps, warmup, k, timers=timers, release=release)
    report["commit"] = os.environ.get("STAGEBUF_BENCH_COMMIT", "unknown")
    report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(json_path).write_text(json.dumps(report, indent=1))
    md = render(report)
    if md_path:
        Path(md_path).write_text(md)
    click.echo(md)


if __name__ == "__main__":
    main()
