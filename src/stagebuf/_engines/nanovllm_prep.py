"""nano-vllm's input preparation, built in bulk with numpy and staged through stagebuf.

One :class:`Prep` per attached ``ModelRunner``. Each ``prepare_*`` returns what
nano-vllm's own method returns (the same values, dtypes and shapes, and the same
attention context through the runner's own ``set_context``):

* ``prefill`` and ``decode``: every array of the call, and the sampling arrays of the
  ``prepare_sample`` that ``run`` calls next, written into one host array and staged
  in one :class:`StepStager` step: one ``stage()`` call and one transfer per engine step
  on PINNED and PAGEABLE, none on UVA and HOST; the tensors are views of it (a
  ``stage()`` per array cost more on the host than the numpy work of the call);
* ``sample``: the arrays staged with that prefill or decode when it follows it for the
  same batch, as in ``run``; otherwise (another batch, another ``is_cfg_batch``, a graph
  decode) one step of a second stager (a :class:`DeviceParamTable` of rows by batch
  position measured slower: 49.5 against 38.2 µs per call on HOST, 84.2 against 39.0
  on PAGEABLE, 256 sequences, CPU machine);
* ``decode`` on a runner with captured CUDA graphs: the arrays are written from a
  guarded host slot straight into the graphs' static inputs, padded as nano-vllm's
  ``run_model`` pads them, and :func:`run_model` replays without its device-to-device
  copies.
"""

from __future__ import annotations

import sys
from itertools import accumulate, chain
from typing import Any

import numpy as np
import torch

from .._bytes.make import make_buffer
from .._common.tier import Tier
from .._rings.guard import slot_count
from .._rings.ring import Ring
from .._rings.stager import StepStager

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


