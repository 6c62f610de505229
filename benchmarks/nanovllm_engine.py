"""The nano-vllm workload: nano-vllm's own input preparation against stagebuf's, on its own scheduler's trace.

nano-vllm-fork's ``Scheduler`` schedules a seeded stream of requests (shared prefixes, finishes by EOS or
``max_tokens``, preemption; CFG pairs in a CFG trace) and its ``ModelRunner`` prepares each step as ``run``
does, the forward pass a stand-in. Setups: ``own`` (nano-vllm's code) and ``stagebuf_<tier>`` (attached on a
forced tier). ``check()`` compares every tensor the model and sampler get, ``graph_writes()`` counts the
device-side writes into captured graphs' inputs; the timed runs also time a prefill step's floor (``floor``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import nanovllm_pkg as P
from . import targets as T
from .harness import BUSY_MS, Lockstep, medians, sleep_cycles_for, stagebuf_tier, tiers

# --- the trace -----------------------------------------------------------------------------------


@dataclass
class TraceConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    num_kvcache_blocks: int = 2048
    block_size: int = 256
    running: int = 256  # Sequences the trace keeps submitted (waiting or running) once ramped up.
    arrivals_per_step: int = 8
    prompt: tuple[int, int] = (16, 1200)
    output: tuple[int, int] = (32, 400)
    shared_prefix: float = 0.3  # The share of prompts behind one of three 512-token prefixes.
    eos_rate: float = 0.002  # Chance that a sampled token is the EOS token (a finish before max_tokens).
    cfg: bool = False  # Every request a CFG pair (a conditional and an unconditional sequence).
    steps: int = 200
    vocab: int = 32000
    seed: int = 0


EOS = 2


class Trace:
    """nano-vllm's own scheduler on a seeded stream of requests; ``next()`` gives each step's batch."""

    def __init__(self, cfg: TraceConfig, work: Path):
        self.nano = n = P.load()
        self.cfg = cfg
        self.config = P.config(
            work / "model", max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, kvcache_block_size=cfg.block_size,
            num_kvcache_blocks=cfg.num_kvcache_blocks, eos=EOS,
        )  # fmt: skip
        n.sequence.Sequence.block_size = cfg.block_size  # as every nano-vllm run has it (256)
        self.scheduler = n.scheduler.Scheduler(self.config)
        self.rng = np.random.default_rng(cfg.seed)
        self.prefixes = [self.rng.integers(3, cfg.vocab, 512).tolist() for _ in range(3)]
        self.submitted = self.steps = self.preempted = self.finished = self.prefill_steps = 0
        self.prefix_hits = self.reprefills = 0  # reprefills: prefills that recompute generated tokens
        self.scheduler_error: str | None = None
        self._real_preempt = self.scheduler.preempt
        self.scheduler.preempt = self._preempt

    def _preempt(self, seq: Any) -> None:
        self.preempted += 1
        self._real_preempt(seq)

    def _params(self) -> Any:
        r = self.rng
        return self.nano.sampling_params.SamplingParams(
            temperature=float(r.choice([0.6, 1.0, 1.3])), max_tokens=int(r.integers(*self.cfg.output)),
            cfg_scale=float(r.choice([1.5, 3.0])) if self.cfg.cfg else 1.0,
            top_k=[None, 20, 50][int(r.integers(3))], top_p=[None, 0.9, 1.0][int(r.integers(3))],
            repetition_penalty=[1.0, 1.1, 1.3][int(r.integers(3))],
        )  # fmt: skip

    def _prompt(self) -> list[int]:
        r = self.rng
        body = r.integers(3, self.cfg.vocab, int(r.integers(*self.cfg.prompt))).tolist()
        if r.random() < self.cfg.shared_prefix:
            return self.prefixes[int(r.integers(len(self.prefixes)))] + body
        return body

    def _arrive(self) -> None:
        s = self.scheduler
        seq_cls = self.nano.sequence.Sequence
        room = self.cfg.running - (len(s.waiting) + len(s.running)) // (2 if self.cfg.cfg else 1)
        for _ in range(max(0, min(self.cfg.arrivals_per_step, room))):
            sp = self._params()
            if self.cfg.cfg:  # as LLMEngine.add_request pairs them
                uncond = seq_cls(self._prompt()[:64], sp, is_unconditional=True)
                cond = seq_cls(self._prompt(), sp, is_unconditional=False, conditional_seq=uncond)
                uncond.paired_seq = cond
                s.add(cond)
                s.add(uncond)
            else:
                s.add(seq_cls(self._prompt(), sp))
            self.submitted += 1

    def next(self) -> tuple[list[Any], bool] | None:
        """The next step's (sequences, is_prefill), as the scheduler decides; None once all finished."""
        self._arrive()
        if self.scheduler.is_finished():
            return None
        try:
            seqs, is_prefill = self.scheduler.schedule()
        except IndexError as e:  # nano-vllm 20260210: a preempted sequence left in `running` (see note)
            self.scheduler_error = f"step {self.steps}: {type(e).__name__} in Scheduler.schedule: {e}"
            return None
        self.prefill_steps += is_prefill
        if is_prefill:
            self.prefix_hits += sum(s.num_cached_tokens > 0 for s in seqs)
            self.reprefills += sum(s.num_completion_tokens > 0 for s in seqs)
        return seqs, is_prefill

    def run(self, steps: int) -> Iterator[tuple[int, list[Any], bool]]:
        """Up to ``steps`` steps (i, sequences, is_prefill), each followed by :meth:`post`."""
        for i in range(steps):
            step = self.next()
            if step is None:
                return
            yield i, *step
            self.nano.context.reset_context()
            self.post(step[0])

    def post(self, seqs: list[Any]) -> None:
        """nano-vllm's postprocess with this step's "sampled" tokens (one per sequence, per pair in CFG)."""
        n = len(seqs) // 2 if is_cfg(seqs) else len(seqs)
        toks = self.rng.integers(3, self.cfg.vocab, n)
        toks[self.rng.random(n) < self.cfg.eos_rate] = EOS
        before = sum(s.is_finished for s in seqs)
        self.scheduler.postprocess(seqs, toks.tolist())
        self.finished += sum(s.is_finished for s in seqs) - before
        self.steps += 1


