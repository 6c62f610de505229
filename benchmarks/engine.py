"""The engine workload: vLLM's own MRV2 input path, step by step, on a scheduler-like trace.

vLLM's modules of one release, driven as ``GPUModelRunner.execute_model`` drives them, then a stand-in forward
pass (busy GPU) and ``post_update``. Setups (:class:`Setup`): ``vllm`` (``nopin``: its NonUvaBuffer fallback),
``dropin`` (stagebuf's classes, the plugin's ``STAGEBUF_VLLM=1``), ``step`` (its step mode), ``own``
(stagebuf's own API) and ``floor`` (:class:`FloorEngine`). Measured per step on the host: the preparation and
its buffer work by part (:data:`SECTIONS`); ``check()`` compares every device-visible input with vLLM's.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from . import targets as T
from . import vllm_mrv2
from .harness import BUSY_MS, Lockstep, env_var, medians, sleep_cycles_for, stagebuf_tier, tiers
from .vllm_mrv2 import release_suffix

# --- the trace -------------------------------------------------------------------------------


@dataclass
class TraceConfig:
    max_num_reqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    block_sizes: tuple[int, ...] = (16,)
    running: int = 190  # Requests the scheduler keeps running once ramped up.
    arrivals_per_step: int = 4
    prompt: tuple[int, int] = (16, 1024)
    output: tuple[int, int] = (16, 256)
    steps: int = 150
    vocab: int = 32000
    seed: int = 0


@dataclass
class NewReq:
    req_id: str
    token_ids: list[int]
    block_ids: tuple[list[int], ...]
    max_tokens: int
    params: Any
    prompt: Any = None  # ``token_ids`` as the model runner receives them (``received``)


def received(nr: NewReq, token_buffer: Any) -> Any:
    """The prompt as vLLM's model runner gets it: the list, or a ``TokenBuffer`` (kept on ``nr``)."""
    if token_buffer is None:
        return nr.token_ids
    if type(nr.prompt) is not token_buffer:
        nr.prompt = token_buffer(nr.token_ids)
    return nr.prompt


@dataclass
class StepPlan:
    finished: list[str]
    new: list[NewReq]
    cached: list[tuple[str, int, tuple[list[int], ...] | None]]
    order: list[str]
    num_scheduled: np.ndarray
    num_sampled: np.ndarray
    has_prefill: bool


@dataclass
class _Req:
    rid: str
    prompt_len: int
    output_len: int
    computed: int = 0
    generated: int = 0


def make_trace(cfg: TraceConfig) -> list[StepPlan]:
    """A deterministic scheduler trace: arrivals, chunked prefills, decodes, new blocks, finishes."""
    rng = np.random.default_rng(cfg.seed)
    next_block = [1] * len(cfg.block_sizes)
    running: list[_Req] = []
    plans: list[StepPlan] = []
    serial = 0
    for _ in range(cfg.steps):
        finished = [r.rid for r in running if r.generated >= r.output_len]
        running = [r for r in running if r.generated < r.output_len]
        budget = cfg.max_num_batched_tokens
        sched: dict[str, int] = {}
        for decode in (True, False):  # decodes first, then prefill chunks, as a token budget allows
            for r in running:
                if (r.computed >= r.prompt_len) == decode and budget > 0:
                    sched[r.rid] = n = 1 if decode else min(r.prompt_len - r.computed, budget)
                    budget -= n
        new: list[NewReq] = []
        arrived = 0
        most = min(cfg.running, cfg.max_num_reqs)
        while len(running) < most and arrived < cfg.arrivals_per_step and budget > 0:
            p = int(rng.integers(cfg.prompt[0], cfg.prompt[1] + 1))
            o = int(rng.integers(cfg.output[0], cfg.output[1] + 1))
            o = min(o, cfg.max_model_len - p - 1)
            r = _Req(f"req-{serial}", p, o)
            serial += 1
            running.append(r)
            sched[r.rid] = n = min(p, budget)
            budget -= n
            arrived += 1
            new.append(NewReq(r.rid, rng.integers(0, cfg.vocab, p).tolist(), (), o, None))
        new_of = {nr.req_id: nr for nr in new}
        cached: list[tuple[str, int, tuple[list[int], ...] | None]] = []
        scheduled = [r for r in running if r.rid in sched]
        for r in scheduled:
            per_group: list[list[int]] = []
            for g, bs in enumerate(cfg.block_sizes):  # the blocks its scheduled tokens need beyond those held
                n = max(math.ceil((r.computed + sched[r.rid]) / bs) - math.ceil(r.computed / bs), 0)
                per_group.append(list(range(next_block[g], next_block[g] + n)))
                next_block[g] += n
            if r.rid in new_of:
                new_of[r.rid].block_ids = tuple(per_group)
            else:
                cached.append((r.rid, r.computed, tuple(per_group) if any(per_group) else None))
        for nr in new:
            nr.params = SimpleNamespace(
                temperature=float(rng.choice([0.0, 0.7, 1.0])),
                top_k=int(rng.choice([0, 50])),
                top_p=float(rng.choice([1.0, 0.9])),
                min_p=0.0,
                seed=int(rng.integers(0, 2**31)),
                logprobs=None,
            )
        order = [r.rid for r in scheduled]
        num_sched = np.array([sched[r.rid] for r in scheduled], np.int32)
        sampled = np.zeros(len(order), np.int32)
        has_prefill = False
        for k, r in enumerate(scheduled):
            has_prefill |= r.computed < r.prompt_len
            r.computed += sched[r.rid]
            if r.computed >= r.prompt_len:
                r.generated += 1
                sampled[k] = 1
        plans.append(StepPlan(finished, new, cached, order, num_sched, sampled, has_prefill))
    return plans