def _padded_tables(
    tables: list[list[int]], width: int | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """``tables`` as int32 rows of ``width`` columns (their longest), right-padded with -1 (into ``out``:
    as wide as it is)."""
    n = len(tables)
    lens = np.fromiter(map(len, tables), np.int64, count=n)
    w = (int(lens.max(initial=0)) if width is None else width) if out is None else out.shape[1]
    total = int(lens.sum())
    flat = np.fromiter(chain.from_iterable(tables), np.int64, count=total)
    if out is None:
        out = np.empty((n, w), np.int32)
    if total == n * w:  # no padding
        out[...] = flat.reshape(n, w)
    else:
        out.fill(-1)
        out[np.arange(w) < lens[:, None]] = flat
    return out


def _pack(n64: int, n32: int, nf32: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One int64 host array for all of a step's arrays, staged whole (one stage() call): ``n64``
    int64 values, then ``n32`` int32 and ``nf32`` float32 ones; returned with views of those two.

    Its length is rounded up to a power of two: a stager slot then sees a few shapes again and
    again (its views cached, its layout replayed) instead of a new one every step, which cost more
    than the bytes the rounding adds (bench trace, HOST, CPU machine: 80.1 against 60.4 µs per
    prefill step, hot)."""
    n = n64 + (n32 + nf32 + 1) // 2
    h = np.empty(1 << max(n - 1, 0).bit_length(), np.int64)
    tail = h[n64:].view(np.int32)
    return h, tail[:n32], tail[n32 : n32 + nf32].view(np.float32)


def _unpack(
    t: torch.Tensor, sizes64: list[int], sizes32: list[int], sizes_f32: list[int]
) -> list[torch.Tensor]:
    """The staged :func:`_pack` array ``t`` as its parts, in order: int64, int32, float32."""
    n32, nf = sum(sizes32), sum(sizes_f32)
    head = torch.split_with_sizes(t, [*sizes64, t.numel() - sum(sizes64)])
    tail = head[-1].view(torch.int32)
    mid = torch.split_with_sizes(tail, [*sizes32, nf, tail.numel() - n32 - nf])
    out = [*head[:-1], *mid[:-2]]
    if sizes_f32:
        out += torch.split_with_sizes(mid[-2].view(torch.float32), sizes_f32)
    return out


def _fill_sample(target: list[Any], k32: np.ndarray, f32: np.ndarray) -> tuple[bool, ...]:
    """prepare_sample's arrays of ``target`` written: top-k into ``k32``; temperature, cfg scale,
    top-p and repetition penalty one after the other into ``f32``. Returns nano-vllm's flags, exactly:
    top-k is handed on when one is > 0; top-p and the repetition penalty when one equals 1.0 (its
    tests read "== 1.0" where "!= 1.0" looks meant)."""
    m = len(target)
    top_k = [s.top_k for s in target]
    top_p = [s.top_p for s in target]
    rep = [s.repetition_penalty for s in target]
    k32[:] = [0 if k is None else k for k in top_k]
    f32[:m] = [s.temperature for s in target]
    f32[m : 2 * m] = [s.cfg_scale for s in target]
    f32[2 * m : 3 * m] = [1.0 if p is None else p for p in top_p]
    f32[3 * m :] = [1.0 if r is None else r for r in rep]
    return (
        any(k is not None and k > 0 for k in top_k),
        any(p is not None and p == 1.0 for p in top_p),
        any(r is not None and r == 1.0 for r in rep),
    )


def _sampled(parts: list[torch.Tensor], keep: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
    """prepare_sample's return from :func:`_unpack`'s last five parts (top-k, then the four float32)."""
    top_k, temp, cfg, top_p, rep = parts[-5:]
    k, p, r = keep
    return temp, cfg, top_k if k else None, top_p if p else None, rep if r else None


class Prep:
    """stagebuf's state for one runner: the step stager, the sampling stager, the graph slots."""

    def __init__(self, runner: Any):
        cfg = runner.config
        self.block_size = int(runner.block_size)
        self.max_bs = int(cfg.max_num_seqs)
        max_tokens = int(cfg.max_num_batched_tokens)
        max_blocks = -(-int(cfg.max_model_len) // self.block_size)
        # one prefill at the batched-token budget, or one decode, fits a slot without growing
        # (with the sampling arrays, and _pack's rounding up to a power of two)
        cap = 20 * max_tokens + 28 * (self.max_bs + 1) + 4 * self.max_bs * (max_blocks + 4) + 16 * 8
        self.stager = StepStager(capacity=max(1 << (cap - 1).bit_length(), 1 << 16))
        self.device = self.stager.device
        # for a prepare_sample that does not follow its prepare_prefill or prepare_decode (see sample()):
        # its own ring, as a second step per engine step on the first would reuse a slot still read
        self.sampler = StepStager(
            capacity=max(1 << (20 * self.max_bs + 16).bit_length(), 1 << 12), device=self.device
        )
        mod = sys.modules[type(runner).__module__]
        self.set_context = mod.set_context
        self.get_context = mod.get_context
        self.graph: _GraphInputs | None = None
        if not runner.enforce_eager and getattr(runner, "graph_vars", None) is not None:
            self.graph = _GraphInputs(runner.graph_vars, self.device)  # now, not in the first decode
        self.graph_ids: torch.Tensor | None = None
        """The input_ids tensor the last graph-mode decode returned (run_model replays for it)."""
        self.rank0 = getattr(runner, "rank", 0) == 0
        """Whether run() calls prepare_sample after each prepare_prefill or prepare_decode."""
        self.pending: tuple[list[Any], bool, tuple[torch.Tensor | None, ...]] | None = None
        """(seqs, is_cfg_batch, the arrays) staged with the last prefill or decode, for its prepare_sample."""
        self._ar = np.arange(max(max_tokens, int(cfg.max_model_len)), dtype=np.int64)
        self._in_block = np.arange(self.block_size, dtype=np.int32)

    # --- prefill and decode -------------------------------------------------------------------

    def block_tables(self, seqs: list[Any]) -> torch.Tensor:
        self.pending = None  # a step of the stager in between: prepare_sample stages its own
        with self.stager.step() as st:
            out = st.stage(_padded_tables([s.block_table for s in seqs]))
        return out

    def _next_sample(self, seqs: list[Any]) -> tuple[bool | None, list[Any]]:
        """(is_cfg_batch, its sequences) of the prepare_sample that run() calls next, by run()'s own
        rule for a CFG batch; (None, []) where run() calls none (a rank > 0) or the batch is empty."""
        if not (self.rank0 and seqs):
            return None, []
        s = seqs[0]
        cfg = bool(s.cfg_scale > 1.0 and s.paired_seq is not None)
        return cfg, seqs[: len(seqs) // 2] if cfg else seqs

    def _publish(
        self, seqs: list[Any], h: np.ndarray, sizes: tuple[list[int], list[int]], cfg: bool | None,
        keep: tuple[bool, ...],
    ) -> list[torch.Tensor]:  # fmt: skip
        """Stage ``h`` (from :func:`_pack`) in one step; its parts, the sampling arrays kept pending."""
        with self.stager.step() as st:
            t = st.stage(h)
        m = sizes[1][-1]
        parts = _unpack(t, sizes[0], sizes[1], [] if cfg is None else [m] * 4)
        self.pending = None if cfg is None else (seqs, cfg, _sampled(parts, keep))
        self.graph_ids = None
        return parts

    def prefill(self, seqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        B = self.block_size
        ids: list[int] = []
        lens: list[int] = []
        cached: list[int] = []
        blocks: list[int] = []  # each sequence's blocks from its first uncached one on
        nslots: list[int] = []  # the slots written: every token of those blocks
        for s in seqs:
            length, c = s.num_tokens, s.num_cached_tokens
            ids += s.token_ids[c:]
            lens.append(length)
            cached.append(c)
            if s.block_table:  # warmup's sequences have no blocks, and no slots
                first = c // B
                blocks += s.block_table[first : -(-length // B)]
                nslots.append(length - first * B)
            else:
                nslots.append(0)
        n = len(seqs)
        q = [k - c for k, c in zip(lens, cached)]
        cu_q = list(accumulate(q, initial=0))
        cu_k = list(accumulate(lens, initial=0))
        nq, ns, nb = cu_q[-1], sum(nslots), len(blocks)
        prefix = cu_k[-1] > nq  # prefix-cache hits: the attention reads the block tables
        tables = [s.block_table for s in seqs] if prefix else []
        w = max(map(len, tables)) if prefix else 0
        cfg, target = self._next_sample(seqs)
        m = len(target)
        # int32: cu_seqlens_q, cu_seqlens_k, slot_mapping, block_tables, top-k; then the float32 four
        sizes32 = [n + 1, n + 1, ns, n * w, m]
        o_slot = 2 * n + 2
        o_bt = o_slot + ns
        o_k = o_bt + n * w
        h, h32, f32 = _pack(2 * nq, o_k + m, 4 * m)
        ar = self._ar
        need = max(nq, ns, max(lens, default=0))
        if len(ar) < need:
            ar = self._ar = np.arange(2 * need, dtype=np.int64)
        h[:nq] = np.fromiter(ids, np.int64, nq)
        if n == 1:
            h[nq : 2 * nq] = ar[cached[0] : lens[0]]
        else:  # range(cached, length) per sequence: one arange less each sequence's offset
            np.add(ar[:nq], np.repeat(np.subtract(cached, cu_q[:-1]), q), out=h[nq : 2 * nq])
        h32[: n + 1] = cu_q
        h32[n + 1 : o_slot] = cu_k
        if ns:
            # every slot of those blocks, row by row; of each sequence's rows, its first nslots
            full = ((np.array(blocks, np.int32) * B)[:, None] + self._in_block).reshape(-1)
            if nb * B - ns == -nslots[-1] % B:  # no block short but the last one: no gaps
                h32[o_slot:o_bt] = full[:ns]
            else:
                rows = list(accumulate((-(-k // B) for k in nslots), initial=0))[:-1]
                start = np.subtract(np.multiply(rows, B), list(accumulate(nslots, initial=0))[:-1])
                np.take(full, ar[:ns] + np.repeat(start, nslots), out=h32[o_slot:o_bt])
        if prefix:
            _padded_tables(tables, out=h32[o_bt:o_k].reshape(n, w))
        keep = (False,) * 3 if cfg is None else _fill_sample(target, h32[o_k:], f32)
        parts = self._publish(seqs, h, ([nq, nq], sizes32), cfg, keep)
        bt = parts[5].view(n, w) if prefix else None
        self.set_context(True, parts[2], parts[3], max([0, *q]), max([0, *lens]), parts[4], None, bt)
        return parts[0], parts[1]

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
        n, w = len(seqs), max(map(len, tables))
        graph = self._graph_for(runner, n, w)
        if graph is not None:
            self.pending = None
            return graph.decode(self, ids, pos, slots, ctx, tables)
        cfg, target = self._next_sample(seqs)
        m = len(target)
        h, h32, f32 = _pack(2 * n, 2 * n + n * w + m, 4 * m)
        h[:n] = ids
        h[n : 2 * n] = pos
        h32[:n] = slots
        h32[n : 2 * n] = ctx
        _padded_tables(tables, out=h32[2 * n : 2 * n + n * w].reshape(n, w))
        keep = (False,) * 3 if cfg is None else _fill_sample(target, h32[2 * n + n * w :], f32)
        parts = self._publish(seqs, h, ([n, n], [n, n, n * w, m]), cfg, keep)
        self.set_context(
            False, slot_mapping=parts[2], context_lens=parts[3], block_tables=parts[4].view(n, w)
        )
        return parts[0], parts[1]

    # --- sampling -------------------------------------------------------------------------------

    def sample(self, seqs: list[Any], is_cfg_batch: bool) -> tuple[torch.Tensor | None, ...]:
        """The arrays staged with the prefill or eager decode just before, when it was of this
        ``seqs`` list and ``is_cfg_batch`` is run()'s (as run() calls it); else staged now, on the
        sampler's ring."""
        p = self.pending
        self.pending = None
        if p is not None and p[0] is seqs and p[1] == is_cfg_batch:
            return p[2]
        target = seqs[: len(seqs) // 2] if is_cfg_batch else seqs
        m = len(target)
        h, k32, f32 = _pack(0, m, 4 * m)
        keep = _fill_sample(target, k32, f32)
        with self.sampler.step() as st:
            t = st.stage(h)
        return _sampled(_unpack(t, [], [m], [m] * 4), keep)

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
