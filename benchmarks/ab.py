"""``python -m benchmarks.ab --before REV``: is a change slower? The old and the new code in one process.

Three copies of the package build the vs-vLLM cells (:mod:`benchmarks.vs_vllm`) on each tier: *before*
(``src/stagebuf`` at ``REV``, or a folder holding a ``stagebuf``), *after* (the checkout's) and *control* (a
second copy of after), their steps taking turns. Per cell and round a side's time is its median step; a cell
is SLOWER when after/before exceeds 1 plus the noise (control against after) in every round, faster likewise.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from . import vllm_mrv2, vs_vllm
from .compare import show
from .harness import stagebuf_tier, tiers, turns

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("before", "after", "control")


def load_copy(source: str, name: str, where: Path) -> Any:
    """A copy of the package imported as ``name``: git revision ``source``'s, or a directory's."""
    dest = where / name
    if (Path(source) / "stagebuf" / "__init__.py").is_file():
        shutil.copytree(Path(source) / "stagebuf", dest)
    else:
        git = ["git", "-C", str(ROOT), "archive", source, "src/stagebuf"]
        blob = subprocess.run(git, check=True, capture_output=True).stdout
        (unpacked := where / f"{name}.tree").mkdir()
        subprocess.run(["tar", "-x", "-C", str(unpacked)], input=blob, check=True)
        (unpacked / "src" / "stagebuf").rename(dest)
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    return importlib.import_module(name)


def verdict(rounds: list[list[float]]) -> dict[str, Any]:
    """A cell from its rounds' (before, after, control) medians: ratio, noise, slower or faster."""
    ratios = [a / b for b, a, _ in rounds]
    noise = max(abs(c / a - 1) for _, a, c in rounds)
    slower, faster = all(r > 1 + noise for r in ratios), all(1 / r > 1 + noise for r in ratios)
    ratio = float(np.exp(np.mean(np.log(ratios))))
    return {"ratio": ratio, "round_ratios": ratios, "noise": noise, "slower": slower, "faster": faster}


def run(
    rev: str, device: torch.device, rounds: int, steps: int, log: Callable[[str], None], release: str | None
) -> dict[str, Any]:
    """Every vs-vLLM cell on every tier, ``rounds`` times, each side's classes as ``buffer_utils``; the prompt
    cells too where ``release`` names the vLLM release whose ``TokenBuffer`` they stage."""
    import stagebuf

    with tempfile.TemporaryDirectory() as tmp:
        here = str(Path(stagebuf.__file__).resolve().parent.parent)  # the after side's own source
        at = Path(tmp)
        pkgs = (load_copy(rev, "stagebuf_before", at), stagebuf, load_copy(here, "stagebuf_control", at))
        sides = [
            types.SimpleNamespace(**{n: getattr(p, n) for n in vllm_mrv2.SUBSTITUTED}) for p in pkgs
        ]  # the plugin's names
        medians: dict[str, list[list[float]]] = {}
        for r in range(rounds):
            for name, make in vs_vllm.cases(device, (1, 16, 256, 4096), (1, 8, 64), release):
                for t in tiers(device):
                    with stagebuf_tier(t, pkgs[0], pkgs[2]):
                        order = sides[r % 3 :] + sides[: r % 3]  # which side builds (and starts) first
                        built = {id(s): make(s) for s in order}
                        steps_ = [built[id(s)] for s in sides]
                        got = turns(steps_, device, vs_vllm.steps_of(name, steps), 10)
                    medians.setdefault(f"{name} {t}", []).append(got)
            log(f"ab round {r + 1}/{rounds} done")
    cells = [{"cell": k, "medians_us": m, **verdict(m)} for k, m in medians.items()]
    out = {"before": rev, "device": str(device), "rounds": rounds, "steps": steps}
    return out | {"sides": SIDES, "cells": cells}


@click.command()
@click.option(
    "--before", "rev", required=True, help="The old code: a git revision, or a folder holding a stagebuf."
)
@click.option("--rounds", default=3, show_default=True, help="Rounds over every cell, fresh objects each.")
@click.option("--steps", default=60, show_default=True, help="Timed steps a side per cell and round.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every cell.")
@click.option(
    "--prompts",
    default=None,
    type=click.Choice(list(vllm_mrv2.RELEASES)),
    help="Add the prompt cells (tokens as this vLLM release's TokenBuffer).",
)
def main(rev: str, rounds: int, steps: int, json_path: str | None, prompts: str | None) -> None:
    """Time the vs-vLLM cells of the code at REV and of the checkout in one process, in turns."""
    if rounds < 2:
        raise click.BadParameter("needs 2 or more (the noise is judged across rounds)", param_hint="--rounds")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the bench's CPU runs: one thread, an engine's host thread
    res = run(rev, device, rounds, steps, lambda s: click.echo(s, err=True), prompts)
    cells = res["cells"]
    side = lambda c, i: float(np.median([m[i] for m in c["medians_us"]]))
    show([c | {"before": side(c, 0), "after": side(c, 1)} for c in cells], 140)
    mid, slower = np.median([c["ratio"] for c in cells]), sum(c["slower"] for c in cells)
    click.echo(
        f"{len(cells)} cells against {rev}: median after/before {mid:.3f}; slower beyond noise "
        f"{slower}, faster {sum(c['faster'] for c in cells)}"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
