"""nano-vllm's input preparation, built in bulk with numpy and staged through stagebuf.

One :class:`Prep` per attached ``ModelRunner``. Each ``prepare_*`` returns what
nano-vllm's own method returns (the same values, dtypes and shapes, and the same
attention context through the runner's own ``set_context``):

* ``prefill`` and ``decode``: every array of the call in one :class:`StepStager`
  step, so one transfer per call on PINNED and PAGEABLE, none on UVA and HOST;
* ``sample``: the sampling arrays it hands on in one step of a second stager (a
  :class:`DeviceParamTable` of rows by batch position measured slower: 49.5 against
  38.2 µs per call on HOST, 84.2 against 39.0 on PAGEABLE, 256 sequences, CPU machine);
* ``decode`` on a runner with captured CUDA graphs: the arrays are written from a
  guarded host slot straight into the graphs' static inputs, padded as nano-vllm's
  ``run_model`` pads them, and :func:`run_model` replays without its device-to-device
  copies.
"""

from __future__ import annotations

import sys
from itertools import chain
from typing import Any

import numpy as np
import torch

from ._guard import slot_count
from ._make import make_buffer
from ._ring import Ring
from ._stager import StepStager
from ._tier import Tier

SAMPLING = (
    ("temperature", torch.float32),
    ("cfg_scale", torch.float32),
    ("top_k", torch.int32),
    ("top_p", torch.float32),
    ("repetition_penalty", torch.float32),
)
"""prepare_sample's five arrays, in its order, with nano-vllm's dtypes."""

GRAPH_INPUTS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")
"""The captured graphs' static inputs that a decode step writes (nano-vllm's ``graph_vars`` keys)."""

_MAX_GRAPH_BS = 512  # run_model replays a graph only up to this batch size


def _fromiter(it: Any, dtype: type, n: int) -> np.ndarray:
    return np.fromiter(it, dtype, count=n)


def _padded_tables(tables: list[list[int]], width: int | None = None) -> np.ndarray:
    """``tables`` as an int32 array of ``width`` columns (their longest), right-padded with -1."""
    lens = np.fromiter(map(len, tables), np.int64, count=len(tables))
    w = int(lens.max(initial=0)) if width is None else width
    out = np.full((len(tables), w), -1, np.int32)
    total = int(lens.sum())
    if total:
        flat = np.fromiter(chain.from_iterable(tables), np.int64, count=total)
        out[np.arange(w) < lens[:, None]] = flat
    return out


def _ranges(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each i, ``range(starts[i], starts[i] + lens[i])``, concatenated; and each value's row i."""
    total = int(lens.sum())
    row = np.repeat(np.arange(len(lens)), lens)
    first = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) - np.repeat(first - starts, lens), row


