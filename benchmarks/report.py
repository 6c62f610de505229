"""Every table the bench prints or writes, from a report: the console, Markdown, figures and the docs.

A table is ``(title, header, rows)`` of Markdown cells; :func:`tables` gives a bench report's, all of them or
(``every=False``) the selection docs/BENCHMARKS.md shows (:func:`docs_tables`). :func:`render` prints them,
:func:`markdown` writes them, :func:`plot` draws them; ``e2e_*`` are the end-to-end report's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import targets as T
from .engine import SECTIONS
from .writes import WriteCell

Table = tuple[str, list[str], list[list[str]]]
WORKLOADS = ("micro", "writes")
UNITS = {"micro": "µs per step", "writes": "µs per apply"}
PLOT_HINT = "--plot needs matplotlib: bash scripts/setup.sh bench (or pip install -r requirements/bench.txt)"


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"


def _cells(data: dict[str, Any]) -> set[WriteCell]:
    return {WriteCell.parse(s) for e in data.values() for s in e["sizes"]}


def _micro(report: dict[str, Any], every: bool) -> list[Table]:
    """micro: each strategy's staging cost (the floor: its step time) at :data:`MICRO_SIZES` (or every N)."""
    data, cfg = report.get("results", {}).get("micro"), report.get("config", {})
    if not data:
        return []
    have = sorted({int(k) for e in data.values() for k in e["sizes"]})
    sizes = have if every else [n for n in have if n in MICRO_SIZES] or have
    rows = []
    for name, e in data.items():
        key = "e2e_us" if name == "floor" else "staging_e2e_us"
        cells = [fmt(e["sizes"].get(str(n), {}).get(key)) for n in sizes]
        rows.append([f"`{name}`" + (" (its step time)" if name == "floor" else ""), *cells])
    k = cfg.get("k", "?")
    title = f"micro: staging cost of K={k} int32 arrays of N, µs per step (synchronised, minus the floor)"
    return [(title, ["strategy", *(f"N={n}" for n in sizes)], rows)]


