"""``python -m benchmarks.compare``: is a change slower than the noise? Bench reports, cell by cell.

Give reports of the code before and after a change, interleaved on one machine. Per cell a side's time is the
geometric mean of its runs' medians, the noise the largest ratio of two run medians of one side; a cell is
*slower beyond noise* when every after run is above every before run and after/before exceeds 1 plus the
noise. Peers (vLLM's classes, the baselines, the floor) run the same code on both sides: their flags are the
noise's rate. ``--drift`` divides each run by its drift factor (the peers' median move in that run).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

Samples = list[float]
_TIE = 1 + 1e-9  # medians equal to float rounding (runs divided by their drift factors) are not a move


@dataclass
class Cell:
    """One measured quantity in both sets: its runs' samples (µs), before and after."""

    key: str
    ours: bool
    before: list[Samples]
    after: list[Samples]

    @property
    def ratio(self) -> float:
        return _center(self.after) / _center(self.before)

    @property
    def noise(self) -> float | None:
        """The largest ratio between two run medians of one side, minus 1 (None: one run a side)."""
        spreads = [max(m) / min(m) - 1 for m in (_medians(self.before), _medians(self.after)) if len(m) > 1]
        return max(spreads) if spreads else None

    def _beyond(self, up: bool) -> bool:
        """Every run of one side above every run of the other by more than the (known) noise."""
        if self.noise is None:
            return False
        low, high = (self.before, self.after) if up else (self.after, self.before)
        separated = min(_medians(high)) > max(_medians(low)) * _TIE
        return separated and (self.ratio if up else 1 / self.ratio) > (1 + self.noise) * _TIE

    slower = property(lambda self: self._beyond(True))
    faster = property(lambda self: self._beyond(False))

    def row(self) -> dict[str, Any]:
        noise = None if self.noise is None else round(self.noise, 4)
        meds = {"before_medians_us": _medians(self.before), "after_medians_us": _medians(self.after)}
        out = {"cell": self.key, "ours": self.ours, **meds, "ratio": round(self.ratio, 4), "noise": noise}
        return out | {"slower": self.slower, "faster": self.faster}


def _medians(runs: list[Samples]) -> list[float]:
    return [statistics.median(r) for r in runs]


def _center(runs: list[Samples]) -> float:
    """One side's time: the geometric mean of its runs' medians (a run is one process's repeats)."""
    return statistics.geometric_mean(_medians(runs))


def cells_of(report: dict[str, Any], metric: str) -> Iterator[tuple[str, bool, Samples]]:
    """Every cell of one report: (key, ours, samples in µs); a micro or writes cell's time is ``metric``."""
    sample_key = metric.replace("_us", "_samples_us")
    for wl, strategies in report.get("results", {}).items():
        for name, entry in strategies.items():
            ours = entry.get("kind") == "stagebuf"
            for size, row in entry.get("sizes", {}).items():
                if row.get(sample_key):
                    yield f"{wl} {name} {size}", ours, list(row[sample_key])
    engine = report.get("engine", {})
    for setup, runs in engine.get("runs", {}).items():
        for part in ("prep_us", "buffer_us"):
            samples = [r[part] for r in runs if part in r]
            if samples:
                yield f"engine {setup} {part[:-3]}", setup.startswith("stagebuf"), samples
    for cell, per in report.get("vs_vllm", {}).get("raw_us", {}).items():
        for name, samples in per.items():
            if samples:
                yield f"vs_vllm {cell} {name}", name.startswith("stagebuf"), list(samples)


def pair(
    before: list[dict[str, Any]], after: list[dict[str, Any]], metric: str, drift: list[float] | None = None
) -> list[Cell]:
    """The cells every report measured; each run's samples divided by its ``drift`` factor."""
    sides = [[{k: (o, s) for k, o, s in cells_of(r, metric)} for r in reports] for reports in (before, after)]
    first = sides[0][0]
    common = [k for k in first if all(k in run for side in sides for run in side)]
    f = drift or [1.0] * (len(before) + len(after))
    fb, fa = f[: len(before)], f[len(before) :]

    def runs(side: int, k: str, fs: list[float]) -> list[Samples]:
        return [[v / x for v in run[k][1]] for run, x in zip(sides[side], fs)]

    return [Cell(k, first[k][0], runs(0, k, fb), runs(1, k, fa)) for k in common]


