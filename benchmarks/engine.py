"""The engine workload: vLLM's own MRV2 input path, step by step, on a scheduler-like trace.

The modules are vLLM's, of one release (``release``, default ``vllm_mrv2.NEWEST``; any of
``vllm_mrv2.RELEASES``): ``RequestState``, ``BlockTables``,
``SamplingStates``, ``InputBuffers`` and the prepare, gather, slot-mapping and
post-update kernels. Each step does what ``GPUModelRunner.execute_model`` and
``prepare_inputs`` do with them, in their order: remove finished requests, add
new ones (``add_request``, ``append_block_ids(overwrite=True)``,
``SamplingStates.add_request``), apply the request and sampler writes, update the
running requests (new blocks, ``num_computed_tokens``), apply the block tables,
copy ``idx_mapping`` and ``query_start_loc`` to the device, and launch the
prepare, gather and slot-mapping kernels. Then a stand-in forward pass
(``torch.cuda._sleep`` on a busy GPU, nothing on an idle one) and vLLM's
``post_update`` with deterministic "sampled" tokens. On a release with ``TokenBuffer`` (0.34 on)
a new request's prompt reaches ``RequestState.add_request`` as one, as vLLM's scheduler output
carries it (``NewRequestData.prefill_token_ids``: the request's ``prompt_token_ids``, a
``TokenBuffer``), made before the step's timing starts.

Configurations (``Setup``):

* ``vllm``: vLLM's own ``buffer_utils``; ``pin=False`` is its NonUvaBuffer
  fallback (a machine without pinned memory);
* ``dropin``: stagebuf's classes in place of ``buffer_utils``' (the plugin's
  substitution), on a forced stagebuf tier;
* ``own``: the same, with the step's buffer work written against stagebuf's
  own API: every staged write of the step (block tables and request state)
  in one ``FusedStagedWriter.apply``; the per-request parameters (the
  sampler's five, prompt and prefill lengths) in one ``DeviceParamTable``
  (one copy per step where any changed); the step's per-step arrays
  (``idx_mapping``, ``query_start_loc``) through one ``StepStager`` step.

Measured per step, on the host: the preparation (state updates through the last
prepare kernel's launch) and the buffer work within it (applies, publishes and
per-step copies). ``check()`` runs a configuration in lockstep with vLLM's own
layer and compares every device-visible input after every step.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from . import vllm_mrv2

# --- the trace -------------------------------------------------------------------------------


@dataclass
class TraceConfig:
    max_num_reqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    block_sizes: tuple[int, ...] = (16,)
    running: int = 190
    """Requests the scheduler keeps running once ramped up."""
    arrivals_per_step: int = 4
    prompt: tuple[int, int] = (16, 1024)
    output: tuple[int, int] = (16, 256)
    steps: int = 150
    vocab: int = 32000
    seed: int = 0


@dataclass
class NewReq:
    req_id: str
    prompt_len: int
    token_ids: list[int]
    block_ids: tuple[list[int], ...]
    max_tokens: int
    params: Any
    prompt: Any = None
    """``token_ids`` as the model runner receives them (``received``): a ``TokenBuffer`` on 0.34 on."""


def received(nr: NewReq, token_buffer: Any) -> Any:
    """The prompt as vLLM's model runner gets it in ``scheduler_output.scheduled_new_reqs``: the list on
    a release without ``TokenBuffer``; else a ``TokenBuffer`` of it, as vLLM's ``Request`` builds its
    ``prompt_token_ids`` (kept on ``nr``: the engines of a lockstep run share one)."""
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
    blocks: list[int] = field(default_factory=list)


def make_trace(cfg: TraceConfig) -> list[StepPlan]:
    """A deterministic scheduler trace: arrivals, chunked prefills, decodes, new blocks, finishes."""
    rng = np.random.default_rng(cfg.seed)
    groups = len(cfg.block_sizes)
    next_block = [1] * groups
    running: list[_Req] = []
    plans: list[StepPlan] = []
    serial = 0
    for _ in range(cfg.steps):
        finished = [r.rid for r in running if r.generated >= r.output_len]
        running = [r for r in running if r.generated < r.output_len]
        budget = cfg.max_num_batched_tokens
        sched: dict[str, int] = {}
        for r in running:  # decodes first, then prefill chunks, as a token budget allows
            if r.computed >= r.prompt_len and budget > 0:
                sched[r.rid] = 1
                budget -= 1
        for r in running:
            if r.computed < r.prompt_len and budget > 0:
                n = min(r.prompt_len - r.computed, budget)
                sched[r.rid] = n
                budget -= n
        new: list[NewReq] = []
        arrived = 0
        while (
            len(running) < cfg.running
            and arrived < cfg.arrivals_per_step
            and budget > 0
            and len(running) < cfg.max_num_reqs
        ):
            p = int(rng.integers(cfg.prompt[0], cfg.prompt[1] + 1))
            o = int(rng.integers(cfg.output[0], cfg.output[1] + 1))
            o = min(o, cfg.max_model_len - p - 1)
            r = _Req(f"req-{serial}", p, o)
            serial += 1
            running.append(r)
            n = min(p, budget)
            sched[r.rid] = n
            budget -= n
            arrived += 1
            tokens = rng.integers(0, cfg.vocab, p).tolist()
            new.append(NewReq(r.rid, p, tokens, (), o, None))
        new_ids = {nr.req_id for nr in new}
        cached: list[tuple[str, int, tuple[list[int], ...] | None]] = []
        block_ids_of: dict[str, tuple[list[int], ...]] = {}
        for r in running:
            if r.rid not in sched:
                continue
            end = r.computed + sched[r.rid]
            per_group: list[list[int]] = []
            any_new = False
            for g, bs in enumerate(cfg.block_sizes):
                have = math.ceil(r.computed / bs) if r.rid not in new_ids else 0
                need = math.ceil(end / bs)
                ids = list(range(next_block[g], next_block[g] + max(need - have, 0)))
                next_block[g] += len(ids)
                any_new = any_new or bool(ids)
                per_group.append(ids)
            block_ids_of[r.rid] = tuple(per_group)
            if r.rid not in new_ids:
                cached.append((r.rid, r.computed, tuple(per_group) if any_new else None))
        for nr in new:
            nr.block_ids = block_ids_of[nr.req_id]
            nr.params = SimpleNamespace(
                temperature=float(rng.choice([0.0, 0.7, 1.0])),
                top_k=int(rng.choice([0, 50])),
                top_p=float(rng.choice([1.0, 0.9])),
                min_p=0.0,
                seed=int(rng.integers(0, 2**31)),
                logprobs=None,
            )
        order = [r.rid for r in running if r.rid in sched]
        num_sched = np.array([sched[rid] for rid in order], np.int32)
        by_id = {r.rid: r for r in running}
        sampled = np.zeros(len(order), np.int32)
        has_prefill = False
        for k, rid in enumerate(order):
            r = by_id[rid]
            if r.computed < r.prompt_len:
                has_prefill = True
            r.computed += sched[rid]
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
        if self.layer == "plugin":
            return f"stagebuf_plugin_{self.tier}"
        if self.layer == "step":
            return f"stagebuf_step_{self.tier}"
        return f"stagebuf_{self.api}_{self.tier}"


@contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` (None: unset) for the block, then restored."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextmanager
def stagebuf_tier(tier: str | None, *others: Any) -> Iterator[None]:
    """``STAGEBUF_TIER=tier`` (None: unset) for the block, the probe forgotten before and after (also by
    ``others``: more copies of the package, as ``benchmarks.ab`` loads them)."""
    import stagebuf

    pkgs = (stagebuf, *others)
    with env_var("STAGEBUF_TIER", tier):
        for p in pkgs:
            p.reset_capabilities()
        try:
            yield
        finally:
            for p in pkgs:
                p.reset_capabilities()


def modules(setup: Setup, device: torch.device, release: str = vllm_mrv2.NEWEST) -> vllm_mrv2.Mrv2:
    if setup.layer in ("plugin", "step"):
        return plugin_modules(device, "step" if setup.layer == "step" else "1", release)
    return vllm_mrv2.load(setup.layer, pin=setup.tier != "nopin", device=device, release=release)


_PLUGIN: dict[str, Any] = {}


def plugin_modules(device: torch.device, mode: str = "1", release: str = vllm_mrv2.NEWEST) -> vllm_mrv2.Mrv2:
    """MRV2's modules as vLLM would run them with stagebuf's plugin on: vLLM ``release`` importable under
    its own names (``vllm_mrv2.as_installed``), the plugin run by vLLM's own loader (or, where
    stagebuf is not installed and so has no entry point, by calling it as the loader would), then
    MRV2's modules imported. Kept until ``close_plugin_modules()``."""
    from importlib.metadata import entry_points

    from stagebuf._engines import vllm as _vllm

    got = _PLUGIN.get("mods")
    if got is not None:
        if got[1:] != (str(device), mode, release):
            raise ValueError(
                f"the plugin's modules are loaded for {got[1:]}, not {(str(device), mode, release)}"
            )
        return got[0]  # type: ignore[no-any-return]
    cm = vllm_mrv2.as_installed(device, release=release)
    inst = cm.__enter__()
    try:
        import sys

        with env_var("STAGEBUF_VLLM", mode):
            if any(e.name == "stagebuf" for e in entry_points(group="vllm.general_plugins")):
                sys.modules["vllm.plugins"].load_general_plugins()
            else:
                _vllm.register()
        mods = {n: inst.load(n) for n in ("block_table", "states", "input_batch", "sample.states")}
        bu = sys.modules["vllm.v1.worker.gpu.buffer_utils"]
        with env_var("STAGEBUF_VLLM", mode):
            carried = _vllm.plan()
        if carried.action != "patched" or carried.mode != mode:
            raise RuntimeError(f"the plugin did not carry out {mode}: {carried.why}")
    except BaseException:
        cm.__exit__(None, None, None)
        raise
    h2d = inst._imports["vllm.utils.torch_utils"].async_tensor_h2d
    m = vllm_mrv2.Mrv2(
        buffer_utils=bu,
        block_table=mods["block_table"],
        states=mods["states"],
        input_batch=mods["input_batch"],
        sample_states=mods["sample.states"],
        async_tensor_h2d=h2d,
        CpuGpuBuffer=inst._imports["_CpuGpuBuffer"],
        layer="plugin",
        pin=True,
        release=release,
        TokenBuffer=inst.TokenBuffer,
    )
    _PLUGIN["mods"] = (m, str(device), mode, release)
    _PLUGIN["cm"] = cm
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
        g = len(cfg.block_sizes)
        self.req_states = m.states.RequestState(
            cfg.max_num_reqs, cfg.max_model_len, cfg.max_num_batched_tokens, 0, cfg.vocab, device
        )
        self.block_tables = m.block_table.BlockTables(
            list(cfg.block_sizes),
            cfg.max_num_reqs,
            cfg.max_num_batched_tokens,
            [math.ceil(cfg.max_model_len / bs) for bs in cfg.block_sizes],
            device,
        )
        self.sampling = m.sample_states.SamplingStates(cfg.max_num_reqs, cfg.vocab)
        self.buffers = m.input_batch.InputBuffers(cfg.max_num_reqs, cfg.max_num_batched_tokens, device)
        self.own = setup.api == "own"
        self.stager: Any = None
        self.writer: Any = None
        if self.own:
            import stagebuf

            self.stager = stagebuf.StepStager(device, capacity=1 << 16)
            writes = self.block_tables.block_tables + [
                self.req_states.total_len,
                self.req_states.all_token_ids,
                self.req_states.num_computed_tokens,
            ]
            self.own_writes = writes
            self.writer = stagebuf.FusedStagedWriter(device, max_writes=g * cfg.max_num_reqs + 3 * 64)
            # the per-request parameters (the sampler's five, prompt and prefill lengths) in one table:
            # one copy per step where any changed, in place of seven publishes
            owners = {n: self.sampling for n in PARAMS} | {
                n: self.req_states for n in ("prompt_len", "prefill_len")
            }
            self.params = stagebuf.DeviceParamTable(
                cfg.max_num_reqs, {n: getattr(o, n).dtype for n, o in owners.items()}, device
            )
            for n, o in owners.items():
                self.params[n].np[:] = getattr(o, n).np  # vLLM's initial values (top_k, top_p)
                setattr(o, n, self.params[n])  # vLLM's code writes .np and reads .gpu, as before
            self.params.sync()
        self.qsl_np = np.zeros(cfg.max_num_reqs + 1, np.int32)
        self.runner: Any = None
        self.h2d = m.async_tensor_h2d
        if setup.layer == "step":  # vLLM's model runner, as the plugin patched it
            import sys

            mr = sys.modules["vllm.v1.worker.gpu.model_runner"]
            self.runner = mr.GPUModelRunner(None, device)
            self.h2d = mr.async_tensor_h2d
        self.step_no = 0
        self.last: dict[str, torch.Tensor] = {}

    # the step, as GPUModelRunner runs it; returns (host preparation µs, buffer work µs)
    def prepare(self, plan: StepPlan) -> tuple[float, float]:
        tb = self.m.TokenBuffer
        if tb is not None:  # the scheduler output as the worker receives it: before the step's timing
            for nr in plan.new:
                received(nr, tb)
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
        buf = 0.0
        for rid in plan.finished:
            rs.remove_request(rid)
        tb = self.m.TokenBuffer
        for nr in plan.new:
            rs.add_request(
                req_id=nr.req_id,
                prompt_len=nr.prompt_len,
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
        buf += b2 - b0
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
            query_start_loc = qsl_full[: num_reqs + 1]
        else:
            bt.apply_staged_writes()
            b4 = clock()
            idx_mapping = h2d(idx_np, device=dev, dtype=torch.int64)
            h2d(qsl_np, out=self.buffers.query_start_loc)
            query_start_loc = self.buffers.query_start_loc[: num_reqs + 1]
        b5 = clock()
        buf += b5 - b3
        self.sections = (b1 - b0, b2 - b1, b4 - b3, b5 - b4)
        ib = self.m.input_batch
        cu_num_logits = torch.arange(num_reqs + 1, device=dev, dtype=torch.int32)
        if plan.has_prefill:
            ib.prepare_prefill_inputs(
                self.buffers.input_ids,
                rs.next_prefill_tokens,
                idx_mapping,
                query_start_loc,
                rs.all_token_ids.gpu,
                rs.prefill_len.gpu,
                rs.num_computed_tokens.gpu,
            )
        ib.prepare_pos_seq_lens(
            idx_mapping,
            query_start_loc,
            rs.num_computed_tokens.gpu,
            self.buffers.positions,
            self.buffers.seq_lens,
        )
        seq_lens = self.buffers.seq_lens[:num_reqs]
        logits_indices = ib.combine_sampled_and_draft_tokens(
            self.buffers.input_ids,
            idx_mapping,
            rs.last_sampled_tokens,
            query_start_loc,
            seq_lens,
            rs.prefill_len.gpu,
            rs.draft_tokens,
            cu_num_logits,
            num_reqs,
            1,
        )
        # as the model runner's prepare_attn calls it (0.32's takes no num_computed_tokens)
        nct_kw = (
            {"num_computed_tokens": rs.num_computed_tokens.gpu}
            if self.m.spec.gather_masks_sliding_window
            else {}
        )
        tables = bt.gather_block_tables(idx_mapping, num_reqs, **nct_kw)
        slots = bt.compute_slot_mappings(idx_mapping, query_start_loc, self.buffers.positions, num_tokens)
        t1 = clock()
        self.last = {
            "idx_mapping": idx_mapping,
            "query_start_loc": query_start_loc,
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
            idx_mapping,
            rs.num_computed_tokens.gpu,
            rs.last_sampled_tokens,
            None,
            sampled,
            num_sampled,
            num_rejected,
            self.last["query_start_loc"],
            rs.all_token_ids.gpu,
            rs.total_len.gpu,
        )
        self.step_no += 1

    def inputs(self) -> dict[str, torch.Tensor]:
        """Every device-visible input of the step just prepared (views: read after a synchronize)."""
        num_reqs, num_tokens = self._num
        rs, bt, ss, b = self.req_states, self.block_tables, self.sampling, self.buffers
        out = {
            "idx_mapping": self.last["idx_mapping"],
            "query_start_loc": self.last["query_start_loc"],
            "logits_indices": self.last["logits_indices"],
            "slot_mappings": self.last["slot_mappings"],
            "positions": b.positions[:num_tokens],
            "input_ids": b.input_ids[:num_tokens],
            "seq_lens": b.seq_lens[:num_reqs],
            "num_computed_tokens": rs.num_computed_tokens.gpu,
            "total_len": rs.total_len.gpu,
            "all_token_ids": rs.all_token_ids.gpu,
            "prompt_len": rs.prompt_len.gpu,
            "prefill_len": rs.prefill_len.gpu,
            "last_sampled_tokens": rs.last_sampled_tokens,
            "num_blocks": bt.num_blocks.gpu,
            "temperature": ss.temperature.gpu,
            "top_k": ss.top_k.gpu,
            "top_p": ss.top_p.gpu,
            "min_p": ss.min_p.gpu,
            "seeds": ss.seeds.gpu,
        }
        for g, t in enumerate(bt.block_tables):
            out[f"block_table_state_{g}"] = t.gpu
        for k, v in self.last.items():
            if k.startswith("block_table_"):
                out[k] = v
        return out


def _tier_of(setup: Setup) -> str | None:
    return None if setup.layer == "vllm" else setup.tier


def check(
    setup: Setup,
    cfg: TraceConfig,
    device: torch.device,
    busy_cycles: int = 0,
    reference: Setup | None = None,
    trace: list[StepPlan] | None = None,
    tamper: Callable[[Engine, int], None] | None = None,
    release: str = vllm_mrv2.NEWEST,
) -> dict[str, Any]:
    """Run ``setup`` and vLLM's own layer in lockstep, both on vLLM ``release``'s modules; compare every
    device-visible input each step.

    Returns ``{"steps": n, "mismatches": [...]}``; a mismatch names the step and the input.
    """
    ref_setup = reference or Setup("vllm", "uva")
    plans = trace if trace is not None else make_trace(cfg)
    with stagebuf_tier(_tier_of(ref_setup)):
        ref = Engine(ref_setup, cfg, device, release)
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
            for k in a:
                x, y = a[k], b[k]
                if x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
                    mismatches.append(f"step {i}: {k}")
            for e in (ref, eng):
                e.finish(plan, busy_cycles)
            if len(mismatches) > 20:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return {
        "steps": len(plans),
        "mismatches": mismatches,
        "setup": setup.name,
        "reference": ref_setup.name,
        "release": release,
    }


def sleep_cycles_for(ms: float, device: torch.device) -> int:
    """``torch.cuda._sleep`` cycles for about ``ms`` milliseconds on ``device`` (measured once)."""
    probe = 1_000_000
    torch.cuda._sleep(probe)  # warm
    torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    per_ms = probe / max(a.elapsed_time(b), 1e-3)
    return int(per_ms * ms)


def _wait(ev: Any) -> None:
    """Wait for a CUDA event by polling with short sleeps, the same way before every preparation.

    Busy and idle runs then differ only in the GPU's state, not in what the host thread did just
    before a timed preparation (a spinning ``synchronize()`` in one mode and none in the other).
    """
    while not ev.query():
        time.sleep(50e-6)


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
    """One timed run of the trace by every setup in lockstep: step i of each, in a rotating order.

    Interleaving at the step makes slow drifts of the host hit every setup alike. Busy GPU
    (``busy_cycles`` > 0): each engine's forward stand-in is queued behind the others', and an
    engine waits for its own previous step before preparing the next (two steps in flight).
    Idle GPU: the device has finished everything before each preparation. Both wait the same
    way (``_wait``). stagebuf engines begin each
    step with ``stagebuf.begin_step()`` (timed): the one event per step that a lone engine's first
    ring would record, kept per engine although the engines share a device.
    """
    import stagebuf

    engines: list[Any] = []
    for s in setups_:
        with stagebuf_tier(_tier_of(s)):
            eng = FloorEngine(cfg, device) if s.layer == "floor" else Engine(s, cfg, device, release)
            engines.append(eng)
    stagebuf.capabilities(device)  # cached with no tier forced: begin_step() asks it per step
    waits0 = [_batch_waits(eng.setup) for eng in engines]
    cuda = device.type == "cuda"
    prep: list[list[float]] = [[] for _ in engines]
    bufw: list[list[float]] = [[] for _ in engines]
    secs: list[list[tuple[float, ...]]] = [[] for _ in engines]
    prev: list[Any] = [None] * len(engines)
    clock = time.perf_counter
    k = len(engines)
    for i, plan in enumerate(plans):
        if before_step is not None:  # (engine_profile: hooks the engines' parts after the warm-up)
            before_step(i, engines)
        for j in range(k):
            e = (i + j) % k
            eng = engines[e]
            if cuda and not busy_cycles:  # idle: everything queued so far is done
                done = torch.cuda.Event()
                done.record()
                _wait(done)
            t0 = clock()
            if eng.setup.layer not in ("vllm", "floor"):
                stagebuf.begin_step(device)
            t1 = clock()
            p, b = eng.prepare(plan)
            eng.finish(plan, busy_cycles)
            if cuda and busy_cycles:
                ev = torch.cuda.Event()
                ev.record()
                if prev[e] is not None:
                    _wait(prev[e])
                prev[e] = ev
            if i >= warmup:
                prep[e].append(p + (t1 - t0) * 1e6)
                bufw[e].append(b)
                secs[e].append(eng.sections)
    if cuda:
        torch.cuda.synchronize(device)
    out: dict[str, dict[str, Any]] = {}
    for e, eng in enumerate(engines):
        out[eng.setup.name] = {
            "prep_us": float(np.median(prep[e])),
            "buffer_us": float(np.median(bufw[e])),
            "prep_mean_us": float(np.mean(prep[e])),
            "buffer_mean_us": float(np.mean(bufw[e])),
            "steps": len(prep[e]),
            # mean µs per step of each part of the buffer work
            "sections_us": dict(zip(SECTIONS, (float(x) * 1e6 for x in np.mean(np.array(secs[e]), axis=0)))),
            "guard_waits": 0
            if isinstance(eng, FloorEngine)
            else _guard_waits(eng) + _batch_waits(eng.setup) - waits0[e],
        }
    return out


SECTIONS = ("request_writes", "sampler_publish", "block_tables", "per_step_copies")
"""The parts of the buffer work: RequestState.apply_staged_writes (steps with arrivals), the
sampler's five publishes (own API: one DeviceParamTable sync for them and the request lengths),
BlockTables.apply_staged_writes (own API: every staged write of the step in one fused apply, and
num_blocks), idx_mapping and query_start_loc to the device."""

PARAMS = ("temperature", "top_k", "top_p", "min_p", "seeds")
"""SamplingStates' per-request parameters (UvaBackedTensors published every step)."""


def _guard_waits(eng: Engine) -> int:
    """Waits of the slot guard over every stagebuf object of an engine (0 for vLLM's layer)."""
    objs: list[Any] = [eng.stager, eng.writer, getattr(eng, "params", None), eng.block_tables.num_blocks]
    objs += eng.block_tables.block_tables
    objs += [v for x in (eng.req_states, eng.sampling) for v in vars(x).values()]
    total = 0
    for obj in objs:
        st = getattr(obj, "stats", None)
        if callable(st):
            total += int(st().get("guard_waits", 0))
    return total


def _batch_waits(setup: Setup) -> int:
    """Guard waits so far of the step batch a step-mode setup stages through (one per device and tier,
    kept across runs: ``run_lockstep`` counts the difference)."""
    if setup.layer != "step":
        return 0
    from stagebuf._engines.vllm_step_batch import BATCHES

    mine = [b for (_, tier), b in BATCHES.items() if tier.name.lower() == setup.tier]
    return sum(b.stager.stats()["guard_waits"] for b in mine)


def setups(cuda: bool, have_uva: bool, have_pinned: bool) -> list[Setup]:
    out: list[Setup] = []
    if cuda:
        out.append(Setup("vllm", "uva"))
        out.append(Setup("vllm", "nopin"))
        tiers = [t for t, ok in (("uva", have_uva), ("pinned", have_pinned), ("pageable", True)) if ok]
    else:
        out.append(Setup("vllm", "uva"))
        tiers = ["host", "pageable"]
    for api in ("dropin", "own"):
        out.extend(Setup("stagebuf", t, api) for t in tiers)
    out.extend(Setup("step", t) for t in tiers)
    out.append(Setup("floor", "floor"))
    return out


def part_bytes(plan: StepPlan, cfg: TraceConfig) -> tuple[int, int, int, int]:
    """The bytes each part of a step's buffer work must get to the device (``SECTIONS``' order).

    Request writes (steps with arrivals): each new request's token ids and its five lengths.
    Sampler publishes: each new request's five parameters (4 + 4 + 4 + 4 + 8 bytes). Block tables:
    every new block id and each edited request's block count per group. Per-step copies:
    ``idx_mapping`` (int64) and ``query_start_loc`` (int32, ``max_num_reqs + 1``).
    """
    g = len(cfg.block_sizes)
    req = sum(4 * (len(n.token_ids) + 5) for n in plan.new)
    sampler = 24 * len(plan.new)
    blocks = [n.block_ids for n in plan.new] + [b for _, _, b in plan.cached if b is not None]
    bt = sum(4 * (sum(len(x) for x in ids) + g) for ids in blocks)
    return req, sampler, bt, 8 * len(plan.order) + 4 * (cfg.max_num_reqs + 1)


class FloorEngine:
    """The floor of each part of a step's buffer work: its bytes (``part_bytes``) packed into one
    pinned buffer, one host-to-device copy and one launch (a part with no bytes costs nothing).
    Run in lockstep with the engines, so it sees the same machine and the same GPU load."""

    def __init__(self, cfg: TraceConfig, device: torch.device):
        self.setup, self.cfg, self.device = Setup("floor", "floor"), cfg, device
        n = 1 << 22
        cuda = device.type == "cuda"
        self.src = np.ones(n, np.uint8)
        self.host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(n, dtype=torch.uint8, device=device)
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.sections: tuple[float, ...] = (0.0,) * 4

    def prepare(self, plan: StepPlan) -> tuple[float, float]:
        clock = time.perf_counter
        secs = []
        for nbytes in part_bytes(plan, self.cfg):
            t = clock()
            if nbytes:
                self.host_np[:nbytes] = self.src[:nbytes]
                self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
                self.flag.add_(1)
            secs.append(clock() - t)
        self.sections = tuple(secs)
        total = sum(secs) * 1e6
        return total, total

    def finish(self, plan: StepPlan, sleep_cycles: int) -> None:
        if sleep_cycles and self.device.type == "cuda":
            torch.cuda._sleep(sleep_cycles)


def bench(
    device: torch.device,
    groups: tuple[int, ...] = (1, 2),
    repeats: int = 3,
    steps: int = 150,
    warmup: int = 30,
    busy_ms: float = 3.0,
    check_steps: int = 150,
    log: Callable[[str], None] = print,
    release: str = vllm_mrv2.NEWEST,
) -> dict[str, Any]:
    """The whole engine workload on vLLM ``release``: identical-inputs checks, then interleaved timed
    repeats."""
    import stagebuf

    cuda = device.type == "cuda"
    have = {t: False for t in ("uva", "pinned")}
    if cuda:
        caps = stagebuf.capabilities(device)
        have["uva"] = caps.tier is stagebuf.Tier.UVA
        have["pinned"] = caps.tier <= stagebuf.Tier.PINNED
    all_setups = setups(cuda, have["uva"], have["pinned"])
    cycles = sleep_cycles_for(busy_ms, device) if cuda else 0
    modes = (False, True) if cuda else (False,)
    out: dict[str, Any] = {
        "vllm_version": release,
        "trace": {k: v for k, v in vars(TraceConfig()).items() if k not in ("block_sizes", "steps")},
        "busy_ms": busy_ms if cuda else 0,
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "setups": [s.name for s in all_setups],
        "checks": [],
        "runs": {},
    }
    try:
        for g in groups:
            cfg = TraceConfig(block_sizes=BLOCK_SIZES[:g], steps=max(steps, check_steps))
            out.setdefault("block_sizes", {})[g] = list(cfg.block_sizes)
            plans = make_trace(cfg)
            for s in all_setups:
                if s.layer == "vllm" and s.tier == "uva" or s.layer == "floor":
                    continue
                for busy in modes:
                    cyc = cycles if busy else 0
                    r = check(s, cfg, device, cyc, trace=plans[:check_steps], release=release)
                    r.update(groups=g, busy=busy)
                    out["checks"].append(r)
                    log(f"check {s.name} groups={g} busy={busy}: {len(r['mismatches'])} mismatches")
            for rep in range(repeats):
                for busy in modes:
                    res = run_lockstep(
                        all_setups, cfg, device, plans[:steps], cycles if busy else 0, warmup, release=release
                    )
                    for name, r in res.items():
                        out["runs"].setdefault(f"{name}|g{g}|{'busy' if busy else 'idle'}", []).append(r)
                log(f"engine groups={g}: repeat {rep + 1}/{repeats} done")
    finally:
        close_plugin_modules()  # the step setups' vLLM modules and patch
    out["medians"] = {
        k: {m: float(np.median([r[m] for r in v])) for m in ("prep_us", "buffer_us")}
        for k, v in out["runs"].items()
    }
    out["identical_inputs"] = all(not c["mismatches"] for c in out["checks"])
    return out


BLOCK_SIZES = (16, 32, 16, 64)
"""KV-cache groups' block sizes: group 0 full attention, group 1 e.g. a sliding-window group."""


def _entry(description: str, value: float | None, op: str, goal: float, note: str | None = None,
           missing: str = "") -> dict[str, Any]:  # fmt: skip
    """A target in the bench report's form (as ``bench._ratio`` makes them)."""
    e: dict[str, Any] = {"description": description, "workload": "engine", "op": op, "target": goal}
    if value is None:
        e.update(
            measured=None, passed=None, skipped=f"not measured in this run{': ' + missing if missing else ''}"
        )
        return e
    e.update(measured=round(value, 4), passed=value <= goal if op == "<=" else value >= goal)
    if note:
        e["worst_note"] = note
    return e


def _floor_why(meds: dict[str, Any], runs: dict[str, Any], setup: str, g: int) -> str:
    """The part of ``setup``'s buffer work furthest above its floor (busy GPU, last run), in one line."""
    mine, floor = (
        runs.get(f"{setup}|g{g}|busy") or runs.get(f"{setup}|g{g}|idle"),
        runs.get(f"floor|g{g}|busy"),
    )
    if not mine or not floor:
        return ""
    a, f = mine[-1]["sections_us"], floor[-1]["sections_us"]
    part = max(SECTIONS, key=lambda k: a.get(k, 0) - f.get(k, 0))
    mine_us, floor_us = a.get(part, 0), f.get(part, 0)
    return f"most above the floor: {part} {mine_us:.1f} µs against {floor_us:.1f} µs ({setup}, {g}g)"


GOALS: dict[str, dict[str, float]] = {
    "0.33.0": {"step_uva_vs_vllm_uva": 0.4, "step_pageable_vs_vllm_uva": 0.5, "dropin_uva_vs_vllm_uva": 0.7,
               "dropin_pageable_vs_vllm_nopin": 0.6},
    "0.34.0": {"step_uva_vs_vllm_uva": 0.5, "step_pageable_vs_vllm_uva": 0.6, "dropin_uva_vs_vllm_uva": 0.9,
               "dropin_pageable_vs_vllm_nopin": 0.7},
}  # fmt: skip
"""The engine goals that differ by the peer's release (the others are the same for every release); a
release without an entry takes the newest entry's."""


def release_suffix(release: str) -> str:
    """The suffix of a target measured against vLLM ``release``: ``_v034`` for 0.34.x."""
    major, minor = release.split(".")[:2]
    return f"_v{int(major)}{int(minor):02d}"


def targets(res: dict[str, Any] | None, micro: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The engine and vs-vLLM targets, ratios of medians measured in one run, each with pass/fail.

    An engine ratio is measured on the idle and the busy GPU (``measured_idle``, ``measured_busy``);
    ``measured`` is the worse of the two, so a target passes only where both pass. Each engine target's
    name ends in its peer's release (``_v034``), and its goal is that release's (:data:`GOALS`).
    """
    res = res or {}
    out: dict[str, dict[str, Any]] = {}
    meds = res.get("medians", {})
    runs = res.get("runs", {})
    groups = sorted({int(k.split("|")[1][1:]) for k in meds}) or [1, 2]
    sb = [s for s in res.get("setups", []) if s.startswith("stagebuf_")]
    gpu = "needs a GPU"
    release = (micro or {}).get("vllm_version") or res.get("vllm_version") or vllm_mrv2.NEWEST
    peer = ".".join(str(release).split(".")[:2])  # the peer's release in the descriptions, as "0.34"
    eng_release = res.get("vllm_version") or vllm_mrv2.NEWEST
    sfx = release_suffix(eng_release)
    goals = GOALS.get(eng_release) or GOALS[max(GOALS, key=lambda r: tuple(map(int, r.split("."))))]

    def ratio(num: str, den: str, g: int, m: str, what: str = "buffer_us") -> float | None:
        a, b = meds.get(f"{num}|g{g}|{m}"), meds.get(f"{den}|g{g}|{m}")
        return None if not a or not b else a[what] / b[what]

    def both(num: str, den: str, g: int, what: str = "buffer_us") -> tuple[float | None, dict[str, float]]:
        got = {m: ratio(num, den, g, m, what) for m in ("idle", "busy")}
        have = {m: round(v, 4) for m, v in got.items() if v is not None}
        return (max(have.values()) if have else None), {f"measured_{m}": v for m, v in have.items()}

    worst: tuple[float, str] | None = None
    at = ("", 0)  # the worst setup and its KV groups
    for g in groups:
        base = meds.get(f"vllm_uva|g{g}|busy"), meds.get(f"vllm_uva|g{g}|idle")
        if not all(base):
            continue
        vllm_r = base[0]["prep_us"] / base[1]["prep_us"]
        for s in sb:
            busy, idle = meds.get(f"{s}|g{g}|busy"), meds.get(f"{s}|g{g}|idle")
            if busy and idle:
                r = busy["prep_us"] / idle["prep_us"] - vllm_r
                if worst is None or r > worst[0]:
                    worst = (r, f"{s}, {g} KV groups: busy/idle {busy['prep_us'] / idle['prep_us']:.3f}, "
                                f"vLLM UVA's {vllm_r:.3f}")  # fmt: skip
                    at = (s, g)
    e = out[f"engine_busy_ratio_vs_vllm{sfx}"] = _entry(
        "engine: host preparation busy/idle (3 ms forward stand-in, two steps in flight) of a stagebuf "
        "setup, minus vLLM UVA's busy/idle in the same run; worst stagebuf setup x KV groups",
        None if worst is None else worst[0], "<=", 0.05, None if worst is None else worst[1], gpu,
    )  # fmt: skip
    busy_runs, idle_runs = runs.get(f"{at[0]}|g{at[1]}|busy"), runs.get(f"{at[0]}|g{at[1]}|idle")
    if e.get("passed") is False and busy_runs and idle_runs:
        b, i = busy_runs[-1]["sections_us"], idle_runs[-1]["sections_us"]
        part = max(SECTIONS, key=lambda k: b.get(k, 0) - i.get(k, 0))
        waits = sum(r.get("guard_waits", 0) for r in busy_runs)
        e["why"] = (
            f"the part that grows most on the busy GPU ({at[0]}, {at[1]}g, last run, mean µs a step): {part} "
            f"{i.get(part, 0):.1f} -> {b.get(part, 0):.1f}; guard waits in its busy runs: {waits}"
        )
    rows = (
        ("step_uva_vs_vllm_uva", "stagebuf_step_uva", "vllm_uva", 0.4, "buffer_us",
         "step mode (STAGEBUF_VLLM=step) on UVA / vLLM's own layer on UVA"),
        ("step_pageable_vs_vllm_uva", "stagebuf_step_pageable", "vllm_uva", 0.5, "buffer_us",
         "step mode on PAGEABLE (no pinned memory) / vLLM's own layer on UVA (bare metal)"),
        ("step_prep_vs_vllm_uva", "stagebuf_step_uva", "vllm_uva", 0.75, "prep_us",
         "the whole host preparation, step mode on UVA / vLLM's own layer on UVA"),
        ("dropin_uva_vs_vllm_uva", "stagebuf_dropin_uva", "vllm_uva", 0.7, "buffer_us",
         "stagebuf's classes in vLLM's place (STAGEBUF_VLLM=1) on UVA / vLLM's own layer on UVA"),
        ("own_uva_vs_vllm_uva", "stagebuf_own_uva", "vllm_uva", 0.5, "buffer_us",
         "stagebuf's own API on UVA / vLLM's own layer on UVA"),
        ("dropin_pageable_vs_vllm_nopin", "stagebuf_dropin_pageable", "vllm_nopin", 0.6, "buffer_us",
         "stagebuf's classes on PAGEABLE / vLLM's NonUvaBuffer fallback (no pinned memory)"),
        ("own_pageable_vs_vllm_uva", "stagebuf_own_pageable", "vllm_uva", 1.0, "buffer_us",
         "stagebuf's own API on PAGEABLE (no pinned memory) / vLLM's own layer on UVA (bare metal)"),
    )  # fmt: skip
    for name, num, den, goal, what, text in rows:
        goal = goals.get(name, goal)
        for g in groups:
            v, extra = both(num, den, g, what)
            e = _entry(
                f"engine {'buffer work' if what == 'buffer_us' else 'host preparation'}, {g} KV "
                f"group{'s' if g > 1 else ''}, idle and busy GPU (the worse): {text}",
                v, "<=", goal, missing=gpu,
            )  # fmt: skip
            e.update(extra)
            if e.get("passed") is False:
                e["why"] = _floor_why(meds, runs, num, g)
            if name == "dropin_uva_vs_vllm_uva" and e.get("passed") and eng_release in GOALS:
                slower = _slower_parts(runs, num, den, g)
                if slower:  # the goal adds: no part slower than vLLM's own
                    e.update(passed=False, why=f"slower than vLLM's own in {slower}")
            out[f"engine_{name}_g{g}{sfx}"] = e
    worst_f: tuple[float, str] | None = None
    for g in groups:
        for s in (x for x in sb if x.startswith("stagebuf_step_")):
            for m in ("idle", "busy"):
                v = ratio(s, "floor", g, m)
                if v is not None and (worst_f is None or v > worst_f[0]):
                    worst_f = (v, f"{s}, {g} KV groups, {m}")
    e = _entry(
        "engine: step mode's buffer work / the summed floor of its parts (each part's bytes in one packed "
        "transfer plus one launch, measured in the same run); worst tier x KV groups x idle/busy",
        None if worst_f is None else worst_f[0], "<=", 4.0, None if worst_f is None else worst_f[1], gpu,
    )  # fmt: skip
    out[f"engine_step_vs_floor{sfx}"] = e
    med = (micro or {}).get("median_us", {})
    cells = {c: d for c, d in med.items() if c.startswith("writes|") and "stagebuf_uva" in d}
    rs = {c.split("|")[1]: d["stagebuf_uva"] / d["vllm_uva"] for c, d in cells.items()}
    w = max(rs.items(), key=lambda kv: kv[1]) if rs else None
    e = out["vllm_staged_write_per_cell"] = _entry(
        f"StagedWriteTensor, E stage_write calls of L values + apply_write: stagebuf UVA / vLLM {peer}'s "
        "on UVA, worst E x L cell",
        None if w is None else w[1], "<=", 0.6, None if w is None else f"E x L = {w[0]}", "needs a GPU",
    )  # fmt: skip
    if w is not None and e["passed"] is False:
        d, st = cells[f"writes|{w[0]}"], med.get(f"stage|{w[0]}", {})
        parts = [
            f"{who} {d[p]:.1f} µs" + (f" ({st[p]:.1f} staging + {d[p] - st[p]:.1f} apply)" if p in st else "")
            for who, p in (("stagebuf", "stagebuf_uva"), (f"vLLM {peer}", "vllm_uva"))
        ]
        e["why"] = f"E x L = {w[0]}: {' against '.join(parts)}"
    for case, label in (
        ("pool|k8", "UvaBufferPool.copy_to_uva"),
        ("backed|k8", "UvaBackedTensor.copy_to_uva"),
    ):
        d = med.get(case, {})
        v = d["stagebuf_uva"] / d["vllm_uva"] if "stagebuf_uva" in d and d.get("vllm_uva") else None
        e = out[f"vllm_{case.split('|')[0]}_copy_to_uva"] = _entry(
            f"{label}, 8 per step of 256 int32: stagebuf UVA / vLLM {peer}'s on UVA", v, "<=", 0.8,
            missing="needs a GPU",
        )  # fmt: skip
        one = med.get(case.replace("k8", "k1"), {})
        if e.get("passed") is False and "stagebuf_uva" in one and "vllm_uva" in one:
            ours, theirs = d["stagebuf_uva"] / 8, d["vllm_uva"] / 8
            e["why"] = (
                f"a call: {ours:.2f} µs against vLLM's {theirs:.2f}; with one call a step (each pays the "
                f"slot guard's event record and query) {one['stagebuf_uva']:.1f} against "
                f"{one['vllm_uva']:.1f}: vLLM's has no guard"
            )
    both_uva = ("stagebuf_uva", "vllm_uva")
    prompts = {c: d for c, d in med.items() if c.startswith("prompt|") and all(p in d for p in both_uva)}
    pr = {c.split("|", 1)[1]: d["stagebuf_uva"] / d["vllm_uva"] for c, d in prompts.items() if d["vllm_uva"]}
    wp = max(pr.items(), key=lambda kv: kv[1]) if pr else None
    e = out[f"vllm_stage_prompt{release_suffix(release)}"] = _entry(
        f"StagedWriteTensor.stage_write of one prompt + apply_write (as vLLM {peer} passes it, an ndarray or "
        f"a list; 16 to 131 072 tokens): stagebuf UVA / vLLM {peer}'s on UVA, worst cell",
        None if wp is None else wp[1], "<=", 1.0, None if wp is None else wp[0], "needs a GPU",
    )  # fmt: skip
    if wp is not None and e["passed"] is False:
        d = prompts[f"prompt|{wp[0]}"]
        e["why"] = f"{wp[0]}: stagebuf {d['stagebuf_uva']:.1f} µs against vLLM {peer}'s {d['vllm_uva']:.1f}"
    return out


def _slower_parts(runs: dict[str, Any], num: str, den: str, g: int) -> str:
    """The parts of the engine step where ``num`` spends more than ``den`` (busy GPU, mean µs a step over
    the runs), as text; empty where none is slower by more than 5%."""

    def part_means(setup: str) -> dict[str, float]:
        rs = runs.get(f"{setup}|g{g}|busy") or runs.get(f"{setup}|g{g}|idle") or []
        return {k: float(np.mean([r["sections_us"].get(k, 0) for r in rs])) if rs else 0.0 for k in SECTIONS}

    a, b = part_means(num), part_means(den)
    slow = [f"{k} {a[k]:.1f} µs against {b[k]:.1f}" for k in SECTIONS if b[k] and a[k] > 1.05 * b[k]]
    return "; ".join(slow)


def sync_check(
    setup: Setup,
    cfg: TraceConfig,
    device: torch.device,
    warmup: int = 20,
    busy_cycles: int = 0,
    release: str = vllm_mrv2.NEWEST,
) -> str | None:
    """Run the trace with ``torch.cuda.set_sync_debug_mode("error")`` after ``warmup`` steps.

    Returns None, or the error of the first synchronising call (with the step it happened in).
    """
    plans = make_trace(cfg)
    with stagebuf_tier(_tier_of(setup)):
        eng = Engine(setup, cfg, device, release)
        prev: Any = None
        try:
            for i, plan in enumerate(plans):
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


def _engine_tables(eng: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """One release's engine run as tables (none where it was not run)."""
    out: list[tuple[str, list[str], list[list[str]]]] = []
    meds = eng.get("medians", {})
    if meds:
        groups = sorted({int(k.split("|")[1][1:]) for k in meds})
        head = ["setup"] + [
            f"{g}g {w} {m}" for g in groups for w in ("prep", "buffer") for m in ("idle", "busy")
        ]
        rows = []
        for s in eng.get("setups", []):
            cells = [s]
            for g in groups:
                for w in ("prep_us", "buffer_us"):
                    for m in ("idle", "busy"):
                        v = meds.get(f"{s}|g{g}|{m}", {}).get(w)
                        cells.append("-" if v is None else f"{v:.1f}")
            rows.append(cells)
        n_ok = sum(1 for c in eng.get("checks", []) if not c["mismatches"])
        title = (
            f"engine: vLLM {eng.get('vllm_version')} MRV2 input path, host µs per step (median of "
            f"{eng.get('repeats')} interleaved runs of {eng.get('steps', 0) - eng.get('warmup', 0)} steps); "
            f"identical inputs: {n_ok}/{len(eng.get('checks', []))} checks"
        )
        out.append((title, head, rows))
        srow = []
        for s in eng.get("setups", []):
            for g in groups:
                runs = eng.get("runs", {}).get(f"{s}|g{g}|busy") or eng.get("runs", {}).get(f"{s}|g{g}|idle")
                if runs:
                    sec = runs[-1]["sections_us"]
                    srow.append([f"{s}, {g}g", *(f"{sec.get(k, 0):.1f}" for k in SECTIONS)])
        out.append(
            (
                "engine: buffer work by part, mean µs per step (last run; busy GPU where run)",
                ["setup", *SECTIONS],
                srow,
            )
        )
        frow = []
        for g in groups:
            fl = eng.get("runs", {}).get(f"floor|g{g}|busy") or eng.get("runs", {}).get(f"floor|g{g}|idle")
            if not fl:
                continue
            f = fl[-1]["sections_us"]
            for s in eng.get("setups", []):
                runs = eng.get("runs", {}).get(f"{s}|g{g}|busy") or eng.get("runs", {}).get(f"{s}|g{g}|idle")
                if not runs or s == "floor":
                    continue
                sec = runs[-1]["sections_us"]
                above = [sec.get(k, 0) - f.get(k, 0) for k in SECTIONS]
                frow.append([f"{s}, {g}g", *(f"{x:.1f}" for x in above), f"{sum(above):.1f}"])
            frow.append([f"floor, {g}g", *(f"{f.get(k, 0):.1f}" for k in SECTIONS), f"{sum(f.values()):.1f}"])
        if frow:
            out.append(
                (
                    "engine: buffer work above the floor (each part's bytes in one packed transfer plus one "
                    "launch, same run), mean µs per step (last run; busy GPU where run); last row: the floor",
                    ["setup", *SECTIONS, "total"],
                    frow,
                )
            )
    return out


def tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The engine (each release run) and vs-vLLM results as (title, header, rows) tables, for the console
    and Markdown."""
    out: list[tuple[str, list[str], list[list[str]]]] = []
    for eng in [report.get("engine") or {}, *(report.get("engine_also") or {}).values()]:
        out += _engine_tables(eng)
    micro = report.get("vs_vllm") or {}
    med = micro.get("median_us", {})
    if med:
        peers: list[str] = []
        for d in med.values():
            peers += [p for p in d if p not in peers]
        rows = [[c, *(f"{d[p]:.1f}" if p in d else "-" for p in peers)] for c, d in med.items()]
        rel = micro.get("vllm_version") or eng.get("vllm_version")
        whose = f"vLLM {rel}'s" if rel else "vLLM's"
        out.append((f"vs {whose} own classes: host µs per step, idle GPU", ["case", *peers], rows))
    return out


def plugin_vs_dropin(
    device: torch.device,
    tiers: tuple[str, ...],
    repeats: int = 3,
    steps: int = 150,
    busy_ms: float = 3.0,
    release: str = vllm_mrv2.NEWEST,
) -> dict[str, Any]:
    """stagebuf through its vLLM plugin against the direct substitution: identical inputs (each against
    vLLM's own layer, 2 KV groups, busy GPU) and buffer-work timings in lockstep, busy GPU."""
    cycles = sleep_cycles_for(busy_ms, device) if device.type == "cuda" else 0
    cfg = TraceConfig(block_sizes=BLOCK_SIZES[:2], steps=steps)
    plans = make_trace(cfg)
    out: dict[str, Any] = {"checks": {}, "runs": {}}
    try:
        for t in tiers:
            for s in (Setup("stagebuf", t), Setup("plugin", t)):
                r = check(s, cfg, device, cycles, trace=plans, release=release)
                out["checks"][s.name] = r["mismatches"]
        pairs = [s for t in tiers for s in (Setup("stagebuf", t), Setup("plugin", t))]
        for _ in range(repeats):
            for name, r in run_lockstep(pairs, cfg, device, plans, cycles, 30, release=release).items():
                out["runs"].setdefault(name, []).append({k: r[k] for k in ("prep_us", "buffer_us")})
    finally:
        close_plugin_modules()
    out["medians"] = {
        k: {m: float(np.median([r[m] for r in v])) for m in ("prep_us", "buffer_us")}
        for k, v in out["runs"].items()
    }
    return out