# --- one engine -----------------------------------------------------------------------------


@dataclass
class Setup:
    """One configuration: whose buffer layer, which tier, which API."""

    layer: str  # "vllm", "stagebuf", "plugin" (stagebuf through its vLLM plugin, =1) or "step" (=step)
    tier: str  # vllm: "uva" or "nopin"; stagebuf: uva, pinned, pageable, host; "floor": the floor
    api: str = "dropin"  # stagebuf only: "dropin" or "own"

    @property
    def name(self) -> str:
        if self.layer in ("vllm", "floor"):
            return f"{self.layer}_{self.tier}" if self.layer == "vllm" else "floor"
        return f"stagebuf_{self.api if self.layer == 'stagebuf' else self.layer}_{self.tier}"


def modules(setup: Setup, device: torch.device, release: str = vllm_mrv2.NEWEST) -> vllm_mrv2.Mrv2:
    if setup.layer in ("plugin", "step"):
        return plugin_modules(device, "step" if setup.layer == "step" else "1", release)
    return vllm_mrv2.load(setup.layer, pin=setup.tier != "nopin", device=device, release=release)


_PLUGIN: dict[str, Any] = {}


def plugin_modules(device: torch.device, mode: str = "1", release: str = vllm_mrv2.NEWEST) -> vllm_mrv2.Mrv2:
    """MRV2's modules with stagebuf's plugin on, as vLLM's loader runs it; kept until closed."""
    from importlib.metadata import entry_points

    from stagebuf._engines import vllm as _vllm

    got, want = _PLUGIN.get("mods"), (str(device), mode, release)
    if got is not None:
        if got[1:] != want:
            raise ValueError(f"the plugin's modules are loaded for {got[1:]}, not {want}")
        return got[0]  # type: ignore[no-any-return]
    cm = vllm_mrv2.as_installed(device, release=release)
    inst = cm.__enter__()
    try:
        with env_var("STAGEBUF_VLLM", mode):
            if any(e.name == "stagebuf" for e in entry_points(group="vllm.general_plugins")):
                sys.modules["vllm.plugins"].load_general_plugins()
            else:
                _vllm.register()
        m = inst.mrv2()
        with env_var("STAGEBUF_VLLM", mode):
            carried = _vllm.plan()
        if carried.action != "patched" or carried.mode != mode:
            raise RuntimeError(f"the plugin did not carry out {mode}: {carried.why}")
    except BaseException:
        cm.__exit__(None, None, None)
        raise
    _PLUGIN.update(mods=(m, *want), cm=cm)
    return m


def close_plugin_modules() -> None:
    """Undo ``plugin_modules``: vLLM's names out of ``sys.modules``, the plugin's patch undone."""
    from stagebuf._engines import vllm as _vllm

    cm = _PLUGIN.pop("cm", None)
    _PLUGIN.pop("mods", None)
    _vllm.unregister()
    if cm is not None:
        cm.__exit__(None, None, None)