def _writes(report: dict[str, Any], every: bool) -> list[Table]:
    """writes: µs per apply, a column per E, at L = :data:`WRITES_LENGTH` (``every``: each L)."""
    data = report.get("results", {}).get("writes")
    if not data:
        return []
    lengths = sorted({c.length for c in _cells(data)})
    out = []
    chosen = WRITES_LENGTH if WRITES_LENGTH in lengths else lengths[len(lengths) // 2]
    for ln in lengths if every else [chosen]:
        es = sorted({c.edits for c in _cells(data) if c.length == ln})
        rows = []
        for name, e in data.items():
            got = [e["sizes"].get(str(WriteCell(x, ln))) for x in es]
            other = name.startswith("staged_write") and name.split(".")[0].endswith(OTHER_TIERS)
            if any(got) and (every or not other):
                rows.append([f"`{name}`", *(fmt(g["e2e_us"]) if g else "-" for g in got)])
        title = f"staged writes: E edits of L={ln} elements, µs per apply (synchronised)"
        out.append((title, ["strategy", *(f"E={x}" for x in es)], rows))
    return out


def _engine(eng: dict[str, Any], every: bool) -> list[Table]:
    """One engine run: each setup's preparation and buffer work, µs per step, busy (and idle) GPU."""
    meds, checks = eng.get("medians", {}), eng.get("checks", [])
    if not meds:
        return []
    groups = sorted({int(k.split("|")[1][1:]) for k in meds})
    modes = ("idle", "busy") if every else ("busy",)
    cols = [(g, w, m) for g in groups for w in ("prep", "buffer") for m in modes]
    cell = lambda v: "-" if v is None else f"{v:.0f}"
    rows = [
        [f"`{s}`", *(cell(meds.get(f"{s}|g{g}|{m}", {}).get(f"{w}_us")) for g, w, m in cols)]
        for s in eng.get("setups", [])
    ]
    ok, gpu = sum(not c["mismatches"] for c in checks), "idle and busy GPU" if every else "busy GPU"
    title = (
        f"engine: vLLM {eng.get('vllm_version', '?')}'s MRV2 input path, {gpu}, host µs per step "
        f"(identical inputs: {ok} of {len(checks)} checks)"
    )
    return [(title, ["setup", *(f"{g}g {w}" + (f" {m}" if every else "") for g, w, m in cols)], rows)]


def _length(case: str) -> int | None:
    """L of a vs-vLLM case named ``kind|ExL`` (None for ``pool|k8`` and the like)."""
    try:
        return WriteCell.parse(case.split("|", 1)[-1]).length
    except (ValueError, TypeError):
        return None


def _vs_vllm(report: dict[str, Any], every: bool) -> list[Table]:
    """The vs-vLLM cells: :data:`VS_VLLM_PEERS`' columns, edits of L = :data:`WRITES_LENGTH` (or all)."""
    med = (report.get("vs_vllm") or {}).get("median_us", {})
    if not med:
        return []
    peers = list(dict.fromkeys(p for d in med.values() for p in d))
    peers = peers if every else [p for p in peers if p in VS_VLLM_PEERS] or peers
    lengths = {_length(c) for c in med} - {None}
    ln = WRITES_LENGTH if WRITES_LENGTH in lengths or not lengths else sorted(lengths)[len(lengths) // 2]  # type: ignore[type-var]
    shown = [c for c in med if every or (_length(c) in (None, ln) and c not in VS_VLLM_LEFT_OUT)]
    rows = [[f"`{c}`".replace("|", "\\|"), *(fmt(med[c].get(p)) for p in peers)] for c in shown]
    title = "vs vLLM's own classes: host µs per step, idle GPU" + ("" if every else f" (edits of L={ln})")
    return [(title, ["case", *peers], rows)]


def _guard(report: dict[str, Any]) -> list[Table]:
    rows = [
        [g["structure"], g["tier"], str(n), f"{g['delta_e2e_us']:+.1f}", str(g["guard_waits"])]
        for by in (report.get("guard_cost") or {}).values()
        for n, g in by.items()
    ]
    title = 'guard cost: `guard="wait"` minus `"off"`, µs per step (synchronised)'
    return [(title, ["structure", "tier", "N", "cost", "waits"], rows)] if rows else []


def nanovllm_tables(report: dict[str, Any]) -> list[Table]:
    """The nano-vllm workload: each setup's preparation; the writes into the graph inputs."""
    res = report.get("nanovllm") or {}
    meds = res.get("medians", {})
    if not meds:
        return []
    modes = [m for m in ("idle", "busy") if any(k.endswith(f"|{m}") for k in meds)]
    shown = [*res.get("setups", []), *(["floor"] if any(k.startswith("floor|") for k in meds) else [])]
    name = lambda s: f"`{s}`" if s != "floor" else "`floor (token lists into one array)`"
    got = lambda s: [meds.get(f"{s}|{m}", {}).get(k) for k in ("prefill_us", "decode_us") for m in modes]
    rows = [[name(s), *("-" if v is None or v != v else f"{v:.1f}" for v in got(s))] for s in shown]
    checks = res.get("checks", [])
    title = (
        f"nanovllm: {res.get('nanovllm_version')} input preparation, host µs per step (median of "
        f"{res.get('repeats')} interleaved runs of {res.get('steps', 0) - res.get('warmup', 0)} steps); "
        f"identical inputs: {sum(not c['mismatches'] for c in checks)}/{len(checks)} checks, "
        f"{sum(c['steps'] for c in checks)} steps"
    )
    how = lambda v: "CUDA graphs" if v.get("real_graphs") else "eagerly (CPU)"
    counts = lambda v: [
        str(v["decode_steps"]),
        f"{v['d2d_copies_per_step']:.1f}",
        f"{v['fills_per_step']:.1f}",
    ]
    graphs = [[f"`{s}`", *counts(v), how(v)] for s, v in res.get("graph_writes", {}).items()]
    return [
        (title, ["setup", *(f"{k} {m}" for k in ("prefill", "decode") for m in modes)], rows),
        ("nanovllm: writes into the graph inputs per graph-replayed decode step",
         ["setup", "decode steps", "device-to-device copies", "fills", "graphs"], graphs),
    ]  # fmt: skip


def tables(report: dict[str, Any], every: bool = True) -> list[Table]:
    """Every table of a bench report but the targets (``every``: all it has; else the docs' selection)."""
    out = _micro(report, every) + _writes(report, every)
    for eng in [report.get("engine") or {}, *(report.get("engine_also") or {}).values()]:
        out += _engine(eng, every)
    return out + nanovllm_tables(report) + _vs_vllm(report, every) + _guard(report)


def measured(r: dict[str, Any]) -> str:
    if r.get("measured") is None:
        return "-"
    return f"{r['measured']:.3f}" + (f" ({r['worst_note']})" if r.get("worst_note") else "")


def goal(r: dict[str, Any]) -> str:
    return f"{r['op']} {r['target']}" + (f" {r['unit']}" if r.get("unit") else "")


def result(r: dict[str, Any]) -> str:
    """A target that was not judged: "n/a: why" or "skipped: why"."""
    s = T.status(r)
    return f"n/a: {r.get('na', '')}" if s == "n/a" else f"skipped: {r.get('skipped', '')}"


def _lines(report: dict[str, Any], item: str) -> list[str]:
    """What follows the targets: why they are not judged, why each miss missed, what was skipped."""
    info = next((str(r["info"]) for r in report["ratios"].values() if T.status(r) == "info"), None)
    out = [f"info: not judged pass/fail. Why: {info}."] if info else []
    missed = T.misses(report)
    out += ["Why each missed target missed:", *(f"{item}{m}" for m in missed)] if missed else []
    skipped = []
    for s in report.get("skipped", []):
        wl = "all workloads" if s["workload"] == "*" else s["workload"]
        skipped.append(f"{item}{wl} {s['strategy']}: {s['reason']}")
    return out + (["Skipped:", *skipped] if skipped else [])


def render(report: dict[str, Any], console: Any) -> None:
    """The report's tables, targets and verdict lines, to a rich console."""
    from rich.markup import escape
    from rich.table import Table as Rich

    plain = lambda text: text.replace("`", "").replace("\\|", "|")  # the Markdown marks out
    for title, head, rows in tables(report):
        tab = Rich(*head, title=plain(title), title_justify="left")
        for i, c in enumerate(tab.columns):
            c.justify, c.no_wrap = ("left" if i == 0 else "right"), True
        for cells in rows:
            tab.add_row(*map(plain, cells))
        console.print(tab)
    caption = "measured: a ratio of e2e µs; (…): the worst part of a target made of parts"
    head = ("target", "measured", "goal", "result")
    tab = Rich(*head, title=f"targets (device {report['device']})", title_justify="left", caption=caption)
    info = "[cyan]info[/]: not judged (see below)"
    marks = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]", "info": info}
    for name, r in report["ratios"].items():
        tab.add_row(name, measured(r), goal(r), marks.get(T.status(r)) or escape(result(r)))
    console.print(tab)
    for line in _lines(report, "  "):
        console.print(escape(line), highlight=False)
    console.print(f"total {report['elapsed_s']:.1f} s", highlight=False)


def md_table(head: list[str], rows: list[list[str]], pipes: bool = True) -> list[str]:
    """A GitHub table; without ``pipes``, without the outer pipes (the docs' word budget counts them)."""
    if not pipes:
        return [" | ".join(head), "|".join("---" for _ in head), *(" | ".join(r) for r in rows), ""]
    return [f"| {' | '.join(head)} |", "|" + "---|" * len(head), *(f"| {' | '.join(r)} |" for r in rows), ""]


def markdown(report: dict[str, Any]) -> str:
    """The report's tables as Markdown, all from this one report."""
    v, r = report.get("versions", {}), report
    lines = md_table(
        ["", ""],
        [
            ["command", f"`{r.get('command', '?')}`"],
            ["commit", f"`{r.get('commit') or '?'}`{' (dirty tree)' if r.get('dirty') else ''}"],
            ["device", f"{r.get('device_name', '?')} ({r.get('device', '?')})"],
            ["torch / CUDA runtime", f"{v.get('torch', '?')} / {v.get('cuda_runtime', '-')}"],
            ["driver", f"{v.get('driver', '-')} (CUDA driver API {v.get('cuda_driver_api', '-')})"],
            ["Triton / cuda-bindings", f"{v.get('triton', '-')} / {v.get('cuda_bindings', '-')}"],
            ["python / torch threads", f"{v.get('python', '?')} / {r.get('torch_threads', '?')}"],
            ["started (UTC) / total", f"{r.get('started_utc', '?')} / {r.get('elapsed_s', '?')} s"],
        ],
    )
    for title, head, rows in tables(report):
        lines += [f"#### {title}", "", *md_table(head, rows)]
    marks = {"pass": "pass", "fail": "**FAIL**", "info": "info (not judged)"}
    rows = [
        [f"`{n}`", t.get("description", ""), measured(t), goal(t), marks.get(T.status(t)) or result(t)]
        for n, t in report["ratios"].items()
    ]
    lines += ["#### targets", "", *md_table(["target", "definition", "measured", "goal", "result"], rows)]
    return "\n".join([*lines, *_lines(report, "- ")]) + "\n"


def plot_paths(path: str, report: dict[str, Any]) -> list[Path]:
    """The files :func:`plot` writes for ``path`` (``bench.png``): ``bench-micro.png``, one per workload."""
    p, res = Path(path), report.get("results", {})
    return [p.with_name(f"{p.stem}-{w}{p.suffix or '.png'}") for w in WORKLOADS if res.get(w)]


def plot(report: dict[str, Any], path: str) -> list[Path]:
    """One figure per workload: µs against size, a line per strategy, log axes (writes: a panel per L)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    res, out = report["results"], plot_paths(path, report)
    where = f"{report['device_name']} ({report['device']}), commit {(report.get('commit') or '?')[:10]}"
    for wl, file in zip([w for w in WORKLOADS if res.get(w)], out):
        data = res[wl]
        lens = sorted({c.length for c in _cells(data)}) if wl == "writes" else [None]
        fig = Figure(figsize=(8, 3.6 * len(lens)), layout="constrained")
        FigureCanvasAgg(fig)
        for i, ln in enumerate(lens):
            ax = fig.add_subplot(len(lens), 1, i + 1)
            for name, e in data.items():
                cells = ((WriteCell.parse(k), r["e2e_us"]) for k, r in e["sizes"].items())  # micro's N: "Nx1"
                pts = sorted((c.edits, us) for c, us in cells if ln in (None, c.length))
                style = {"baseline": "--", "floor": ":"}.get(e["kind"], "-")
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", markersize=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (int32 per array)" if wl == "micro" else "E (edits per apply)", fontsize=8)
            ax.set_ylabel(f"{UNITS[wl]} (synchronised)", fontsize=8)
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
            ax.grid(True, which="both", alpha=0.3)
            if ln is not None:
                ax.set_title(f"L = {ln} elements per edit", fontsize=8)
        fig.suptitle(f"{wl}: {UNITS[wl]} on {where}", fontsize=9)
        fig.savefig(file, dpi=110)
    return out


# --- docs/BENCHMARKS.md: a compact selection ---------------------------------------------------------

WRITES_LENGTH = 8  # The docs' staged-write and vs-vLLM tables show edits of this many elements.
NA = {"cuda": "n/a (GPU only)", "cpu": "n/a (CPU only)"}
MICRO_SIZES = (64, 32768)  # The micro table's columns, where the report has them (else every size it has).
OTHER_TIERS = ("_pinned", "_pageable")  # Staged-write rows left out of the docs' writes table.
VS_VLLM_PEERS = ("vllm_uva", "stagebuf_uva", "vllm_nopin", "stagebuf_pageable")  # the docs' vs-vLLM columns
VS_VLLM_LEFT_OUT = ("pool|k1", "backed|k1")  # vs-vLLM cases left out (the targets use the K=8 cases).


def _docs_result(r: dict[str, Any]) -> str:
    s = T.status(r)
    return "**fail**" if s == "fail" else NA.get(r.get("needs") or "", "n/a") if s == "n/a" else s


def _docs_targets(report: dict[str, Any], current: set[str]) -> list[str]:
    ratios = report.get("ratios", {})
    rows = [[f"`{k}`", measured(r), goal(r), _docs_result(r)] for k, r in ratios.items() if k in current]
    out = ["#### Targets", "", *md_table(["target", "measured", "goal", "result"], rows, pipes=False)]
    gone = ", ".join(f"`{k}`" for k in ratios if k not in current)
    return out + ([f"Left out: {gone} (not current targets of the bench).", ""] if gone else [])


def docs_tables(report: dict[str, Any], current: set[str]) -> str:
    """The Markdown docs/BENCHMARKS.md shows of one report: the run, its targets and tables."""
    v = report.get("versions", {})
    dirty = " (dirty tree)" if report.get("dirty") else ""
    lines = [
        f"Run: `{report.get('command', '?')}` at commit `{report.get('commit') or '?'}`{dirty} on "
        f"{report.get('device_name', '?')}, {report.get('started_utc', '?')[:10]}; "
        f"torch {v.get('torch', '?')}, driver {v.get('driver') or '-'}, Triton {v.get('triton') or '-'}.",
        "",
        *_docs_targets(report, current),
    ]
    for title, head, rows in tables(report, every=False):
        lines += [f"#### {title}", "", *md_table(head, rows, pipes=False)]
    return "\n".join(lines).rstrip() + "\n"


# --- the end-to-end report (benchmarks.e2e) ------------------------------------------------------------

E2E_SETUPS = ("own", "stagebuf_uva", "stagebuf_pinned", "stagebuf_pageable", "stagebuf_nopin")


def _nano(report: dict[str, Any]) -> str:
    """The nano-vllm release of an end-to-end report (reports from before the field: the default one)."""
    from . import nanovllm_pkg as P

    return str(report.get("nanovllm") or f"{P.DIST} {P.VERSION}")


def e2e_markdown(report: dict[str, Any]) -> str:
    """The end-to-end report's tables in Markdown, one caption naming machine, command and commit."""
    s, m, commit = report["summary"], report["measured"], (report.get("commit") or "?")[:10]
    lines = [
        f"{_nano(report)} end to end on {report.get('device_name', '?')}: `{report.get('command', '?')}`, "
        f"commit `{commit}`; model {report['shape']} (random weights), attention: {m['attention']}; "
        f"medians of {m['rounds']} rounds.",
        "",
        "| workload | setup | tier | decode tok/s | prefill tok/s | decode step ms (prep / forward / sample "
        "/ rest) | tokens identical |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for w, rows in s["table"].items():
        for setup, row in rows.items():
            ms = [row.get(f"decode_{k}_ms", 0) for k in ("prep", "forward", "sample", "rest")]
            split = " / ".join(f"{v:.2f}" for v in ms)
            lines.append(
                f"| {w} | {setup} | {row.get('tier') or '-'} | {row.get('decode_tokens_per_s', 0):,.0f} | "
                f"{row.get('prefill_tokens_per_s', 0):,.0f} | {row.get('decode_step_ms', 0):.2f} ({split}) | "
                f"{'yes' if row['identical'] else 'NO'} |"
            )
    lines += ["", "| target | what it compares | goal | measured | status |", "|---|---|---|---:|---|"]
    for name, r in s["ratios"].items():
        got = "-" if r["measured"] is None else f"{r['measured']:.3f}"
        lines.append(f"| `{name}` | {r['description']} | {r['op']} {r['target']} | {got} | {r['status']} |")
    share, err = s.get("own_decode_prep_share"), s.get("own_fails_without_pinning")
    if share is not None:
        lines += ["", f"The own engine's decode step is {share:.0%} host input preparation in this run."]
    if err:
        lines += [f"Without pinned memory nano-vllm's own engine does not start: `{err}`."]
    return "\n".join(lines) + "\n"


def e2e_plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s of each setup against the own engine's, decode and prefill, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = report["summary"]["table"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=120)
    for ax, w in zip(axes, ("decode", "prefill")):
        rows = table.get(w, {})
        names = [s for s in E2E_SETUPS if s in rows]
        vals = [rows[s].get(f"{w}_tokens_per_s", 0.0) for s in names]
        base = rows.get("own", {}).get(f"{w}_tokens_per_s")
        bars = ax.bar(range(len(names)), vals, color=["#888888" if n == "own" else "#2a7ab9" for n in names])
        ax.set_xticks(range(len(names)), [n.replace("stagebuf_", "") for n in names], fontsize=8)
        ax.set_title(f"{w}: {w} tokens/s", fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
        for b, v in zip(bars, vals):
            if base:
                ax.annotate(f"{v / base:.2f}×", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                            fontsize=8)  # fmt: skip
    version = _nano(report).rpartition(" ")[2]
    fig.suptitle(f"nano-vllm {version}, {report['shape']}: own vs stagebuf attached (tier)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def profile_markdown(report: dict[str, Any], k: int = 6) -> str:
    """An engine profile (``benchmarks.engine_profile``): per run, each part's µs, floor and top functions."""
    lines = []
    for key, r in report["runs"].items():
        head = "part | µs | floor µs | top functions (calls, own µs per step)"
        lines += [f"#### {key}", "", head, "---|---|---|---"]
        for part in SECTIONS:
            top = r["parts"][part]["top"][:k]
            fns = "; ".join(f"`{t['function']}` {t['calls']:.1f}, {t['own_us']:.1f}" for t in top)
            lines.append(f"{part} | {r['sections_us'][part]:.1f} | {r['floor_us'][part]:.1f} | {fns}")
        lines.append("")
    return "\n".join(lines)