class Prep:
    """stagebuf's state for one runner: the step stager, the sampling stager, the graph slots."""

    def __init__(self, runner: Any):
        cfg = runner.config
        self.block_size = int(runner.block_size)
        self.max_bs = int(cfg.max_num_seqs)
        max_tokens = int(cfg.max_num_batched_tokens)
        max_blocks = -(-int(cfg.max_model_len) // self.block_size)
        # one prefill at the batched-token budget, or one decode, fits a slot without growing
        cap = 20 * max_tokens + 8 * (self.max_bs + 1) + 4 * self.max_bs * (max_blocks + 4) + 16 * 8
        self.stager = StepStager(capacity=max(cap, 1 << 16))
        self.device = self.stager.device
        # its own ring: a second step per engine step on the first would reuse a slot still read
        self.sampler = StepStager(
            capacity=max(24 * self.max_bs + 16 * len(SAMPLING), 1 << 12), device=self.device
        )
        mod = sys.modules[type(runner).__module__]
        self.set_context = mod.set_context
        self.get_context = mod.get_context
        self.graph: _GraphInputs | None = None
        if not runner.enforce_eager and getattr(runner, "graph_vars", None) is not None:
            self.graph = _GraphInputs(runner.graph_vars, self.device)  # now, not in the first decode
        self.graph_ids: torch.Tensor | None = None
        """The input_ids tensor the last graph-mode decode returned (run_model replays for it)."""

    # --- prefill and decode -------------------------------------------------------------------

    def block_tables(self, seqs: list[Any]) -> torch.Tensor:
        with self.stager.step() as st:
            out = st.stage(_padded_tables([s.block_table for s in seqs]))
        return out

    def prefill(self, seqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(seqs)
        B = self.block_size
        lens = _fromiter((s.num_tokens for s in seqs), np.int64, n)
        cached = _fromiter((s.num_cached_tokens for s in seqs), np.int64, n)
        q = lens - cached
        ids: list[int] = []
        for s in seqs:
            ids += s.token_ids[s.num_cached_tokens :]
        input_ids = np.array(ids, np.int64)
        positions, _ = _ranges(cached, q)
        cu_q = np.zeros(n + 1, np.int32)
        cu_k = np.zeros(n + 1, np.int32)
        np.cumsum(q, out=cu_q[1:])
        np.cumsum(lens, out=cu_k[1:])
        max_q = max(int(q.max(initial=0)), 0)
        max_k = max(int(lens.max(initial=0)), 0)
        tables = [s.block_table for s in seqs]
        bt = _padded_tables(tables)
        # slots of the tokens from the first uncached block on (none for a seq without blocks: warmup)
        has = _fromiter(map(len, tables), np.int64, n) > 0
        first = (cached // B) * B
        m = np.where(has, lens - first, 0)
        pos, row = _ranges(first, m)
        slots = (bt[row, pos // B].astype(np.int64) * B + pos % B).astype(np.int32)
        prefix = int(cu_k[-1]) > int(cu_q[-1])
        with self.stager.step() as st:
            t_bt = st.stage(bt) if prefix else None
            t_ids = st.stage(input_ids)
            t_pos = st.stage(positions)
            t_cuq = st.stage(cu_q)
            t_cuk = st.stage(cu_k)
            t_slot = st.stage(slots)
        self.graph_ids = None
        self.set_context(True, t_cuq, t_cuk, max_q, max_k, t_slot, None, t_bt)
        return t_ids, t_pos

    def _decode_arrays(self, seqs: list[Any]) -> tuple[np.ndarray, ...]:
        n = len(seqs)
        B = self.block_size
        lens = _fromiter((s.num_tokens for s in seqs), np.int64, n)
        ids = _fromiter((s.last_token for s in seqs), np.int64, n)
        last = _fromiter((s.block_table[-1] for s in seqs), np.int64, n)
        last_block_tokens = lens - ((lens + B - 1) // B - 1) * B
        slots = (last * B + last_block_tokens - 1).astype(np.int32)
        return ids, lens - 1, slots, lens.astype(np.int32)

    def decode(self, runner: Any, seqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, slots, ctx = self._decode_arrays(seqs)
        tables = [s.block_table for s in seqs]
        graph = self._graph_for(runner, len(seqs), max(map(len, tables)))
        if graph is not None:
            return graph.decode(self, ids, pos, slots, ctx, tables)
        bt = _padded_tables(tables)
        with self.stager.step() as st:
            t_ids = st.stage(ids)
            t_pos = st.stage(pos)
            t_slot = st.stage(slots)
            t_ctx = st.stage(ctx)
            t_bt = st.stage(bt)
        self.graph_ids = None
        self.set_context(False, slot_mapping=t_slot, context_lens=t_ctx, block_tables=t_bt)
        return t_ids, t_pos

    # --- sampling -------------------------------------------------------------------------------

    def sample(self, seqs: list[Any], is_cfg_batch: bool) -> tuple[torch.Tensor | None, ...]:
        target = seqs[: len(seqs) // 2] if is_cfg_batch else seqs
        n = len(target)
        top_k = [s.top_k for s in target]
        top_p = [s.top_p for s in target]
        rep = [s.repetition_penalty for s in target]
        cols = (
            _fromiter((s.temperature for s in target), np.float32, n),
            _fromiter((s.cfg_scale for s in target), np.float32, n),
            _fromiter((0 if k is None else k for k in top_k), np.int32, n),
            _fromiter((1.0 if p is None else p for p in top_p), np.float32, n),
            _fromiter((1.0 if r is None else r for r in rep), np.float32, n),
        )
        # nano-vllm's flags, exactly: top-k is handed on when one is > 0; top-p and the repetition
        # penalty when one equals 1.0 (its tests read "== 1.0" where "!= 1.0" looks meant)
        keep = (
            True,
            True,
            any(k is not None and k > 0 for k in top_k),
            any(p is not None and p == 1.0 for p in top_p),
            any(r is not None and r == 1.0 for r in rep),
        )
        with self.sampler.step() as st:
            out = tuple(st.stage(col) if k else None for col, k in zip(cols, keep))
        return out

    # --- CUDA graphs ----------------------------------------------------------------------------

    def _graph_for(self, runner: Any, bs: int, width: int) -> _GraphInputs | None:
        """The graph inputs a decode of ``bs`` sequences goes to, when run_model would replay a graph."""
        gv = getattr(runner, "graph_vars", None)
        if runner.enforce_eager or gv is None or bs > _MAX_GRAPH_BS:
            return None
        if width > gv["block_tables"].size(1):
            return None  # run_model's eager fallback for too wide a block table
        g = self.graph
        if g is None or g.gv is not gv:
            g = self.graph = _GraphInputs(gv, self.device)
        return g


class _GraphInputs:
    """A ring of guarded host slots, each written and copied straight into the graphs' static inputs.

    A decode writes what nano-vllm's ``run_model`` would have copied in, with its padding:
    ``input_ids`` and ``positions`` (the first ``bs`` rows), ``slot_mapping`` (all rows, -1
    past ``bs``), ``context_lens`` (all rows, 0 past ``bs``) and ``block_tables`` (the first
    ``bs`` rows, every column, -1 padded). One host-to-device copy per input, from the slot;
    none on HOST, where the slot is copied on the host.
    """

    def __init__(self, gv: dict[str, torch.Tensor], device: torch.device):
        self.gv = gv
        self.rows = int(gv["input_ids"].size(0))
        self.cols = int(gv["block_tables"].size(1))
        nbytes = 16 * len(GRAPH_INPUTS) + sum(gv[k].numel() * gv[k].element_size() for k in GRAPH_INPUTS)
        self.ring = Ring(
            slot_count(None),
            lambda: make_buffer(nbytes, torch.uint8, device),
            "auto",
            "nano-vllm graph-input slot",
        )
        self.copies = 0
        """Host-to-device copies issued into the static inputs so far."""

    def decode(
        self,
        prep: Prep,
        ids: np.ndarray,
        pos: np.ndarray,
        slots: np.ndarray,
        ctx: np.ndarray,
        tables: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = len(ids)
        rows = self.rows
        slot_all = np.full(rows, -1, np.int32)
        slot_all[:bs] = slots
        ctx_all = np.zeros(rows, np.int32)
        ctx_all[:bs] = ctx
        width = max(map(len, tables))
        arrays = (ids, pos, slot_all, ctx_all, _padded_tables(tables, self.cols))
        ring = self.ring
        cur = ring.next()
        ring.take(cur)
        buf = ring.bufs[cur]
        host = buf.np
        gv = self.gv
        off = 0
        with torch.inference_mode():  # nano-vllm captures its graphs in inference mode
            for name, a in zip(GRAPH_INPUTS, arrays):
                dst = gv[name][: a.shape[0]]
                end = off + a.nbytes
                if buf.tier is Tier.HOST:
                    dst.numpy()[...] = a
                else:
                    host[off:end] = a.reshape(-1).view(np.uint8)
                    src = buf.cpu[off:end].view(dst.dtype).view(dst.shape)
                    dst.copy_(src, non_blocking=True)
                    self.copies += 1
                off = (end + 15) & -16
        if buf.tier is not Tier.HOST:
            ring.count(off)
        t_ids = gv["input_ids"][:bs]
        prep.graph_ids = t_ids
        prep.set_context(
            False,
            slot_mapping=gv["slot_mapping"][:bs],
            context_lens=gv["context_lens"][:bs],
            block_tables=gv["block_tables"][:bs, :width],
        )
        return t_ids, gv["positions"][:bs]


def run_model(runner: Any, prep: Prep, own: Any, input_ids: torch.Tensor, positions: torch.Tensor,
              is_prefill: bool) -> Any:  # fmt: skip
    """nano-vllm's ``run_model``, less its copies into the graph inputs when the decode wrote them."""
    if is_prefill or input_ids is not prep.graph_ids:
        return own(runner, input_ids, positions, is_prefill)
    with torch.inference_mode():
        bs = input_ids.size(0)
        graph = runner.graphs[next(x for x in runner.graph_bs if x >= bs)]
        graph.replay()
        return runner.model.compute_logits(runner.graph_vars["outputs"][:bs])
