"""``python -m benchmarks``: every workload, timed in one process, with the targets' ratios.

The micro and writes strategies of one size are built together, warmed up, then repeated in a rotating order,
each repeat about ``--target-ms``: host µs a step (to enqueue) and synchronised µs (until
``torch.cuda.synchronize()`` returned), medians over repeats; the staging cost is the synchronised time less
the floor's. The engine and nano-vllm workloads run after them; :mod:`benchmarks.targets` judges.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from stagebuf import Capabilities, Tier, capabilities

from . import baselines as BL
from . import engine as E
from . import harness as H
from . import micro, vllm_mrv2, writes
from . import nanovllm_engine as NV
from . import report as R
from . import targets as T
from . import vs_vllm as V

WORKLOADS = R.WORKLOADS
ALL_WORKLOADS = (*WORKLOADS, "engine", "nanovllm")


@dataclass
class BenchConfig:
    quick: bool = False
    device: str | None = None
    tiers: tuple[str, ...] = ()
    workloads: tuple[str, ...] = ALL_WORKLOADS
    sizes: tuple[int, ...] = (64, 512, 4096, 32768)
    edits: tuple[int, ...] = (1, 16, 256, 4096)  # writes: E, the edits per apply.
    lengths: tuple[int, ...] = (1, 8, 64)  # writes: L, the elements per edit (the sweep is every E x L).
    k: int = H.Env.k
    repeats: int = 5
    iters: int = 2000
    target_ms: float = 150.0
    engine_steps: int = 150  # engine: steps of the trace per run (the first 30 are warm-up).
    engine_releases: tuple[str, ...] = tuple(reversed(list(vllm_mrv2.RELEASES)[-2:]))  # engine's peers
    seed: int = 0

    @classmethod
    def make(cls, quick: bool, **given: Any) -> BenchConfig:
        """Defaults for a full run or ``quick`` (CPU CI, micro and writes only); ``given`` wins."""
        base: dict[str, Any] = {"quick": quick}
        if quick:
            base |= {"workloads": WORKLOADS, "sizes": (64, 4096), "edits": (1, 16, 256), "lengths": (1, 8)}
            base |= {"repeats": 3, "iters": 200, "target_ms": 8.0}
        return cls(**base | {k: v for k, v in given.items() if v is not None and v != ()})

    def cells(self) -> list[writes.WriteCell]:
        return [writes.WriteCell(e, ln) for e in self.edits for ln in self.lengths]


# --- what this machine can run ------------------------------------------------------------------


@dataclass
class Machine:
    caps: Capabilities
    env: H.Env
    available: list[Tier]
    unavailable: dict[Tier, str]


def detect(cfg: BenchConfig) -> Machine:
    with H.stagebuf_tier(None):
        caps = capabilities(cfg.device)
    dev, unavailable = caps.device, {}
    if caps.device_type == "cpu":
        available = [Tier.HOST, Tier.PAGEABLE]
        for t in (Tier.UVA, Tier.PINNED):
            unavailable[t] = f"tier {t.name} needs an accelerator; the target device is the CPU"
    else:
        best = Tier.UVA if caps.uva else Tier.PINNED if caps.pin_memory else Tier.PAGEABLE
        available = [t for t in (Tier.UVA, Tier.PINNED, Tier.PAGEABLE) if t >= best]
        why = " ".join(r for r in caps.reasons if r.startswith("No ")) or "see `stagebuf doctor`"
        for t in (Tier.UVA, Tier.PINNED):
            if t < best:
                unavailable[t] = f"tier {t.name} is not available on {dev}: {why}"
        unavailable[Tier.HOST] = f"tier HOST targets the CPU; the device is {dev}"
    env = H.Env(dev, caps.device_type == "cuda", caps.pin_memory, caps.uva, cfg.k, cfg.seed)
    return Machine(caps, env, available, unavailable)


def _missing(s: H.Strategy, m: Machine) -> str | None:
    """Why strategy ``s`` cannot run here (None: it can)."""
    env = m.env
    for need in s.needs:
        if need in ("cuda", "pinned", "uva") and not env.cuda:
            return f"needs a CUDA device; the device is {env.device}"
        if need == "pinned" and not env.pin_memory:
            return f"needs pinned host memory: {m.unavailable.get(Tier.PINNED, 'not available')}"
        if need == "uva" and not env.uva:
            return f"needs UVA: {m.unavailable.get(Tier.UVA, 'not available')}"
        if need == "triton" and BL.triton_error():
            return f"needs Triton: {BL.triton_error()}"
        if need == "vllm" and vllm_mrv2.available():
            return f"needs vLLM {vllm_mrv2.NEWEST}'s MRV2 modules: {vllm_mrv2.available()}"
    return m.unavailable[s.tier] if s.tier is not None and s.tier in m.unavailable else None


# --- the plan -----------------------------------------------------------------------------------


@dataclass
class Task:
    workload: str
    strategy: H.Strategy
    size: int | writes.WriteCell  # micro's N, or a writes cell (``str()`` of it is the size key)
    section: str = "results"  # or 'guard' (guard-cost variants) or 'stage_only' (staged writes, no apply)


def plan(cfg: BenchConfig, m: Machine) -> tuple[list[Task], list[dict[str, str]], list[Tier]]:
    """The tasks in the order they run; what was skipped, and why; the stagebuf tiers measured."""
    want = [Tier.parse(t) for t in cfg.tiers] if cfg.tiers else list(Tier)
    skipped, tasks, tiers = [], [], [t for t in m.available if t in want]
    for t in (t for t in want if t not in m.available):
        n = t.name.lower()
        names = f"pool_{n}, stager_{n}, staged_write_{n}, staged_writes_{n}"
        skipped.append({"workload": "*", "strategy": names, "reason": m.unavailable.get(t, "not available")})

    def add(wl: str, strategies: list[H.Strategy], sizes: list[Any], section: str = "results") -> None:
        for s in strategies if wl in cfg.workloads else []:
            why = _missing(s, m)
            if why is None:
                tasks.extend(Task(wl, s, n, section) for n in sizes)
            elif section == "results":
                skipped.append({"workload": wl, "strategy": s.name, "reason": why})

    add("micro", micro.strategies(tiers), list(cfg.sizes))
    uva_or_pinned = [t for t in tiers if t in (Tier.UVA, Tier.PINNED)]
    guard_tiers = uva_or_pinned or [t for t in tiers if t is Tier.PAGEABLE]
    at = micro.SIZE if micro.SIZE in cfg.sizes else min(cfg.sizes)
    add("micro", micro.guard_strategies(guard_tiers), [at], "guard")
    cells = cfg.cells()
    add("writes", writes.strategies(tiers), cells)
    add("writes", writes.stage_only_strategies(tiers), [writes.STAGE_ONLY_CELL], "stage_only")

    def order(t: Task) -> tuple[Any, ...]:  # by (workload, size), which run_tasks interleaves; floors first
        size = (t.size,) if isinstance(t.size, int) else (t.size.edits, t.size.length)
        return WORKLOADS.index(t.workload), size, t.section != "results", t.strategy.kind != "floor"

    return sorted(tasks, key=order), skipped, tiers


# --- running ------------------------------------------------------------------------------------


def run_tasks(
    cfg: BenchConfig, m: Machine, tasks: list[Task], console: Console, progress: bool
) -> dict[str, Any]:
    """Time ``tasks`` (in plan's order): the cases of one size built together, their repeats interleaved."""
    results: dict[str, dict[str, Any]] = {w: {} for w in cfg.workloads if w in WORKLOADS}
    sections: dict[str, dict[str, Any]] = {"guard": {}, "stage_only": {}}
    sync = lambda: H.sync(m.env.device)
    text = TextColumn("[progress.description]{task.description}")
    cols = (text, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console, transient=True, disable=not progress) as prog:
        bar = prog.add_task("bench", total=len(tasks) * (cfg.repeats + 2))
        for (wl, size), group in itertools.groupby(tasks, key=lambda t: (t.workload, t.size)):  # plan's order
            where = f"{wl} {T.SIZE_NAMES[wl]}={size}"
            live: list[tuple[Task, H.Case, int, list[float], list[float]]] = []  # (iters, host, sync µs)
            for t in group:
                prog.update(bar, description=f"{where}: warm-up {t.strategy.name}")
                with _tier_env(t.strategy.tier):
                    case = t.strategy.build(m.env, size)
                    iters = H.prepare(case.step, sync, cfg.iters, cfg.target_ms / 1000)
                    live.append((t, case, iters, [], []))
                prog.advance(bar)
            for r in range(cfg.repeats):
                prog.update(bar, description=f"{where}: repeat {r + 1}/{cfg.repeats}")
                gc.collect()
                for t, case, iters, hs, es in live[r % len(live) :] + live[: r % len(live)]:
                    with _tier_env(t.strategy.tier):
                        capabilities(m.env.device)  # probed now, never inside the timed steps
                        h, e = H.time_repeat(case.step, sync, iters)
                    hs.append(h)
                    es.append(e)
                    prog.advance(bar)
            for t, case, iters, hs, es in live:
                s = t.strategy
                with _tier_env(s.tier):
                    row = {**H.summarise(hs, es, iters), **case.finish()}
                if t.section != "results":
                    sections[t.section].setdefault(s.name, {})[str(size)] = row
                else:
                    tier = s.tier.name if s.tier is not None else None
                    entry = {"label": s.label, "kind": s.kind, "tier": tier, "sizes": {}}
                    results[wl].setdefault(s.name, entry)["sizes"][str(size)] = row
                prog.advance(bar)
    add_staging(results)
    return {"results": results, "guard_raw": sections["guard"], "stage_only": sections["stage_only"]}


def _tier_env(tier: Tier | None) -> Any:
    return H.stagebuf_tier(None if tier is None else tier.name.lower())


def add_staging(results: dict[str, dict[str, Any]]) -> None:
    """staging = strategy - floor, per size (micro)."""
    floor = results.get("micro", {}).get("floor", {"sizes": {}})
    for entry in results.get("micro", {}).values():
        for size, row in entry["sizes"].items():
            f = floor["sizes"].get(size)
            if f is not None:
                row["staging_host_us"] = round(row["host_us"] - f["host_us"], 3)
                row["staging_e2e_us"] = round(row["e2e_us"] - f["e2e_us"], 3)


def compute_ratios(
    results: dict[str, Any], stage_only: dict[str, Any], tiers_run: list[Tier], cfg: BenchConfig, device: str
) -> dict[str, Any]:
    """The micro and writes targets, settled for ``device`` (judged, or not, as ``cfg`` says)."""
    out = {**micro.targets(results, tiers_run), **writes.targets(results, stage_only, tiers_run, cfg.cells())}
    info = T.not_judged(cfg.quick, device)
    for entry in out.values():
        entry["device"] = device
        if cfg.k != 8 and entry.get("workload") == "micro":
            entry["note"] = f"K={cfg.k}; the target assumes K=8"
        T.settle(entry, entry.pop("needs"), device, info)
    return out


def target_names() -> set[str]:
    """Every target the bench computes now."""
    empty = compute_ratios({}, {}, [], BenchConfig(), "cpu")
    return set(empty) | set(E.targets(None)) | set(V.targets(None)) | set(NV.targets(None))


# --- metadata -----------------------------------------------------------------------------------


def command_line() -> str:
    """The command that made this run: ``python -m benchmarks ...`` (the bench's one entry point)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "benchmarks":
        return shlex.join(["python", "-m", "benchmarks", *argv[1:]])
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return shlex.join(argv)
    words = ["python", "-m", "benchmarks"]  # called in-process (tests): rebuilt from the options given
    for p in ctx.command.params:
        v = ctx.params.get(p.name or "")
        if not isinstance(p, click.Option) or v in (None, ()) or (v is False and not p.secondary_opts):
            continue
        if isinstance(v, bool):
            words.append(p.opts[0] if v else p.secondary_opts[0])
        elif p.multiple:
            words += [w for x in v for w in (p.opts[0], str(x))]
        else:  # (a comma-separated list the option's callback made a tuple of)
            words += [p.opts[0], ",".join(map(str, v)) if isinstance(v, tuple) else str(v)]
    return shlex.join(words)


def metadata(m: Machine, cfg: BenchConfig) -> dict[str, Any]:
    versions = dict(m.caps.versions)
    if m.env.cuda:
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        with contextlib.suppress(Exception):  # no nvidia-smi, or it said nothing
            out = subprocess.run(smi, capture_output=True, text=True, timeout=10)
            versions["driver"] = out.stdout.split()[0]
    named = os.environ.get("STAGEBUF_BENCH_COMMIT")  # a copied tree's .git may not be what was copied
    status = None if named else H.git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": command_line(), "argv": list(sys.argv), "config": asdict(cfg), "commit": H.commit(),
        "dirty": bool(status) if status is not None else None,
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(m.env.device),
        "device_name": versions.get("device_name", platform.processor() or platform.machine()),
        "versions": versions, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "capabilities": m.caps.as_dict(),
    }  # fmt: skip


# --- the command --------------------------------------------------------------------------------


def run(cfg: BenchConfig, console: Console | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Run the bench; the report (as written by ``--json``). Raises BenchCheckError on a wrong answer."""
    console = console or Console()
    t0 = time.perf_counter()
    m = detect(cfg)
    tasks, skipped, tiers = plan(cfg, m)
    report = metadata(m, cfg)
    report["tiers"] = {"available": [t.name for t in m.available], "measured": [t.name for t in tiers]}
    # one thread on the CPU, an engine's host thread (torch's parallel ops stall where a core is busy)
    old = torch.get_num_threads()
    if m.env.device.type == "cpu":
        torch.set_num_threads(1)
    report["torch_threads"] = torch.get_num_threads()
    try:
        out = run_tasks(cfg, m, tasks, console, console.is_terminal if progress is None else progress)
    finally:
        torch.set_num_threads(old)
    units = {w: R.UNITS[w] for w in cfg.workloads if w in WORKLOADS}
    report |= {"results": out["results"], "units": units, "guard_cost": micro.guard_cost(out["guard_raw"])}
    report |= {"staged_write_stage_only": out["stage_only"], "skipped": skipped}
    report["ratios"] = compute_ratios(out["results"], out["stage_only"], tiers, cfg, str(m.env.device))
    log = lambda msg: console.print(escape(msg), highlight=False)
    if "engine" in cfg.workloads:
        report.update(engine_section(cfg, m.env.device, log))
        report["ratios"] |= E.targets(report["engine"]) | V.targets(report["vs_vllm"])
        for eng in report.get("engine_also", {}).values():  # engine targets alone: no micro-benchmarks
            report["ratios"] |= E.targets(eng)
    if "nanovllm" in cfg.workloads:
        report["nanovllm"] = nanovllm_section(cfg, log)
        report["ratios"] |= NV.targets(report["nanovllm"])
    info = T.not_judged(cfg.quick, str(m.env.device))
    for entry in report["ratios"].values():  # the engine's targets too
        T.inform(entry, info)
    report["judged"] = info is None
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return report


def engine_section(cfg: BenchConfig, device: torch.device, log: Any) -> dict[str, Any]:
    """The engine workload on each ``cfg.engine_releases`` and the vs-vLLM cells on the first."""
    main, *others = cfg.engine_releases
    try:
        roots = {r: vllm_mrv2.fetch(r) for r in cfg.engine_releases}
    except vllm_mrv2.Unavailable as e:
        return {"engine": {"skipped": str(e)}, "vs_vllm": {"skipped": str(e)}}
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        why = "on a CPU, vLLM's Triton kernels need TRITON_INTERPRET=1 (tests/bench/test_engine.py checks)"
        return {"engine": {"skipped": why}, "vs_vllm": {"skipped": why}}
    runs: dict[str, Any] = {}
    for r in cfg.engine_releases:
        log(f"engine: vLLM {r}'s MRV2 modules from {roots[r]}")
        reps = max(3, cfg.repeats) if r == main else 3
        runs[r] = E.bench(device, reps, cfg.engine_steps, log, r)
        bad = [c for c in runs[r]["checks"] if c["mismatches"]]
        if bad:
            raise H.BenchCheckError(f"engine: device inputs differ from vLLM {r}'s own layer: {bad[:3]}")
    micro_ = V.run(device, cfg.edits, cfg.lengths, 3, log, main)
    return {"engine": runs[main], "engine_also": {r: runs[r] for r in others}, "vs_vllm": micro_}


def nanovllm_section(cfg: BenchConfig, log: Any) -> dict[str, Any]:
    """The nano-vllm workload (``--quick``: a 64-sequence trace, one repeat); ``skipped`` says why not."""
    why = NV.P.available()
    if why:
        return {"skipped": why}
    if cfg.quick:
        trace = NV.TraceConfig(max_num_seqs=64, running=64, max_num_batched_tokens=4096, steps=60)
        res = NV.bench(repeats=1, warmup=10, cfg=trace, log=log)
    else:
        res = NV.bench(repeats=max(3, cfg.repeats), log=log)
    bad = [c for c in res["checks"] if c["mismatches"]]
    if bad:
        raise H.BenchCheckError(f"nanovllm: inputs differ from nano-vllm's own: {bad[:2]}")
    return res


def _write(path: str, text: str, console: Console) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    console.print(f"wrote {path}", highlight=False)


PATH = click.Path(dir_okay=False)


TIERS = click.Choice([t.name.lower() for t in Tier], case_sensitive=False)


@click.command("bench")
@click.option("--quick", is_flag=True, help="Small sizes and short repeats: a CPU-only CI run (< 60 s).")
@click.option("--json", "json_path", type=PATH, help="Write the report (medians, samples, ratios, versions).")
@click.option("--plot", "plot_path", type=PATH, help="Write one PNG per workload: PATH's stem + -micro, ...")
@click.option("--markdown", "md_path", type=PATH, help="Write the tables as Markdown.")
@click.option("--from-json", type=click.Path(exists=True), help="Run nothing: show an earlier --json run.")
@click.option("--tier", "tiers", multiple=True, type=TIERS, help="Only these stagebuf tiers (repeatable).")
@click.option("--workload", "workloads", multiple=True, type=click.Choice(ALL_WORKLOADS), help="Only these.")
@click.option("--sizes", callback=H.ints, help="micro: N values, comma-separated [64,512,4096,32768].")
@click.option("--edits", callback=H.ints, help="staged writes: E, edits per apply [1,16,256,4096].")
@click.option("--lengths", callback=H.ints, help="staged writes: L, elements per edit [1,8,64]; every E x L.")
@click.option("-k", "--arrays", "k", type=click.IntRange(1, 256), help="micro: arrays per step [8].")
@click.option("--repeats", type=click.IntRange(1, 1000), help="Timed repeats per case [5].")
@click.option("--iters", type=click.IntRange(2, 10**7), help="Most steps per repeat [2000]; see --target-ms.")
@click.option("--target-ms", type=click.FloatRange(0.1, 60_000), help="Aim for repeats this long [150].")
@click.option("--device", help="Target device (default: current accelerator, else cpu).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal).")
@click.option("--strict", is_flag=True, help="Exit 3 when a judged target fails (--quick on a CPU: none).")
def bench(
    json_path: str | None,
    plot_path: str | None,
    md_path: str | None,
    from_json: str | None,
    progress: bool | None,
    strict: bool,
    **opts: Any,
) -> None:
    """Time every staging strategy (baselines, stagebuf per tier, the floor) and the targets' ratios."""
    opts["tiers"] = tuple(t.lower() for t in opts["tiers"])
    opts["workloads"] = tuple(w for w in ALL_WORKLOADS if w in opts["workloads"]) or None
    cfg = BenchConfig.make(**opts)
    console = Console(width=None if sys.stdout.isatty() else 180)
    if from_json:
        report = json.loads(Path(from_json).read_text())
    else:
        try:
            report = run(cfg, console, progress)
        except H.BenchCheckError as e:
            console.print(f"[bold red]WRONG ANSWER[/]: {escape(str(e))}", highlight=False)
            raise click.ClickException(f"the bench found a wrong device result: {e}") from e
    R.render(report, console)
    if json_path and not from_json:
        _write(json_path, json.dumps(report, indent=1, default=str) + "\n", console)
    if md_path:
        _write(md_path, R.markdown(report), console)
    if plot_path:  # last: without matplotlib, everything else is written before the error
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            files = R.plot(report, plot_path)
        except ImportError as e:
            raise click.ClickException(f"{R.PLOT_HINT} ({type(e).__name__}: {e})") from None
        console.print(f"wrote {', '.join(map(str, files))}", highlight=False)
    console.print(escape(T.verdict(report, strict)), highlight=False)
    if T.exit_status(report, strict):
        raise SystemExit(T.exit_status(report, strict))
