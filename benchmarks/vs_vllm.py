"""Micro-benchmarks against vLLM's own buffer classes (``buffer_utils`` of ``--release``): each case builds
the same object from vLLM's module and from stagebuf's (on a forced tier) and times a step on the host, the
GPU idle. ``pool|kK``: K ``UvaBufferPool.copy_to_uva`` of 256 int32 a step; ``backed|kK``: K
``UvaBackedTensor.copy_to_uva()``; ``writes|ExL``: E ``stage_write`` calls of L values, then ``apply_write``
(``stage|ExL``: the calls alone; ``fused|ExL``: ``FusedStagedWriter.apply`` over two tables);
``prompt|KIND|N``: a prompt of N tokens staged and applied. ``python -m benchmarks.vs_vllm`` runs them alone.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from . import targets as T
from . import vllm_mrv2
from .harness import commit, env_var, ints, stagebuf_tier, tiers, turns
from .vllm_mrv2 import release_suffix

N = 256
Ints = tuple[int, ...]
Step = Callable[[int], None]
PROMPT_KINDS = ("tokens", "ndarray", "list")
PROMPT_LENGTHS = (16, 1024, 16384, 131072)


def writes_case(
    bu: Any, device: torch.device, e: int, ln: int, fused: bool, stage_only: bool = False
) -> Step:
    rows, cols = max(4096, e), max(64, ln)
    rng = np.random.default_rng(e * 100 + ln)
    rows_sel = rng.permutation(rows)[:e].tolist()
    vals = [rng.integers(0, 1 << 20, ln).tolist() for _ in range(4)]
    if not fused:
        t = bu.StagedWriteTensor((rows, cols), torch.int32, device)
        sw, end = t.stage_write, t.clear_staged_writes if stage_only else t.apply_write

        def step(i: int) -> None:
            v = vals[i & 3]
            for r in rows_sel:
                sw(r, 0, v)
            end()

        return step
    ts = [bu.StagedWriteTensor((rows, cols), torch.int32, device) for _ in range(2)]
    w = bu.FusedStagedWriter(device, 2 * rows)
    ptrs = torch.tensor([t.gpu.data_ptr() for t in ts], dtype=torch.uint64, device=device)
    strides = torch.tensor([t.gpu.stride(0) for t in ts], dtype=torch.int64, device=device)
    half, a, b = (e + 1) // 2, ts[0].stage_write, ts[1].stage_write

    def fstep(i: int) -> None:
        v = vals[i & 3]
        for k, r in enumerate(rows_sel):
            (a if k < half else b)(r, 0, v)
        w.apply(ts, ptrs, strides)

    return fstep


def prompt_case(bu: Any, device: torch.device, kind: str, n: int, release: str) -> Step:
    """One prompt of ``n`` tokens staged and applied, as a ``TokenBuffer``, an ndarray or a list."""
    rng = np.random.default_rng(n)
    ids = [rng.integers(0, 152_000, n, dtype=np.int32) for _ in range(4)]
    tb = vllm_mrv2.token_buffer(release) or (lambda a: array("i", a.tobytes()))
    src = [tb(a) if kind == "tokens" else a.tolist() if kind == "list" else a for a in ids]
    t = bu.StagedWriteTensor((4, n), torch.int32, device)

    def step(i: int) -> None:
        t.stage_write(i & 3, 0, src[i & 3])
        t.apply_write()

    return step


def pool_case(bu: Any, device: torch.device, k: int) -> Step:
    pools = [bu.UvaBufferPool(N, torch.int32) for _ in range(k)]
    srcs = [np.arange(N, dtype=np.int32) + j for j in range(k)]

    def step(i: int) -> None:
        for p, s in zip(pools, srcs):
            p.copy_to_uva(s)

    return step


def backed_case(bu: Any, device: torch.device, k: int) -> Step:
    ts = [bu.UvaBackedTensor(N, torch.int32) for _ in range(k)]

    def step(i: int) -> None:
        for t in ts:
            t.np[i % N] = i
            t.copy_to_uva()

    return step


def cases(
    device: torch.device,
    edits: tuple[int, ...],
    lengths: tuple[int, ...],
    release: str | None = None,
    stage: bool = False,
) -> list[tuple[str, Callable[[Any], Step]]]:
    """The cells (name, a builder of a step from a ``buffer_utils``); ``stage``: also stage-only."""
    p = functools.partial
    out = [
        (f"{kind}|k{k}", p(make, device=device, k=k))
        for k in (1, 8)
        for kind, make in (("pool", pool_case), ("backed", backed_case))
    ]
    for e, ln in ((e, ln) for e in edits for ln in lengths):
        w = p(writes_case, device=device, e=e, ln=ln)
        out.append((f"writes|{e}x{ln}", p(w, fused=False)))
        out += [(f"stage|{e}x{ln}", p(w, fused=False, stage_only=True))] if stage and e <= 256 else []
        out += [(f"fused|{e}x{ln}", p(w, fused=True))] if e >= 2 else []
    if release is not None:
        out += [
            (f"prompt|{kind}|{n}", p(prompt_case, device=device, kind=kind, n=n, release=release))
            for kind in PROMPT_KINDS
            for n in PROMPT_LENGTHS
        ]
    return out


def steps_of(cell: str, steps: int) -> int:
    """The timed steps of a cell: fewer for the largest (4096 edits of 64)."""
    return max(10, steps // 4) if cell.endswith("4096x64") else steps


def run(
    device: torch.device,
    edits: tuple[int, ...],
    lengths: tuple[int, ...],
    repeats: int,
    log: Callable[[str], None],
    release: str,
    steps: int = 60,
) -> dict[str, Any]:
    """Every case on vLLM ``release``'s layer and stagebuf's tiers (UVA also with Triton forced)."""
    cuda = device.type == "cuda"
    vllm = lambda pin: vllm_mrv2.load("vllm", pin=pin, device=device, release=release).buffer_utils
    vllm_uva = vllm(True)
    peers: list[tuple[str, Any, str | None]] = [("vllm_uva", vllm_uva, None)]
    peers += [("vllm_nopin", vllm(False), None)] if cuda else []
    sb, ts = vllm_mrv2.stagebuf_buffer_utils(vllm_uva, release), tiers(device)
    peers += [(f"stagebuf_{t}", sb, t) for t in ts]
    if cuda and ts[:1] == ["uva"]:
        peers.append(("stagebuf_uva_triton", sb, "uva"))  # the Triton kernel forced (writes and fused)
    raw: dict[str, dict[str, list[float]]] = {}
    for rep in range(repeats):
        for cell, make in cases(device, edits, lengths, release, stage=True):
            for name, bu, tier in peers:
                forced = name.endswith("_triton")
                if forced and not cell.startswith(("fused", "writes")):
                    continue
                if cell.startswith(("stage", "prompt")) and name not in ("vllm_uva", "stagebuf_uva"):
                    continue
                kernel = env_var("STAGEBUF_WRITE_KERNEL", "triton") if forced else contextlib.nullcontext()
                with stagebuf_tier(tier), kernel:
                    us = turns([make(bu)], device, steps_of(cell, steps), 10)[0]
                raw.setdefault(cell, {}).setdefault(name, []).append(us)
        log(f"vs_vllm repeat {rep + 1}/{repeats} done")
    med = {c: {p: float(np.median(v)) for p, v in d.items()} for c, d in raw.items()}
    return {"median_us": med, "raw_us": raw, "repeats": repeats, "steps": steps, "vllm_version": release}


def targets(res: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """stagebuf UVA against vLLM's classes on UVA: writes, pools, backed tensors and prompts."""
    med = (res or {}).get("median_us", {})
    release = (res or {}).get("vllm_version") or vllm_mrv2.NEWEST
    peer, us, them = release.rpartition(".")[0], "stagebuf_uva", "vllm_uva"
    gpu = "needs a GPU"

    def worst(kind: str) -> tuple[str, float] | tuple[None, None]:
        """The cell of ``kind`` where stagebuf UVA / vLLM UVA is largest: (its size, the ratio)."""
        cells = [(c, d) for c, d in med.items() if c.startswith(kind) and d.get(them)]
        got = [(c.split("|", 1)[1], d[us] / d[them]) for c, d in cells]
        return max(got, key=lambda x: x[1], default=(None, None))

    out = {}
    cell, r = worst("writes|")
    what = f"StagedWriteTensor, E stage_write calls of L values + apply_write: stagebuf UVA / vLLM {peer}'s"
    what += " on UVA, worst E x L cell"
    e = out["vllm_staged_write_per_cell"] = T.target(what, "engine", r, "<=", 0.6, f"E x L = {cell}", gpu)
    if e["passed"] is False:
        d, st = med[f"writes|{cell}"], med.get(f"stage|{cell}", {})
        parts = []
        for who, p in (("stagebuf", us), (f"vLLM {peer}", them)):
            split = f" ({st[p]:.1f} staging + {d[p] - st[p]:.1f} apply)" if p in st else ""
            parts.append(f"{who} {d[p]:.1f} µs{split}")
        e[T.REASON] = f"E x L = {cell}: {' against '.join(parts)}"
    for case, label in (("pool", "UvaBufferPool.copy_to_uva"), ("backed", "UvaBackedTensor.copy_to_uva")):
        d, one = med.get(f"{case}|k8", {}), med.get(f"{case}|k1", {})
        what = f"{label}, 8 per step of 256 int32: stagebuf UVA / vLLM {peer}'s on UVA"
        r = d[us] / d[them] if us in d and d.get(them) else None
        e = out[f"vllm_{case}_copy_to_uva"] = T.target(what, "engine", r, "<=", 0.8, missing=gpu)
        if e["passed"] is False and us in one and them in one:
            e[T.REASON] = (
                f"a call: {d[us] / 8:.2f} µs against vLLM's {d[them] / 8:.2f}; with one call a step (each "
                f"pays the slot guard's event record and query) {one[us]:.1f} against {one[them]:.1f}: "
                "vLLM's has no guard"
            )
    cell, r = worst("prompt|")
    what = (
        f"StagedWriteTensor.stage_write of one prompt + apply_write (as vLLM {peer} passes it, an ndarray or "
        f"a list; 16 to 131 072 tokens): stagebuf UVA / vLLM {peer}'s on UVA, worst cell"
    )
    e = out[f"vllm_stage_prompt{release_suffix(release)}"] = T.target(what, "engine", r, "<=", 1.0, cell, gpu)
    if e["passed"] is False:
        d = med[f"prompt|{cell}"]
        e[T.REASON] = f"{cell}: stagebuf {d[us]:.1f} µs against vLLM {peer}'s {d[them]:.1f}"
    return out


