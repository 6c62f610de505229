"""Micro-benchmarks against vLLM's own buffer classes (``buffer_utils`` of ``vllm_mrv2.NEWEST``, or of
``--release``, loaded by ``vllm_mrv2``).

Each case builds the same object from vLLM's module and from stagebuf's (on a
forced tier) and times one step on the host, the GPU idle (synchronised between
steps, outside the timing); medians over steps, then over interleaved repeats.

* ``pool``: ``UvaBufferPool.copy_to_uva`` of a numpy array of 256 int32, K pools
  per step (K=8: the sampler's block of publishes; K=1: a pool alone, which
  pays stagebuf's slot-guard event every call).
* ``backed``: ``UvaBackedTensor.copy_to_uva()`` of K tensors of 256, one value
  changed in each per step.
* ``writes``: ``StagedWriteTensor``: E ``stage_write`` calls of L values on
  distinct rows of a (max(4096, E), max(64, L)) int32 table, then ``apply_write``.
* ``fused``: ``FusedStagedWriter.apply`` over two such tables (E/2 edits each),
  with vLLM's call shape: device tensors of the tables' pointers and strides.
* ``stage``: a ``writes`` cell's ``stage_write`` calls alone (then ``clear_staged_writes``), E <= 256, for
  vLLM UVA and stagebuf UVA: what of a cell is staging and what is the apply.

``python -m benchmarks.vs_vllm --json FILE`` runs these cells alone (half a minute on an H200, where
the full bench takes minutes) and writes a report that ``benchmarks.compare`` reads: one side's run
of a compare (``scripts/gpu.sh compare`` runs both sides in turns).
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

from . import vllm_mrv2
from .engine import env_var, stagebuf_tier

N = 256


def _kernel(kernel: str | None) -> Any:
    """``STAGEBUF_WRITE_KERNEL`` for the block (read when a writer is made); None leaves it as it is."""
    return env_var("STAGEBUF_WRITE_KERNEL", kernel) if kernel is not None else contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step: Callable[[int], None], device: torch.device, steps: int, warmup: int) -> float:
    ts: list[float] = []
    clock = time.perf_counter
    for i in range(steps + warmup):
        t0 = clock()
        step(i)
        t1 = clock()
        _sync(device)
        if i >= warmup:
            ts.append(t1 - t0)
    return float(np.median(ts)) * 1e6


def _writes_case(
    bu: Any, device: torch.device, e: int, ln: int, fused: bool, stage_only: bool = False
) -> Callable[[int], None]:
    rows, cols = max(4096, e), max(64, ln)
    rng = np.random.default_rng(e * 100 + ln)
    rows_sel = rng.permutation(rows)[:e].tolist()
    vals = [rng.integers(0, 1 << 20, ln).tolist() for _ in range(4)]
    if not fused:
        t = bu.StagedWriteTensor((rows, cols), torch.int32, device)
        sw = t.stage_write
        end = t.clear_staged_writes if stage_only else t.apply_write

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
    half = (e + 1) // 2
    a, b = ts[0].stage_write, ts[1].stage_write

    def fstep(i: int) -> None:
        v = vals[i & 3]
        for k, r in enumerate(rows_sel):
            (a if k < half else b)(r, 0, v)
        w.apply(ts, ptrs, strides)

    return fstep


PROMPT_KINDS = ("tokens", "ndarray", "list")
PROMPT_LENGTHS = (16, 1024, 16384, 131072)


def _prompt_case(bu: Any, device: torch.device, kind: str, n: int, release: str) -> Callable[[int], None]:
    """One prompt of ``n`` tokens staged (``stage_write``) and applied, as the model runner adds a request:
    ``tokens`` as the release passes prompts (its ``TokenBuffer``, else an ``array('i')``), an int32
    ndarray, or a list. The prompt is made before the timing, four of them in turn."""
    rng = np.random.default_rng(n)
    ids = [rng.integers(0, 152_000, n, dtype=np.int32) for _ in range(4)]
    tb = vllm_mrv2.token_buffer(release) or (lambda a: array("i", a.tobytes()))
    if kind == "tokens":
        src: list[Any] = [tb(a) for a in ids]
    elif kind == "list":
        src = [a.tolist() for a in ids]
    else:
        src = ids
    t = bu.StagedWriteTensor((4, n), torch.int32, device)

    def step(i: int) -> None:
        t.stage_write(i & 3, 0, src[i & 3])
        t.apply_write()

    return step


def _pool_case(bu: Any, device: torch.device, k: int) -> Callable[[int], None]:
    pools = [bu.UvaBufferPool(N, torch.int32) for _ in range(k)]
    srcs = [np.arange(N, dtype=np.int32) + j for j in range(k)]

    def step(i: int) -> None:
        for p, s in zip(pools, srcs):
            p.copy_to_uva(s)

    return step


def _backed_case(bu: Any, device: torch.device, k: int) -> Callable[[int], None]:
    ts = [bu.UvaBackedTensor(N, torch.int32) for _ in range(k)]

    def step(i: int) -> None:
        for t in ts:
            t.np[i % N] = i
            t.copy_to_uva()

    return step


def run(
    device: torch.device,
    edits: tuple[int, ...] = (1, 16, 256, 4096),
    lengths: tuple[int, ...] = (1, 8, 64),
    repeats: int = 3,
    steps: int = 60,
    warmup: int = 10,
    log: Callable[[str], None] = print,
    release: str = vllm_mrv2.NEWEST,
) -> dict[str, Any]:
    """Every case on vLLM ``release``'s layer (UVA; and its NonUvaBuffer fallback) and stagebuf's tiers."""
    import stagebuf

    cuda = device.type == "cuda"
    peers: list[tuple[str, Any, str | None]] = []
    vllm_uva = vllm_mrv2.load("vllm", pin=True, device=device, release=release).buffer_utils
    peers.append(("vllm_uva", vllm_uva, None))
    if cuda:
        nopin = vllm_mrv2.load("vllm", pin=False, device=device, release=release).buffer_utils
        peers.append(("vllm_nopin", nopin, None))
        caps = stagebuf.capabilities(device)
        tiers = [t.name.lower() for t in stagebuf.Tier if caps.tier <= t < stagebuf.Tier.HOST]
    else:
        tiers = ["host", "pageable"]
    sb = vllm_mrv2.stagebuf_buffer_utils(vllm_uva, release)
    for t in tiers:
        peers.append((f"stagebuf_{t}", sb, t))
    if cuda and tiers and tiers[0] == "uva":
        peers.append(("stagebuf_uva_triton", sb, "uva"))  # the Triton kernel forced (fused cases)
    cases: list[tuple[str, Callable[[Any], Callable[[int], None]]]] = []
    for k in (1, 8):
        cases.append((f"pool|k{k}", functools.partial(_pool_case, device=device, k=k)))
        cases.append((f"backed|k{k}", functools.partial(_backed_case, device=device, k=k)))
    for e in edits:
        for ln in lengths:
            cases.append(
                (f"writes|{e}x{ln}", functools.partial(_writes_case, device=device, e=e, ln=ln, fused=False))
            )
            if e <= 256:
                only = functools.partial(_writes_case, device=device, e=e, ln=ln, fused=False)
                cases.append((f"stage|{e}x{ln}", functools.partial(only, stage_only=True)))
            if e >= 2:
                cases.append(
                    (
                        f"fused|{e}x{ln}",
                        functools.partial(_writes_case, device=device, e=e, ln=ln, fused=True),
                    )
                )
    for kind in PROMPT_KINDS:
        for n in PROMPT_LENGTHS:
            make = functools.partial(_prompt_case, device=device, kind=kind, n=n, release=release)
            cases.append((f"prompt|{kind}|{n}", make))
    raw: dict[str, dict[str, list[float]]] = {}
    for rep in range(repeats):
        for cname, make in cases:
            for pname, bu, tier in peers:
                forced = pname.endswith("_triton")
                if forced and not cname.startswith(("fused", "writes")):
                    continue
                if cname.startswith(("stage", "prompt")) and pname not in ("vllm_uva", "stagebuf_uva"):
                    continue
                with stagebuf_tier(tier), _kernel("triton" if forced else None):
                    step = make(bu)
                    n = steps if not cname.endswith("x64") or "4096" not in cname else max(10, steps // 4)
                    us = _time(step, device, n, warmup)
                raw.setdefault(cname, {}).setdefault(pname, []).append(us)
        log(f"vs_vllm repeat {rep + 1}/{repeats} done")
    med = {c: {p: float(np.median(v)) for p, v in d.items()} for c, d in raw.items()}
    return {"median_us": med, "raw_us": raw, "repeats": repeats, "steps": steps, "vllm_version": release}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


@click.command()
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False), help="The report.")
@click.option("--repeats", default=3, show_default=True, help="Interleaved repeats of every cell.")
@click.option("--steps", default=60, show_default=True, help="Timed steps a cell and repeat.")
@click.option("--edits", default="1,16,256,4096", show_default=True, help="E of the writes cells.")
@click.option("--lengths", default="1,8,64", show_default=True, help="L of the writes cells.")
@vllm_mrv2.release_option("The vLLM release whose classes are the peer.")
def main(json_path: str, repeats: int, steps: int, edits: str, lengths: str, release: str) -> None:
    """Time the vs-vLLM cells alone; the report's commit is ``STAGEBUF_BENCH_COMMIT`` (or unknown)."""
    vllm_mrv2.fetch(release)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise click.UsageError("on a CPU, vLLM's Triton kernels need TRITON_INTERPRET=1")
    t0 = time.time()
    log = lambda s: click.echo(s, err=True)  # noqa: E731
    res = run(device, _ints(edits), _ints(lengths), repeats, steps, log=log, release=release)
    report = {
        "commit": os.environ.get("STAGEBUF_BENCH_COMMIT", "unknown"),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "device": str(device),
        "vs_vllm": res,
    }
    Path(json_path).write_text(json.dumps(report) + "\n")
    click.echo(f"vs_vllm: {len(res['raw_us'])} cells in {time.time() - t0:.1f} s -> {json_path}")


if __name__ == "__main__":
    main()
