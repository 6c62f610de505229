"""Host µs per CUDA call on an idle GPU and on one busy with a long kernel (a diagnostic, not a test).

    python3 scripts/launch_probe.py          # prints a table; writes $OUT/launch.json when OUT is set

Each call is timed 100 times in a row, five repeats, median; "busy" queues a ~100 ms
``torch.cuda._sleep`` first, so every call is made while the GPU has work in flight (as an engine
preparing step N+1 during step N makes it). docs/BENCHMARKS.md quotes it for the engine workload.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from cuda.bindings import runtime as rt

from stagebuf._rings.staged_write import kernel as sw


@triton.jit
def _write(meta, content, out, N: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, N)
    tl.store(out + tl.load(meta + i), tl.load(content + i))


def main() -> None:
    dev = torch.device("cuda")
    x = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    idx = torch.arange(8, dtype=torch.int64, device=dev) * 3
    vals = torch.arange(8, dtype=torch.int32, device=dev)
    idx4k = torch.arange(4096, dtype=torch.int64, device=dev) * 3
    vals4k = torch.arange(4096, dtype=torch.int32, device=dev)
    pin = torch.zeros(256, dtype=torch.int32).pin_memory()
    pag = torch.zeros(256, dtype=torch.int32)
    d256 = torch.zeros(256, dtype=torch.int32, device=dev)
    _write[(1,)](idx, vals, x, N=8)
    compiled = _write.warmup(idx, vals, x, N=8, grid=(1,))[(1, 1, 1)]
    _, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    raw = torch._C._cuda_getCurrentRawStream
    tev = torch.cuda.Event()
    sw._triton_available()
    dev0 = torch.device("cuda", torch.cuda.current_device())
    row = torch.tensor(
        [[x.data_ptr(), 0, 8, 0]], dtype=torch.int64, device=dev
    )  # stagebuf's kernel: one edit
    sw_jit = sw._triton_kernel(interpret=False)
    sw.launch_at(dev0, row.data_ptr(), vals.data_ptr(), torch.int32, 1, 1024, lambda: (row, vals))
    ops: dict[str, Callable[[], object]] = {
        "add_": lambda: x.add_(1),
        "index_copy_ (8)": lambda: x.index_copy_(0, idx, vals),
        "index_copy_ (4096)": lambda: x.index_copy_(0, idx4k, vals4k),
        "scatter_": lambda: x.scatter_(0, idx, vals),
        "index_put_": lambda: x.index_put_((idx,), vals),
        "copy pinned 1KB": lambda: d256.copy_(pin, non_blocking=True),
        "copy pageable 1KB": lambda: d256.copy_(pag, non_blocking=True),
        "triton launch (jit)": lambda: _write[(1,)](idx, vals, x, N=8),
        "triton launch (compiled)": lambda: compiled(idx, vals, x, 8),
        "staged-write kernel (dispatcher)": lambda: sw_jit[(1,)](row, vals, BLOCK=1024, num_warps=4),
        "staged-write kernel (launch_at)": lambda: sw.launch_at(
            dev0, row.data_ptr(), vals.data_ptr(), torch.int32, 1, 1024, lambda: (row, vals)
        ),
        "cudaEventRecord (cuda-bindings)": lambda: rt.cudaEventRecord(ev, raw(0)),
        "torch.cuda.Event.record": lambda: tev.record(),
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(),
        "torch.tensor(pin_memory) + .to": lambda: torch.tensor(
            [1, 2, 3, 4], dtype=torch.int32, pin_memory=True
        ).to(dev, non_blocking=True),
    }
    res: dict[str, float] = {}
    for mode in ("idle", "busy"):
        for name, f in ops.items():
            for _ in range(20):
                f()
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                if mode == "busy":
                    torch.cuda._sleep(200_000_000)
                t0 = time.perf_counter()
                for _ in range(100):
                    f()
                ts.append((time.perf_counter() - t0) / 100 * 1e6)
                torch.cuda.synchronize()
            res[f"{mode}|{name}"] = statistics.median(ts)
            print(f"{mode:5s} {name:34s} {res[f'{mode}|{name}']:8.2f} us", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "launch.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