@click.command()
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False), help="The report.")
@click.option("--repeats", default=3, show_default=True, help="Interleaved repeats of every cell.")
@click.option("--steps", default=60, show_default=True, help="Timed steps a cell and repeat.")
@click.option("--edits", default="1,16,256,4096", show_default=True, callback=ints, help="E of the cells.")
@click.option("--lengths", default="1,8,64", show_default=True, callback=ints, help="L of the cells.")
@vllm_mrv2.release_option("The vLLM release whose classes are the peer.")
def main(json_path: str, repeats: int, steps: int, edits: Ints, lengths: Ints, release: str) -> None:
    """Time the vs-vLLM cells alone; the report's commit is ``STAGEBUF_BENCH_COMMIT`` (else git's HEAD)."""
    vllm_mrv2.fetch(release)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise click.UsageError("on a CPU, vLLM's Triton kernels need TRITON_INTERPRET=1")
    t0 = time.time()
    res = run(device, edits, lengths, repeats, lambda s: click.echo(s, err=True), release, steps)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0))
    report = {"commit": commit() or "unknown", "started_utc": started, "device": str(device), "vs_vllm": res}
    Path(json_path).write_text(json.dumps(report) + "\n")
    click.echo(f"vs_vllm: {len(res['raw_us'])} cells in {time.time() - t0:.1f} s -> {json_path}")


if __name__ == "__main__":
    main()