class Engine:
    """The MRV2 input-side state of one model runner, driven by a trace."""

    def __init__(self, setup: Setup, cfg: TraceConfig, device: torch.device, release: str = vllm_mrv2.NEWEST):
        self.setup, self.cfg, self.device, self.release = setup, cfg, device, release
        m = self.m = modules(setup, device, release)
        reqs, tokens = cfg.max_num_reqs, cfg.max_num_batched_tokens
        self.req_states = m.states.RequestState(reqs, cfg.max_model_len, tokens, 0, cfg.vocab, device)
        blocks = [math.ceil(cfg.max_model_len / bs) for bs in cfg.block_sizes]
        self.block_tables = m.block_table.BlockTables(list(cfg.block_sizes), reqs, tokens, blocks, device)
        self.sampling = m.sample_states.SamplingStates(cfg.max_num_reqs, cfg.vocab)
        self.buffers = m.input_batch.InputBuffers(cfg.max_num_reqs, cfg.max_num_batched_tokens, device)
        self.own, self.stager, self.writer, self.runner = setup.api == "own", None, None, None
        if self.own:
            import stagebuf

            self.stager = stagebuf.StepStager(device, capacity=1 << 16)
            rs, bt = self.req_states, self.block_tables
            self.own_writes = [*bt.block_tables, rs.total_len, rs.all_token_ids, rs.num_computed_tokens]
            self.writer = stagebuf.FusedStagedWriter(device, max_writes=len(blocks) * reqs + 3 * 64)
            # the per-request parameters (the sampler's five, prompt and prefill lengths) in one table:
            # one copy per step where any changed, in place of seven publishes
            owners = {n: self.sampling for n in PARAMS} | {n: rs for n in ("prompt_len", "prefill_len")}
            dtypes = {n: getattr(o, n).dtype for n, o in owners.items()}
            self.params = stagebuf.DeviceParamTable(cfg.max_num_reqs, dtypes, device)
            for n, o in owners.items():
                self.params[n].np[:] = getattr(o, n).np  # vLLM's initial values (top_k, top_p)
                setattr(o, n, self.params[n])  # vLLM's code writes .np and reads .gpu, as before
            self.params.sync()
        self.qsl_np = np.zeros(cfg.max_num_reqs + 1, np.int32)
        self.h2d = m.async_tensor_h2d
        if setup.layer == "step":  # vLLM's model runner, as the plugin patched it
            mr = sys.modules["vllm.v1.worker.gpu.model_runner"]
            self.runner = mr.GPUModelRunner(None, device)
            self.h2d = mr.async_tensor_h2d
        self.step_no = 0
        self.last: dict[str, torch.Tensor] = {}

    # the step, as GPUModelRunner runs it; returns (host preparation µs, buffer work µs)
    def prepare(self, plan: StepPlan) -> tuple[float, float]:
        for nr in plan.new:  # the scheduler output as the worker receives it: before the step's timing
            received(nr, self.m.TokenBuffer)
        if self.runner is None:
            return self._prepare(plan, time.perf_counter())
        # step mode: inside the model runner's execute_model, which the plugin wraps
        t0 = time.perf_counter()
        got: tuple[float, float] = self.runner.execute_model(lambda: self._prepare(plan, t0))
        return got

    def _prepare(self, plan: StepPlan, t0: float) -> tuple[float, float]:
        clock = time.perf_counter
        rs, bt, ss, dev = self.req_states, self.block_tables, self.sampling, self.device
        h2d = self.h2d
        for rid in plan.finished:
            rs.remove_request(rid)
        tb = self.m.TokenBuffer
        for nr in plan.new:
            rs.add_request(
                req_id=nr.req_id,
                prompt_len=len(nr.token_ids),
                all_token_ids=received(nr, tb),
                num_computed_tokens=0,
                max_tokens=nr.max_tokens,
            )
            idx = rs.req_id_to_index[nr.req_id]
            bt.append_block_ids(idx, nr.block_ids, overwrite=True)
            ss.add_request(idx, nr.params)
        b0 = clock()
        if self.own:
            b1 = b0
            self.params.sync()  # request lengths and sampling parameters: one copy if any changed
        else:
            if plan.new:
                rs.apply_staged_writes()
            b1 = clock()
            ss.apply_staged_writes()
        b2 = clock()
        nct = rs.num_computed_tokens_np
        index = rs.req_id_to_index
        for rid, n, blocks in plan.cached:
            idx = index[rid]
            nct[idx] = n
            if blocks is not None:
                bt.append_block_ids(idx, blocks, overwrite=False)
        np.minimum(rs.num_computed_tokens_np, rs.prefill_len.np, out=rs.num_computed_prefill_tokens)
        idx_np = np.array([index[rid] for rid in plan.order], np.int32)
        idx64 = idx_np.astype(np.int64) if self.own else idx_np
        num_reqs = idx_np.shape[0]
        num_tokens = int(plan.num_scheduled.sum())
        qsl_np = self.qsl_np
        qsl_np[0] = 0
        np.cumsum(plan.num_scheduled, out=qsl_np[1 : num_reqs + 1])
        qsl_np[num_reqs + 1 :] = num_tokens
        b3 = clock()
        if self.own:
            self.writer.apply(self.own_writes)
            bt.num_blocks.copy_to_uva()
            b4 = clock()
            with self.stager.step() as s:  # the fixed-shape array first: its layout is cached
                qsl_full = s.stage(qsl_np)
                idx_mapping = s.stage(idx64)
            qsl = qsl_full[: num_reqs + 1]
        else:
            bt.apply_staged_writes()
            b4 = clock()
            idx_mapping = h2d(idx_np, device=dev, dtype=torch.int64)
            h2d(qsl_np, out=self.buffers.query_start_loc)
            qsl = self.buffers.query_start_loc[: num_reqs + 1]
        b5 = clock()
        buf = b2 - b0 + b5 - b3
        self.sections = (b1 - b0, b2 - b1, b4 - b3, b5 - b4)
        ib = self.m.input_batch
        cu_num_logits = torch.arange(num_reqs + 1, device=dev, dtype=torch.int32)
        b, nct_gpu = self.buffers, rs.num_computed_tokens.gpu
        if plan.has_prefill:
            state = (rs.all_token_ids.gpu, rs.prefill_len.gpu, nct_gpu)
            ib.prepare_prefill_inputs(b.input_ids, rs.next_prefill_tokens, idx_mapping, qsl, *state)
        ib.prepare_pos_seq_lens(idx_mapping, qsl, nct_gpu, b.positions, b.seq_lens)
        logits_indices = ib.combine_sampled_and_draft_tokens(
            b.input_ids, idx_mapping, rs.last_sampled_tokens, qsl, b.seq_lens[:num_reqs],
            rs.prefill_len.gpu, rs.draft_tokens, cu_num_logits, num_reqs, 1,
        )  # fmt: skip
        # as the model runner's prepare_attn calls it (0.32's takes no num_computed_tokens)
        nct_kw = {"num_computed_tokens": nct_gpu} if self.m.spec.gather_masks_sliding_window else {}
        tables = bt.gather_block_tables(idx_mapping, num_reqs, **nct_kw)
        slots = bt.compute_slot_mappings(idx_mapping, qsl, b.positions, num_tokens)
        t1 = clock()
        self.last = {
            "idx_mapping": idx_mapping,
            "query_start_loc": qsl,
            "logits_indices": logits_indices,
            "slot_mappings": slots,
            **{f"block_table_{g}": t for g, t in enumerate(tables)},
        }
        self._num = (num_reqs, num_tokens)
        return (t1 - t0) * 1e6, buf * 1e6

    def finish(self, plan: StepPlan, sleep_cycles: int) -> None:
        """The stand-in forward pass (``sleep_cycles`` > 0: the GPU is busy), the sampler, post_update."""
        dev = self.device
        if sleep_cycles and dev.type == "cuda":
            torch.cuda._sleep(sleep_cycles)
        idx_mapping = self.last["idx_mapping"]
        sampled = ((idx_mapping * 31 + self.step_no) % self.cfg.vocab).view(-1, 1)
        num_sampled = torch.from_numpy(plan.num_sampled).to(dev, non_blocking=True)
        num_rejected = torch.zeros_like(num_sampled)
        rs = self.req_states
        self.m.input_batch.post_update(
            idx_mapping, rs.num_computed_tokens.gpu, rs.last_sampled_tokens, None, sampled, num_sampled,
            num_rejected, self.last["query_start_loc"], rs.all_token_ids.gpu, rs.total_len.gpu,
        )  # fmt: skip
        self.step_no += 1

    def inputs(self) -> dict[str, torch.Tensor]:
        """Every device-visible input of the step just prepared (views: read after a synchronize)."""
        num_reqs, num_tokens = self._num
        rs, bt, ss, b = self.req_states, self.block_tables, self.sampling, self.buffers
        out = {**self.last, "positions": b.positions[:num_tokens], "input_ids": b.input_ids[:num_tokens]}
        out |= {"seq_lens": b.seq_lens[:num_reqs], "num_blocks": bt.num_blocks.gpu}
        out["last_sampled_tokens"] = rs.last_sampled_tokens
        for n in ("num_computed_tokens", "total_len", "all_token_ids", "prompt_len", "prefill_len"):
            out[n] = getattr(rs, n).gpu
        out |= {n: getattr(ss, n).gpu for n in PARAMS}
        return out | {f"block_table_state_{g}": t.gpu for g, t in enumerate(bt.block_tables)}