def drift_factors(cells: list[Cell]) -> list[float]:
    """Per report: the median over the peers' cells of its median over the cell's geomean."""
    peers = [c for c in cells if not c.ours]
    n = len(cells[0].before) + len(cells[0].after) if cells else 0
    if not peers:
        return [1.0] * n
    rel = [[m / _center(c.before + c.after) for m in _medians(c.before + c.after)] for c in peers]
    return [statistics.median(r[i] for r in rel) for i in range(n)]


def summary(cells: list[Cell]) -> dict[str, Any]:
    """Per group (ours, peers): cells, their median and geometric-mean ratio, slower and faster counts."""
    out: dict[str, Any] = {}
    for name, group in (("ours", [c for c in cells if c.ours]), ("peers", [c for c in cells if not c.ours])):
        if not group:
            continue
        ratios = [c.ratio for c in group]
        out[name] = {
            "cells": len(group),
            "median_ratio": round(statistics.median(ratios), 3),
            "geomean_ratio": round(statistics.geometric_mean(ratios), 3),
            "slower_beyond_noise": [c.key for c in group if c.slower],
            "faster_beyond_noise": [c.key for c in group if c.faster],
        }
    return out


ONE_RUN_WARNING = (
    "warning: one run a side: a cell's noise (how far the same code moves between runs) is unknown, "
    "so no cell is judged slower or faster; give two or more --before and --after reports "
    "(interleaved: before, after, before, after)"
)


def show(rows: list[dict[str, Any]], width: int) -> None:
    """The 25 largest ratios of ``rows`` as a table (``python -m benchmarks.ab``'s too)."""
    ours = any("ours" in r for r in rows)
    head = ["cell", *(["ours"] if ours else []), "before µs", "after µs", "after/before", "noise", "verdict"]
    table = Table(*head)
    for r in sorted(rows, key=lambda r: -r["ratio"])[:25]:
        noise = "-" if r["noise"] is None else f"{r['noise']:.3f}"
        verdict = "SLOWER" if r["slower"] else "faster" if r["faster"] else ""
        mark = ["yes" if r["ours"] else ""] if ours else []
        table.add_row(
            r["cell"], *mark, f"{r['before']:.1f}", f"{r['after']:.1f}", f"{r['ratio']:.3f}", noise, verdict
        )
    Console(width=None if Console().is_terminal else width).print(table)


METRICS = click.Choice(["e2e_us", "host_us"])


@click.command()
@click.option("--before", "before", multiple=True, required=True, help="An old-code report (repeatable).")
@click.option("--after", "after", multiple=True, required=True, help="A new-code report (repeatable).")
@click.option("--metric", type=METRICS, default="e2e_us", help="The micro and writes cells' time [e2e_us].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write cells and summary.")
@click.option("--drift", is_flag=True, help="Divide each run's samples by its drift factor (see above).")
def main(
    before: tuple[str, ...], after: tuple[str, ...], metric: str, json_path: str | None, drift: bool
) -> None:
    """Compare bench reports of the code before and after a change, cell by cell."""
    b, a = ([json.loads(Path(p).read_text()) for p in side] for side in (before, after))
    cells = pair(b, a, metric)
    if not cells:
        raise click.ClickException("no cell is in every report")
    factors = drift_factors(cells) if drift else None
    if factors:
        cells = pair(b, a, metric, factors)
        listed = ", ".join(f"{x:.3f}" for x in factors)
        click.echo(f"per-run drift factors, divided out (before, then after): {listed}")
    if len(b) < 2 and len(a) < 2:
        click.echo(ONE_RUN_WARNING, err=True)
    rows = [c.row() for c in cells]
    show([r | {"before": _center(c.before), "after": _center(c.after)} for r, c in zip(rows, cells)], 160)
    s = summary(cells)
    for name, g in s.items():
        click.echo(
            f"{name}: {g['cells']} cells, median after/before {g['median_ratio']}, geometric mean "
            f"{g['geomean_ratio']}; slower beyond noise {len(g['slower_beyond_noise'])}, "
            f"faster {len(g['faster_beyond_noise'])}"
        )
    if json_path:
        runs = lambda rs: [{"commit": r.get("commit"), "started_utc": r.get("started_utc")} for r in rs]
        data = {"before": runs(b), "after": runs(a), "metric": metric, "summary": s, "cells": rows}
        data["drift_factors"] = factors and [round(x, 4) for x in factors]
        Path(json_path).write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