def is_cfg(seqs: list[Any]) -> bool:
    """What ``ModelRunner.run`` decides: a CFG batch."""
    return bool(seqs[0].cfg_scale > 1.0 and seqs[0].paired_seq is not None)


# --- runners, graphs and one prepared step -------------------------------------------------------


class StandIn(torch.nn.Module):
    """A stand-in model whose output depends on every input the graph reads (tokens, positions, context)."""

    def __init__(self, nano: Any, hidden: int):
        super().__init__()
        self.ctx = nano.context
        self.hidden = hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.ctx.get_context()
        h = input_ids.float() * 7 + positions.float() * 3 + c.slot_mapping.float()
        if not c.is_prefill:
            h = h + c.context_lens.float() * 5 + c.block_tables.float().sum(1) * 11
        return h[:, None].expand(-1, self.hidden) + torch.arange(self.hidden, device=h.device)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        c = self.ctx.get_context()
        return x[c.cu_seqlens_q[1:] - 1] if c.is_prefill else x.clone()


class _EagerGraph:
    """A captured graph's stand-in on the CPU: replay() runs the model on the static inputs."""

    def __init__(self, runner: Any, bs: int):
        self.r, self.bs = runner, bs

    def replay(self) -> None:
        r, bs, gv = self.r, self.bs, self.r.graph_vars
        ctx = P.load().context
        ctx.set_context(False, slot_mapping=gv["slot_mapping"][:bs], context_lens=gv["context_lens"][:bs],
                        block_tables=gv["block_tables"][:bs])  # fmt: skip
        gv["outputs"][:bs] = r.model(gv["input_ids"][:bs], gv["positions"][:bs])


