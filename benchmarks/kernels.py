"""``python -m benchmarks.kernels``: which staged-write kernel is cheaper per shape; what ``auto`` costs.

A cell is E edits of L values over T int32 tables of 4096 x 64, applied by one writer (``FusedStagedWriter``
for T > 1) with the kernel forced to ``scatter``, to ``triton`` or left to ``auto``, the three in turns: each
stages untimed, then times the apply on an idle GPU. The table gives triton/scatter and what ``auto`` ran.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from .harness import env_var, stagebuf_tier, turns

KERNELS = ("scatter", "triton", "auto")
ROWS, COLS = 4096, 64


def writer(device: torch.device, targets: int, edits: int, length: int, kernel: str) -> tuple[Any, ...]:
    """(stage(i), apply(i), the targets, the writer) of one side of the cell, with ``kernel`` forced."""
    import stagebuf

    rng = np.random.default_rng(edits * 100 + length)
    rows = [rng.permutation(ROWS)[: -(-edits // targets)].tolist() for _ in range(targets)]
    per = [len(r) for r in np.array_split(np.arange(edits), targets)]
    vals = [rng.integers(0, 1 << 20, length).tolist() for _ in range(4)]
    with env_var("STAGEBUF_WRITE_KERNEL", kernel):
        ts = [stagebuf.StagedWriteTensor((ROWS, COLS), torch.int32, device) for _ in range(targets)]
        fused = stagebuf.FusedStagedWriter(device, ROWS * targets) if targets > 1 else None
    plan = [(t.stage_write, r[:k]) for t, r, k in zip(ts, rows, per)]

    def stage(i: int) -> None:
        v = vals[i & 3]
        for sw, rs in plan:
            for r in rs:
                sw(r, 0, v)

    if fused is None:
        return stage, lambda i: ts[0].apply_write(), ts, ts[0]
    ptrs = torch.tensor([t.gpu.data_ptr() for t in ts], dtype=torch.uint64, device=device)
    strides = torch.tensor([t.gpu.stride(0) for t in ts], dtype=torch.int64, device=device)
    return stage, lambda i: fused.apply(ts, ptrs, strides), ts, fused


def cell(device: torch.device, targets: int, edits: int, length: int, steps: int) -> dict[str, Any]:
    """The median apply (µs) of each kernel, the staging untimed, and the kernel ``auto`` ran."""
    stages, applies, _, writers = zip(*(writer(device, targets, edits, length, k) for k in KERNELS))
    us = turns(list(applies), device, steps, 10, prep=list(stages))
    sizes = {"targets": targets, "edits": edits, "length": length}
    return sizes | {"us": dict(zip(KERNELS, us)), "auto_ran": writers[2].kernel}


def run(device: torch.device, tiers: list[str], steps: int, log: Callable[[str], None] = print) -> list[dict]:
    out = []
    for tier in tiers:
        with stagebuf_tier(tier):
            for targets in (1, 2, 4, 8):
                for edits in (16, 64, 256, 1024, 4096):
                    for length in (1, 2, 8, 64):
                        n = max(10, steps // 4) if edits * length > 50_000 else steps
                        out.append({"tier": tier, **cell(device, targets, edits, length, n)})
        log(f"kernels: {tier} done")
    return out


@click.command()
@click.option("--steps", default=100, show_default=True, help="Timed applies a kernel per cell.")
@click.option("--tiers", default="uva,pinned,pageable", show_default=True, help="Comma-separated.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every cell.")
def main(steps: int, tiers: str, json_path: str | None) -> None:
    """Time scatter, triton and auto for every cell on a CUDA device."""
    if not torch.cuda.is_available():
        raise click.UsageError("needs a CUDA device (the Triton kernel runs only there)")
    cells = run(torch.device("cuda"), tiers.split(","), steps, log=lambda s: click.echo(s, err=True))
    table = Table("tier", "T x E x L", "scatter µs", "triton µs", "triton/scatter", "auto ran", "auto/best")
    worst, right = 1.0, 0
    for c in cells:
        us = c["us"]
        best = min(us["scatter"], us["triton"])
        worst = max(worst, us["auto"] / best)
        right += c["auto_ran"] == ("triton" if us["triton"] < us["scatter"] else "scatter")
        table.add_row(
            c["tier"], f"{c['targets']} x {c['edits']} x {c['length']}", f"{us['scatter']:.1f}",
            f"{us['triton']:.1f}", f"{us['triton'] / us['scatter']:.3f}", c["auto_ran"],
            f"{us['auto'] / best:.3f}",
        )  # fmt: skip
    Console(width=None if Console().is_terminal else 140).print(table)
    click.echo(f"auto ran the faster kernel in {right} of {len(cells)} cells; at worst auto/best {worst:.3f}")
    if json_path:
        Path(json_path).write_text(json.dumps(cells, indent=1) + "\n")


if __name__ == "__main__":
    main()
