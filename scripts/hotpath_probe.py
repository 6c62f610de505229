"""Host µs per step of stagebuf's hot paths on this machine (a design probe, not the bench).

    PYTHONPATH=src:. python3 scripts/hotpath_probe.py   # prints JSON, writes $OUT/hotpath.json

Run from the checkout root without installing (``PYTHONPATH=src:.`` makes ``stagebuf`` importable).
Uses stagebuf's public API only. On CUDA it also times the two ways to record and query a step's
event, as stagebuf's guard does: through cuda-bindings on torch's current raw stream, and through
``torch.cuda.Event``.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import torch

import stagebuf
from stagebuf import StepStager, UvaBufferPool

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K, N = 8, 64
srcs = [np.random.randint(0, 1 << 20, N).astype(np.int32) for _ in range(K)]
res: dict[str, float] = {}


def bench(name, fn, iters=3000, warm=300, reps=5):
    for _ in range(warm):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    hs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        hs.append((time.perf_counter() - t0) / iters * 1e6)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    res[name] = round(statistics.median(hs), 2)


class RawEvent:
    """A CUDA event recorded on torch's current raw stream through cuda-bindings (no timing)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            from cuda import cudart as rt  # cuda-python < 12.6
        err, self.ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
        assert int(err) == 0, err
        self.rt, self.idx = rt, torch.cuda.current_device()
        self.stream = torch._C._cuda_getCurrentRawStream
        self.not_ready = rt.cudaError_t.cudaErrorNotReady

    def record(self) -> None:
        (err,) = self.rt.cudaEventRecord(self.ev, self.stream(self.idx))
        assert int(err) == 0, err

    def query(self) -> bool:
        (err,) = self.rt.cudaEventQuery(self.ev)
        assert err == self.not_ready or int(err) == 0, err
        return err != self.not_ready


class TorchEvent:
    """``torch.cuda.Event`` recorded on the current stream."""

    def __init__(self) -> None:
        self.ev = torch.cuda.Event()

    def record(self) -> None:
        self.ev.record(torch.cuda.current_stream())

    def query(self) -> bool:
        return bool(self.ev.query())


out_dev = [torch.empty(N, dtype=torch.int32, device=dev) for _ in range(K)]
consume = lambda ts: torch.cat(ts).sum()  # noqa: E731
bench("floor", lambda: consume(out_dev))
if dev.type == "cuda":
    evs = [RawEvent() for _ in range(2)]
    tevs = [TorchEvent() for _ in range(2)]
    bench("cudart_event_record_query", lambda: (evs[0].record(), evs[1].query()))
    bench("torch_event_record_query", lambda: (tevs[0].record(), tevs[1].query()))
    bench("raw_stream_lookup", lambda: torch._C._cuda_getCurrentRawStream(0))
tiers = ["uva", "pinned", "pageable"] if dev.type == "cuda" else ["host", "pageable"]
for tier in tiers:
    os.environ["STAGEBUF_TIER"] = tier
    stagebuf.reset_capabilities()
    for guard in ("off", "wait"):
        st = StepStager(device=dev if tier != "host" else "cpu", capacity=1 << 16, guard=guard)

        def step(st=st):
            with st.step() as s:
                ts = [s.stage(a) for a in srcs]
            consume(ts)

        bench(f"stager_{tier}_{guard}", step)
        pools = [UvaBufferPool(N, torch.int32, device=st.device, guard=guard) for _ in range(K)]

        def pool_step(pools=pools):
            consume([p.copy_to_uva(a) for p, a in zip(pools, srcs)])

        bench(f"pool_{tier}_{guard}", pool_step)
    stagerx = StepStager(device=dev if tier != "host" else "cpu", capacity=1 << 16, guard="off")

    def stage_only(st=stagerx):
        with st.step() as s:
            for a in srcs:
                s.stage(a)

    bench(f"stage_only_{tier}", stage_only)
print(json.dumps(res, indent=1))
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "hotpath.json"), "w") as f:
        json.dump(res, f, indent=1)