def capture(runner: Any) -> None:
    """The runner's graphs: captured on a GPU; on the CPU the same inputs, replayed eagerly."""
    if torch.cuda.is_available():
        with torch.device("cuda"):
            runner.capture_cudagraph()
        return
    cfg = runner.config
    max_bs = min(cfg.max_num_seqs, 512)
    blocks = -(-cfg.max_model_len // runner.block_size)
    runner.graph_bs = [1, 2, 4, 8, *range(16, max_bs + 1, 16)]
    with torch.inference_mode():  # as nano-vllm's capture_cudagraph: inference tensors
        i64, i32 = (torch.zeros(max_bs, dtype=d) for d in (torch.int64, torch.int32))
        gv = {"input_ids": i64, "positions": i64.clone(), "slot_mapping": i32, "context_lens": i32.clone()}
        gv["block_tables"] = torch.zeros(max_bs, blocks, dtype=torch.int32)
        runner.graph_vars = gv | {"outputs": torch.zeros(max_bs, cfg.hf_config.hidden_size)}
    runner.graphs = {bs: _EagerGraph(runner, bs) for bs in runner.graph_bs}


def make_runner(trace: Trace, setup: str, graphs: bool = False) -> Any:
    """A runner of ``setup`` ("own", or "stagebuf_<tier>", attached on that tier) for ``trace``."""
    import stagebuf.nanovllm as sn

    cfg = replace(trace.config, enforce_eager=not graphs)
    r = P.runner(cfg, StandIn(trace.nano, cfg.hf_config.hidden_size))
    if setup == "own":
        P.own_buffers(r)
    if graphs:
        with own_context(setup):
            capture(r)
    if setup != "own":
        with stagebuf_tier(tier_of(setup)):
            sn.attach(r)  # builds its stagers on the forced tier
    return r


def tier_of(setup: str) -> str | None:
    return None if setup == "own" else setup.split("_", 1)[1]


def own_context(setup: str) -> Any:
    return P.own_path_on_cpu() if setup == "own" and not torch.cuda.is_available() else nullcontext()


def prepare(runner: Any, seqs: list[Any], is_prefill: bool) -> tuple[Any, ...]:
    """What ``ModelRunner.run`` prepares: (input_ids, positions), the sampling arrays."""
    ids, pos = runner.prepare_prefill(seqs) if is_prefill else runner.prepare_decode(seqs)
    return ids, pos, runner.prepare_sample(seqs, is_cfg_batch=is_cfg(seqs))


FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "slot_mapping", "context_lens", "block_tables")
SAMPLE = ("temperatures", "cfg_scales", "top_ks", "top_ps", "repetition_penalties")


def inputs(nano: Any, prepared: tuple[Any, ...]) -> dict[str, Any]:
    """Every tensor the model and sampler get, and the attention context (as they are: on the device)."""
    ids, pos, sample = prepared
    c = nano.context.get_context()
    out = {"input_ids": ids, "positions": pos, "is_prefill": c.is_prefill, "max_seqlen_q": c.max_seqlen_q}
    out |= {"max_seqlen_k": c.max_seqlen_k, **{k: getattr(c, k) for k in FIELDS}}
    return out | dict(zip(SAMPLE, sample))