def _tier_of(setup: Setup) -> str | None:
    return None if setup.layer == "vllm" else setup.tier


def check(
    setup: Setup,
    cfg: TraceConfig,
    device: torch.device,
    busy_cycles: int = 0,
    trace: list[StepPlan] | None = None,
    tamper: Callable[[Engine, int], None] | None = None,
    release: str = vllm_mrv2.NEWEST,
) -> dict[str, Any]:
    """``setup`` and vLLM's own layer in lockstep, every device-visible input compared each step."""
    plans = trace if trace is not None else make_trace(cfg)
    with stagebuf_tier(None):
        ref = Engine(Setup("vllm", "uva"), cfg, device, release)
    with stagebuf_tier(_tier_of(setup)):
        eng = Engine(setup, cfg, device, release)
        mismatches: list[str] = []
        for i, plan in enumerate(plans):
            ref.prepare(plan)
            eng.prepare(plan)
            if tamper is not None:  # tests: a deliberate difference the check must find
                tamper(eng, i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            a, b = ref.inputs(), eng.inputs()
            same = lambda k: a[k].shape == b[k].shape and torch.equal(a[k].cpu(), b[k].cpu())  # noqa: B023
            mismatches += [f"step {i}: {k}" for k in a if not same(k)]
            for e in (ref, eng):
                e.finish(plan, busy_cycles)
            if len(mismatches) > 20:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = {"setup": setup.name, "reference": ref.setup.name, "release": release}
    return {"steps": len(plans), "mismatches": mismatches, **names}


SECTIONS = ("request_writes", "sampler_publish", "block_tables", "per_step_copies")
"""The parts of the buffer work: the request writes, the sampler's publishes (own API: one DeviceParamTable
sync), the block tables' writes (own API: one fused apply) and idx_mapping and query_start_loc."""
PARAMS = ("temperature", "top_k", "top_p", "min_p", "seeds")  # SamplingStates' per-request parameters


def run_lockstep(
    setups_: list[Setup],
    cfg: TraceConfig,
    device: torch.device,
    plans: list[StepPlan],
    busy_cycles: int,
    warmup: int,
    before_step: Callable[[int, list[Any]], None] | None = None,
    release: str = vllm_mrv2.NEWEST,
) -> dict[str, dict[str, Any]]:
    """One timed run of the trace by every setup in :class:`benchmarks.harness.Lockstep`."""
    import stagebuf

    engines: list[Any] = []
    for s in setups_:
        with stagebuf_tier(_tier_of(s)):
            eng = FloorEngine(cfg, device) if s.layer == "floor" else Engine(s, cfg, device, release)
            engines.append(eng)
    stagebuf.capabilities(device)  # cached with no tier forced: begin_step() asks it per step
    waits0 = [_batch_waits(eng.setup) for eng in engines]
    timed: list[list[tuple[float, float, tuple[float, ...]]]] = [[] for _ in engines]  # prep, buffer, parts
    turns, clock = Lockstep(len(engines), device, busy_cycles), time.perf_counter
    for i, plan in enumerate(plans):
        if before_step is not None:  # (engine_profile: hooks the engines' parts after the warm-up)
            before_step(i, engines)
        for e in turns.order(i):
            eng = engines[e]
            turns.before()
            t0 = clock()
            if eng.setup.layer not in ("vllm", "floor"):
                stagebuf.begin_step(device)
            t1 = clock()
            p, b = eng.prepare(plan)
            eng.finish(plan, busy_cycles)
            turns.after(e)
            if i >= warmup:
                timed[e].append((p + (t1 - t0) * 1e6, b, eng.sections))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = {}
    for e, eng in enumerate(engines):
        prep, bufw, secs = (np.array(x) for x in zip(*timed[e]))
        waits = 0 if isinstance(eng, FloorEngine) else _guard_waits(eng) + _batch_waits(eng.setup) - waits0[e]
        out[eng.setup.name] = {
            "prep_us": float(np.median(prep)),
            "buffer_us": float(np.median(bufw)),
            "steps": len(prep),
            "sections_us": dict(zip(SECTIONS, (float(x) * 1e6 for x in secs.mean(axis=0)))),  # mean µs a step
            "guard_waits": waits,
        }
    return out


def _guard_waits(eng: Engine) -> int:
    """Waits of the slot guard over every stagebuf object of an engine (0 for vLLM's layer)."""
    objs: list[Any] = [eng.stager, eng.writer, getattr(eng, "params", None), eng.block_tables.num_blocks]
    objs += [*eng.block_tables.block_tables, *vars(eng.req_states).values(), *vars(eng.sampling).values()]
    return sum(int(o.stats().get("guard_waits", 0)) for o in objs if callable(getattr(o, "stats", None)))


def _batch_waits(setup: Setup) -> int:
    """Guard waits so far of the step batch a step-mode setup stages through (kept across runs)."""
    if setup.layer != "step":
        return 0
    from stagebuf._engines.vllm_step_batch import BATCHES

    waits = [b.stager.stats()["guard_waits"] for (_, t), b in BATCHES.items() if t.name.lower() == setup.tier]
    return sum(waits)


def setups(tier_names: list[str], cuda: bool) -> list[Setup]:
    """vLLM's layer (``nopin`` too on a GPU), stagebuf's three ways on each tier, and the floor."""
    out = [Setup("vllm", "uva"), *([Setup("vllm", "nopin")] if cuda else [])]
    out += [Setup("stagebuf", t, api) for api in ("dropin", "own") for t in tier_names]
    return [*out, *(Setup("step", t) for t in tier_names), Setup("floor", "floor")]


def part_bytes(plan: StepPlan, cfg: TraceConfig) -> tuple[int, int, int, int]:
    """The bytes each part of a step's buffer work (``SECTIONS``) must get to the device."""
    g = len(cfg.block_sizes)
    blocks = [n.block_ids for n in plan.new] + [b for _, _, b in plan.cached if b is not None]
    req = sum(4 * (len(n.token_ids) + 5) for n in plan.new)
    bt = sum(4 * (sum(len(x) for x in ids) + g) for ids in blocks)
    return req, 24 * len(plan.new), bt, 8 * len(plan.order) + 4 * (cfg.max_num_reqs + 1)


class FloorEngine:
    """Each part's floor: its bytes in one pinned buffer, one copy and one launch."""

    def __init__(self, cfg: TraceConfig, device: torch.device):
        self.setup, self.cfg, self.device = Setup("floor", "floor"), cfg, device
        n = 1 << 22
        self.src = np.ones(n, np.uint8)
        self.host = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.dev = torch.empty(n, dtype=torch.uint8, device=device)
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.sections: tuple[float, ...] = (0.0,) * 4

    def prepare(self, plan: StepPlan) -> tuple[float, float]:
        clock, secs = time.perf_counter, []
        for nbytes in part_bytes(plan, self.cfg):
            t = clock()
            if nbytes:
                self.host_np[:nbytes] = self.src[:nbytes]
                self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
                self.flag.add_(1)
            secs.append(clock() - t)
        self.sections = tuple(secs)
        return sum(secs) * 1e6, sum(secs) * 1e6

    def finish(self, plan: StepPlan, sleep_cycles: int) -> None:
        if sleep_cycles and self.device.type == "cuda":
            torch.cuda._sleep(sleep_cycles)


BLOCK_SIZES = (16, 32, 16, 64)  # KV-cache groups' block sizes (group 1: e.g. a sliding window)


WARMUP = 30  # Steps of each timed run before its timing.


def bench(
    device: torch.device, repeats: int, steps: int, log: Callable[[str], None], release: str
) -> dict[str, Any]:
    """Identical-inputs checks of every setup, then interleaved timed repeats, 1 and 2 KV groups."""
    cuda = device.type == "cuda"
    all_setups = setups(tiers(device), cuda)
    cycles = sleep_cycles_for(BUSY_MS, device) if cuda else 0
    modes = (False, True) if cuda else (False,)
    trace = {k: v for k, v in vars(TraceConfig()).items() if k not in ("block_sizes", "steps")}
    out: dict[str, Any] = {
        "vllm_version": release, "trace": trace, "busy_ms": BUSY_MS if cuda else 0, "steps": steps,
        "warmup": WARMUP, "repeats": repeats, "setups": [s.name for s in all_setups], "checks": [],
        "runs": {},
    }  # fmt: skip
    try:
        for g in (1, 2):
            cfg = TraceConfig(block_sizes=BLOCK_SIZES[:g], steps=steps)
            out.setdefault("block_sizes", {})[g] = list(cfg.block_sizes)
            plans = make_trace(cfg)
            for s in all_setups:
                for busy in modes if s.name not in ("vllm_uva", "floor") else ():
                    r = check(s, cfg, device, cycles * busy, trace=plans, release=release)
                    out["checks"].append(r | {"groups": g, "busy": busy})
                    log(f"check {s.name} groups={g} busy={busy}: {len(r['mismatches'])} mismatches")
            for rep in range(repeats):
                for busy in modes:
                    res = run_lockstep(all_setups, cfg, device, plans, cycles * busy, WARMUP, release=release)
                    for name, r in res.items():
                        out["runs"].setdefault(f"{name}|g{g}|{'busy' if busy else 'idle'}", []).append(r)
                log(f"engine groups={g}: repeat {rep + 1}/{repeats} done")
    finally:
        close_plugin_modules()  # the step setups' vLLM modules and patch
    out["medians"] = medians(out["runs"], ("prep_us", "buffer_us"))
    out["identical_inputs"] = all(not c["mismatches"] for c in out["checks"])
    return out


# --- the targets ----------------------------------------------------------------------------------

GOALS: dict[str, dict[str, float]] = {
    "0.33.0": {"step_uva_vs_vllm_uva": 0.4, "step_pageable_vs_vllm_uva": 0.5, "dropin_uva_vs_vllm_uva": 0.7,
               "dropin_pageable_vs_vllm_nopin": 0.6},
    "0.34.0": {"step_uva_vs_vllm_uva": 0.5, "step_pageable_vs_vllm_uva": 0.6, "dropin_uva_vs_vllm_uva": 0.9,
               "dropin_pageable_vs_vllm_nopin": 0.7},
}  # fmt: skip
"""The goals that differ by the peer's release (else :data:`RATIOS`'); others take the newest entry's."""
RATIOS = {  # engine_<name>_g<groups>: stagebuf_<api>_<tier> / vllm_<peer> (step_prep: step_uva's), its goal
    "step_uva_vs_vllm_uva": 0.4, "step_pageable_vs_vllm_uva": 0.5, "step_prep_vs_vllm_uva": 0.75,
    "dropin_uva_vs_vllm_uva": 0.7, "own_uva_vs_vllm_uva": 0.5, "dropin_pageable_vs_vllm_nopin": 0.6,
    "own_pageable_vs_vllm_uva": 1.0,
}  # fmt: skip
WHAT = {
    "step_uva_vs_vllm_uva": "step mode (STAGEBUF_VLLM=step) on UVA / vLLM's own layer on UVA",
    "step_pageable_vs_vllm_uva": "step mode on PAGEABLE (no pinned memory) / vLLM's own layer on UVA (bare "
    "metal)",
    "step_prep_vs_vllm_uva": "the whole host preparation, step mode on UVA / vLLM's own layer on UVA",
    "dropin_uva_vs_vllm_uva": "stagebuf's classes in vLLM's place (STAGEBUF_VLLM=1) on UVA / vLLM's own "
    "layer on UVA",
    "own_uva_vs_vllm_uva": "stagebuf's own API on UVA / vLLM's own layer on UVA",
    "dropin_pageable_vs_vllm_nopin": "stagebuf's classes on PAGEABLE / vLLM's NonUvaBuffer fallback (no "
    "pinned memory)",
    "own_pageable_vs_vllm_uva": "stagebuf's own API on PAGEABLE (no pinned memory) / vLLM's own layer on UVA "
    "(bare metal)",
}


def _parts(runs: dict[str, Any], setup: str, g: int, mode: str = "busy") -> list[dict[str, float]]:
    """Each run's µs a step of each part of ``setup``'s buffer work (``mode``, else idle)."""
    rs = runs.get(f"{setup}|g{g}|{mode}") or runs.get(f"{setup}|g{g}|idle") or []
    return [r["sections_us"] for r in rs]


def targets(res: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The engine targets, ratios of medians on the idle and busy GPU (the worse), per peer release."""
    res = res or {}
    meds, runs, out = res.get("medians", {}), res.get("runs", {}), {}
    groups = sorted({int(k.split("|")[1][1:]) for k in meds}) or [1, 2]
    sb = [s for s in res.get("setups", []) if s.startswith("stagebuf_")]
    release = res.get("vllm_version") or vllm_mrv2.NEWEST
    sfx = release_suffix(release)
    goals = GOALS.get(release) or GOALS[max(GOALS, key=lambda r: tuple(map(int, r.split("."))))]
    last = lambda s, g, mode="busy": (_parts(runs, s, g, mode) or [{}])[-1]

    def ratio(num: str, den: str, g: int, m: str, what: str = "buffer_us") -> float | None:
        a, b = meds.get(f"{num}|g{g}|{m}"), meds.get(f"{den}|g{g}|{m}")
        return None if not a or not b else a[what] / b[what]

    def busy_idle(s: str, g: int) -> float | None:
        b, i = meds.get(f"{s}|g{g}|busy"), meds.get(f"{s}|g{g}|idle")
        return b["prep_us"] / i["prep_us"] if b and i else None

    def mean(s: str, g: int) -> dict[str, float]:
        ps = _parts(runs, s, g)
        return {k: float(np.mean([p.get(k, 0) for p in ps])) if ps else 0.0 for k in SECTIONS}

    def entry(what: str, value: float | None, goal: float, note: str | None = None) -> dict[str, Any]:
        return T.target(what, "engine", value, "<=", goal, note, "needs a GPU")

    grew = [  # each stagebuf setup's busy/idle less vLLM UVA's, with its note, setup and KV groups
        (x - v, f"{s}, {g} KV groups: busy/idle {x:.3f}, vLLM UVA's {v:.3f}", s, g)
        for g in groups
        if (v := busy_idle("vllm_uva", g)) is not None
        for s in sb
        if (x := busy_idle(s, g)) is not None
    ]
    worst = max(grew, key=lambda w: w[0], default=None)
    what = (
        "engine: host preparation busy/idle (3 ms forward stand-in, two steps in flight) of a stagebuf "
        "setup, minus vLLM UVA's busy/idle in the same run; worst stagebuf setup x KV groups"
    )
    e = out[f"engine_busy_ratio_vs_vllm{sfx}"] = entry(what, worst and worst[0], 0.05, worst and worst[1])
    if e.get("passed") is False and worst is not None:
        _, _, ws, wg = worst
        b, i = last(ws, wg), last(ws, wg, "idle")
        part = max(SECTIONS, key=lambda k: b.get(k, 0) - i.get(k, 0))
        waits = sum(r.get("guard_waits", 0) for r in runs.get(f"{ws}|g{wg}|busy", []))
        e[T.REASON] = (
            f"the part that grows most on the busy GPU ({ws}, {wg}g, last run, mean µs a step): "
            f"{part} {i.get(part, 0):.1f} -> {b.get(part, 0):.1f}; guard waits in its busy runs: {waits}"
        )
    for name, goal in RATIOS.items():
        mine, den = name.replace("step_prep", "step_uva").split("_vs_")
        num, what, text = f"stagebuf_{mine}", "prep_us" if "prep" in name else "buffer_us", WHAT[name]
        for g in groups:
            got = {m: round(v, 4) for m in ("idle", "busy") if (v := ratio(num, den, g, m, what)) is not None}
            kind = "buffer work" if what == "buffer_us" else "host preparation"
            e = out[f"engine_{name}_g{g}{sfx}"] = entry(
                f"engine {kind}, {g} KV group{'s' if g > 1 else ''}, idle and busy GPU (the worse): {text}",
                max(got.values()) if got else None,
                goals.get(name, goal),
            )
            e.update({f"measured_{m}": v for m, v in got.items()})
            mine, floor = last(num, g), runs.get(f"floor|g{g}|busy")
            if e.get("passed") is False and mine and floor:
                f = floor[-1]["sections_us"]
                part = max(SECTIONS, key=lambda k: mine.get(k, 0) - f.get(k, 0))
                e[T.REASON] = (
                    f"most above the floor: {part} {mine.get(part, 0):.1f} µs against "
                    f"{f.get(part, 0):.1f} µs ({num}, {g}g)"
                )
            a, b = mean(num, g), mean(den, g)
            slower = [f"{k} {a[k]:.1f} µs against {b[k]:.1f}" for k in SECTIONS if a[k] > 1.05 * b[k] > 0]
            if name == "dropin_uva_vs_vllm_uva" and e.get("passed") and release in GOALS and slower:
                e.update(passed=False, why=f"slower than vLLM's own in {'; '.join(slower)}")  # no part slower
    steps = [
        (v, f"{s}, {g} KV groups, {m}")
        for g in groups
        for s in sb
        if s.startswith("stagebuf_step_")
        for m in ("idle", "busy")
        if (v := ratio(s, "floor", g, m)) is not None
    ]
    w = max(steps, default=None)
    what = (
        "engine: step mode's buffer work / the summed floor of its parts (each part's bytes in one packed "
        "transfer plus one launch, measured in the same run); worst tier x KV groups x idle/busy"
    )
    out[f"engine_step_vs_floor{sfx}"] = entry(what, w and w[0], 4.0, w and w[1])
    return out


def sync_check(
    setup: Setup,
    cfg: TraceConfig,
    device: torch.device,
    warmup: int = 20,
    busy_cycles: int = 0,
    release: str = vllm_mrv2.NEWEST,
) -> str | None:
    """The first synchronising call after ``warmup`` steps (``set_sync_debug_mode("error")``), or None."""
    with stagebuf_tier(_tier_of(setup)):
        eng = Engine(setup, cfg, device, release)
        prev: Any = None
        try:
            for i, plan in enumerate(make_trace(cfg)):
                if i == warmup:
                    torch.cuda.synchronize(device)
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    eng.prepare(plan)
                    eng.finish(plan, busy_cycles)
                except RuntimeError as e:
                    return f"step {i}: {e}"
                torch.cuda.set_sync_debug_mode(0)
                ev = torch.cuda.Event()
                ev.record()
                if prev is not None:
                    prev.synchronize()
                prev = ev
                if i >= warmup:
                    torch.cuda.set_sync_debug_mode("error")
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize(device)
    return None


def plugin_vs_dropin(device: torch.device, tiers: tuple[str, ...], repeats: int = 3) -> dict[str, Any]:
    """The plugin against the direct substitution, 2 KV groups, busy GPU: identical inputs and timings."""
    cycles = sleep_cycles_for(BUSY_MS, device) if device.type == "cuda" else 0
    cfg = TraceConfig(block_sizes=BLOCK_SIZES[:2])
    plans = make_trace(cfg)
    pairs = [s for t in tiers for s in (Setup("stagebuf", t), Setup("plugin", t))]
    out: dict[str, Any] = {"checks": {}, "runs": {}}
    try:
        for s in pairs:
            out["checks"][s.name] = check(s, cfg, device, cycles, trace=plans)["mismatches"]
        for _ in range(repeats):
            for name, r in run_lockstep(pairs, cfg, device, plans, cycles, WARMUP).items():
                out["runs"].setdefault(name, []).append({k: r[k] for k in ("prep_us", "buffer_us")})
    finally:
        close_plugin_modules()
    out["medians"] = medians(out["runs"], ("prep_us", "buffer_us"))
    return out