def snapshot(nano: Any, prepared: tuple[Any, ...]) -> dict[str, Any]:
    """:func:`inputs`, each tensor copied to the host (its dtype, shape and values)."""
    return {
        k: (t.dtype, tuple(t.shape), t.cpu().clone()) if isinstance(t, torch.Tensor) else t
        for k, t in inputs(nano, prepared).items()
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    same = lambda x, y: x[:2] == y[:2] and torch.equal(x[2], y[2]) if isinstance(x, tuple) else x == y
    return [k for k in a if not (type(a[k]) is type(b[k]) and same(a[k], b[k]))]


COUNTS = (
    "prefill_steps",
    "prefix_hits",
    "preempted",
    "reprefills",
    "scheduler_error",
    "finished",
    "submitted",
)


def check(
    setup: str,
    cfg: TraceConfig,
    work: Path,
    graphs: bool = False,
    tamper: Callable[[Any, int], None] | None = None,
) -> dict[str, Any]:
    """nano-vllm's own path and ``setup`` in lockstep, every input (``graphs``: also logits) compared."""
    trace = Trace(cfg, work)
    nano = trace.nano
    own, mine = make_runner(trace, "own", graphs), make_runner(trace, setup, graphs)
    mismatches: list[str] = []
    compared = 0
    with stagebuf_tier(tier_of(setup)):
        for i, seqs, pre in trace.run(cfg.steps):
            with own_context("own"):
                a = snapshot(nano, prepared := prepare(own, seqs, pre))
                out_a = _run(own, prepared, pre) if graphs else None
            nano.context.reset_context()
            b = snapshot(nano, prepared := prepare(mine, seqs, pre))
            if tamper is not None:
                tamper(mine, i)
                b = snapshot(nano, prepared)
            bad = differences(a, b)
            if graphs:
                bad += [] if torch.equal(out_a.cpu(), _run(mine, prepared, pre).cpu()) else ["logits"]  # type: ignore[union-attr]
                gv = (*FIELDS[2:], "input_ids", "positions") if not pre else ()
                same = lambda k: torch.equal(own.graph_vars[k].cpu(), mine.graph_vars[k].cpu())
                bad += [f"graph_vars[{k}]" for k in gv if not same(k)]
            mismatches += [f"step {i} ({'prefill' if pre else 'decode'}, {len(seqs)} seqs): {k}" for k in bad]
            compared += 1
            if len(mismatches) > 20:
                break
    counts = {k: getattr(trace, k) for k in COUNTS}
    return {"setup": setup, "steps": compared, **counts, "graphs": graphs, "mismatches": mismatches}


def _run(runner: Any, prepared: tuple[Any, ...], is_prefill: bool) -> torch.Tensor:
    out: torch.Tensor = runner.run_model(prepared[0], prepared[1], is_prefill)
    return out.clone()


# --- device-side writes into the graph inputs ----------------------------------------------------


class GraphWrites(TorchDispatchMode):
    """Counts the ops that write a graph's static inputs from device memory (copies, fills), not transfers."""

    WRITES = {"copy_", "fill_", "zero_", "index_put_", "index_copy_", "masked_fill_"}

    def __init__(self, gv: dict[str, torch.Tensor]):
        super().__init__()
        keys = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")
        self.ptrs = {gv[k].untyped_storage().data_ptr() for k in keys}
        self.copies = self.fills = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name, dst = func.__name__.split(".")[0], args[0] if args else None
        ptr = dst.untyped_storage().data_ptr() if isinstance(dst, torch.Tensor) else None
        if name in self.WRITES and ptr in self.ptrs:
            if name != "copy_":
                self.fills += 1
            elif isinstance(args[1], torch.Tensor) and args[1].device == dst.device:
                self.copies += 1
        return func(*args, **(kwargs or {}))


def graph_writes(setup: str, cfg: TraceConfig, work: Path, steps: int = 40) -> dict[str, Any]:
    """Per graph-replayed decode step: device-side copies and fills into the graph inputs."""
    trace = Trace(cfg, work)
    r = make_runner(trace, setup, graphs=True)
    copies, fills, n = 0, 0, 0
    with stagebuf_tier(tier_of(setup)), own_context(setup):
        for _, seqs, pre in trace.run(steps):
            if pre or len(seqs) > 512:
                prepare(r, seqs, pre)
                continue
            with GraphWrites(r.graph_vars) as w:
                p = prepare(r, seqs, pre)
                r.run_model(p[0], p[1], False)
            copies, fills, n = copies + w.copies, fills + w.fills, n + 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {"setup": setup, "decode_steps": n, "d2d_copies_per_step": copies / max(n, 1),
            "fills_per_step": fills / max(n, 1), "real_graphs": torch.cuda.is_available()}  # fmt: skip


def check_in_flight(setup: str, cfg: TraceConfig, work: Path, busy_cycles: int) -> dict[str, Any]:
    """``setup`` with two steps in flight on a busy device, against nano-vllm's own path run alone."""
    trace = Trace(cfg, work)
    own = make_runner(trace, "own")
    with own_context("own"):
        want = [snapshot(trace.nano, prepare(own, seqs, pre)) for _, seqs, pre in trace.run(cfg.steps)]
    trace = Trace(cfg, work)
    mine = make_runner(trace, setup)
    pending: list[tuple[int, Any, dict[str, Any]]] = []
    mismatches: list[str] = []
    cuda = torch.cuda.is_available()

    def late_read(t: Any) -> Any:
        """A device-side copy of an input, read after the stand-in forward, then to pinned memory."""
        if not isinstance(t, torch.Tensor):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        return t.dtype, tuple(t.shape), host.copy_(t.clone(), non_blocking=True)

    def compare(i: int, ev: Any, got: dict[str, Any]) -> None:
        if ev is not None:
            ev.synchronize()
        mismatches.extend(f"step {i}: {k}" for k in differences(want[i], got))

    with stagebuf_tier(tier_of(setup)):
        for i, seqs, pre in trace.run(len(want)):
            raw = inputs(trace.nano, prepare(mine, seqs, pre))
            if cuda and busy_cycles:
                torch.cuda._sleep(busy_cycles)
            got = {k: late_read(v) for k, v in raw.items()}
            ev = torch.cuda.Event() if cuda else None
            if ev is not None:
                ev.record()
            pending.append((i, ev, got))
            if len(pending) > 2:
                compare(*pending.pop(0))
        for p in pending:
            compare(*p)
    return {"setup": setup, "steps": len(want), "busy_cycles": busy_cycles, "mismatches": mismatches[:20]}


# --- the timed workload --------------------------------------------------------------------------


FLOOR = "floor"  # The timed runs' pseudo-setup: a prefill step's floor (``floor_prefill``).


def floor_prefill(seqs: list[Any]) -> np.ndarray:
    """What no setup avoids in a prefill step: the uncached tokens' lists into one int64 array."""
    ids: list[int] = []
    for s in seqs:
        ids += s.token_ids[s.num_cached_tokens :]
    return np.fromiter(ids, np.int64, len(ids))


def run_lockstep(
    names: list[str], cfg: TraceConfig, work: Path, busy_cycles: int, warmup: int
) -> dict[str, Any]:
    """One timed run of the trace by every setup in lockstep, then a prefill step's floor."""
    import stagebuf

    trace = Trace(cfg, work)
    runners = [make_runner(trace, s) for s in names]
    cuda = torch.cuda.is_available()
    times: dict[str, dict[str, list[float]]] = {s: {"prefill": [], "decode": []} for s in [*names, FLOOR]}
    turns = Lockstep(len(names), torch.device("cuda" if cuda else "cpu"), busy_cycles)
    clock = time.perf_counter
    for i, seqs, pre in trace.run(cfg.steps):
        kind = "prefill" if pre else "decode"
        for e in turns.order(i):
            turns.before()
            with own_context(names[e]):
                t0 = clock()
                if names[e] != "own":
                    stagebuf.begin_step()
                prepare(runners[e], seqs, pre)
                t1 = clock()
            trace.nano.context.reset_context()
            if cuda and busy_cycles:
                torch.cuda._sleep(busy_cycles)
            turns.after(e)
            if i >= warmup:
                times[names[e]][kind].append((t1 - t0) * 1e6)
        if pre:
            t0 = clock()
            floor_prefill(seqs)
            if i >= warmup:
                times[FLOOR]["prefill"].append((clock() - t0) * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return {
        s: {f"{k}_us": float(np.median(v)) if v else None for k, v in d.items()}
        | {f"{k}_steps": len(v) for k, v in d.items()}
        for s, d in times.items()
    }


def bench(
    repeats: int = 3,
    warmup: int = 30,
    cfg: TraceConfig | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Identical-input checks, graph-input writes, then interleaved timed repeats, idle and busy."""
    import tempfile

    cuda = torch.cuda.is_available()
    names = ["own", *(f"stagebuf_{t}" for t in tiers(torch.device("cuda" if cuda else "cpu")))]
    cfg = cfg or TraceConfig()
    cycles = sleep_cycles_for(BUSY_MS, torch.device("cuda")) if cuda else 0
    threads = torch.get_num_threads()
    if not cuda:  # as the bench's CPU runs: one thread, an engine's host thread
        torch.set_num_threads(1)
    out: dict[str, Any] = {
        "nanovllm_version": f"{P.DIST} {P.VERSION}",
        "trace": {k: v for k, v in vars(cfg).items() if k != "steps"},
        "steps": cfg.steps, "warmup": warmup, "repeats": repeats, "busy_ms": BUSY_MS if cuda else 0,
        "setups": names, "checks": [], "graph_writes": {}, "runs": {},
    }  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work, small = Path(tmp), replace(cfg, steps=min(cfg.steps, 120))
            for s in names[1:]:
                for graphs in (False, True):
                    out["checks"].append(r := check(s, small, work, graphs=graphs))
                    said = f"{r['steps']} steps, {len(r['mismatches'])} mismatches"
                    log(f"nanovllm check {s} graphs={graphs}: {said}")
                if cuda:
                    r = check_in_flight(s, small, work, cycles) | {"graphs": "in flight"}
                    out["checks"].append(r)
                    log(f"nanovllm in-flight check {s}: {len(r['mismatches'])} mismatches")
            for s in names:
                out["graph_writes"][s] = graph_writes(s, replace(cfg, steps=60), work)
            for rep in range(repeats):
                for busy in (False, True) if cuda else (False,):
                    for name, r in run_lockstep(names, cfg, work, cycles * busy, warmup).items():
                        out["runs"].setdefault(f"{name}|{'busy' if busy else 'idle'}", []).append(r)
                log(f"nanovllm: repeat {rep + 1}/{repeats} done")
    finally:
        torch.set_num_threads(threads)
    out["medians"] = medians(out["runs"], ("prefill_us", "decode_us"))
    out["identical_inputs"] = all(not c["mismatches"] for c in out["checks"])
    return out


TARGETS = (  # name, setup, which preparation, goal, what it compares
    ("nanovllm_decode_uva_vs_own", "stagebuf_uva", "decode", 0.15, "nano-vllm decode step, host "
     "preparation (prepare_decode + prepare_sample): stagebuf UVA / nano-vllm's own (pinned), worst of idle "
     "and busy GPU"),
    ("nanovllm_prefill_uva_vs_own", "stagebuf_uva", "prefill", 0.35, "nano-vllm prefill step, host "
     "preparation (prepare_prefill + prepare_sample): stagebuf UVA / nano-vllm's own, worst of idle and busy "
     "GPU"),
    ("nanovllm_decode_pageable_vs_own", "stagebuf_pageable", "decode", 0.25, "nano-vllm decode step, host "
     "preparation: stagebuf PAGEABLE (no pinned memory) / nano-vllm's own with pinned memory, worst of idle "
     "and busy GPU"),
)  # fmt: skip


def targets(res: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The nano-vllm targets: ratios of medians (the worse of idle and busy), graph-input copies."""
    res = res or {}
    meds = res.get("medians", {})
    out = {}
    for name, num, kind, goal, what in TARGETS:
        key = f"{kind}_us"
        rs = {m: meds[f"{num}|{m}"][key] / meds[f"own|{m}"][key] for m in ("idle", "busy")
              if f"{num}|{m}" in meds and f"own|{m}" in meds}  # fmt: skip
        gpu = "needs a GPU with UVA" if num.endswith("uva") else "needs a GPU"
        e = out[name] = T.target(what, "nanovllm", max(rs.values()) if rs else None, "<=", goal, missing=gpu)
        if e["passed"] is False:  # both medians of the worse GPU state, and the prefill floor
            m = max(rs, key=rs.__getitem__)
            mine, own = meds[f"{num}|{m}"][key], meds[f"own|{m}"][key]
            e[T.REASON] = f"{num} {mine:.1f} µs against own {own:.1f} µs ({m} GPU)"
            floor = meds.get(f"{FLOOR}|{m}", {}).get(key)
            if kind == "prefill" and floor is not None and floor == floor:
                e[T.REASON] += f"; the floor (token lists into one array) {floor:.1f} µs"
    gw = res.get("graph_writes", {})
    mine = [v["d2d_copies_per_step"] for k, v in gw.items() if k != "own" and v.get("decode_steps")]
    real = any(v.get("real_graphs") for v in gw.values())
    what = (
        "nano-vllm graph-replayed decode step with stagebuf attached: device-to-device copies into the "
        "graph's static inputs (nano-vllm's own run_model: 5 copies and 3 fills), worst tier"
    )
    worst = max(mine) if mine and real else None
    out["nanovllm_graph_copies"] = T.target(
        what, "nanovllm", worst, "==", 0, missing="needs a GPU (CUDA graphs)"
    )
    return out
