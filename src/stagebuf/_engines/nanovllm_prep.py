"""nano-vllm's input preparation, built in bulk with numpy and staged through stagebuf.

One :class:`Prep` per attached ``ModelRunner``. Each ``prepare_*`` returns what
nano-vllm's own method returns (the same values, dtypes and shapes, and the same
attention context through the runner's own ``set_context``):

* ``prefill`` and ``decode``: every array of the call, and the sampling arrays of the
  ``prepare_sample`` that ``run`` calls next, written in place into one reservation of
  one :class:`StepStager` step (:meth:`Step.reserve`): one transfer per engine step, none on
  HOST (on a UVA machine too: the forward reads these in every layer, so they are copied once
  into device memory rather than read through UVA each time). The tensors are views of the slot's arena;
  those whose place and size repeat (all of a decode's, a prefill's cumulative lengths and
  sampling arrays) are made once per slot and layout (see :meth:`Prep._arrays`), a prefill's
  own with one ``as_strided`` each;
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

import math
import sys
from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np
import torch

from .._bytes.buffers import reread_tier
from .._bytes.make import make_buffer
from .._common.cache import BoundedCache
from .._rings.guard import slot_count
from .._rings.ring import Ring
from .._rings.stager import Step, StepStager
from .._tiers.probe import capabilities

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


_I32, _I64, _F32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
Segments = tuple[tuple[np.dtype, tuple[int, ...]], ...]
"""A step's arrays as laid out in its arena: (dtype, shape) each, in order."""
Typed = dict[np.dtype, tuple[torch.Tensor, int]]
"""A slot's arena as each dtype, with that view's storage offset."""

_MAX_CACHED = 256  # views kept per Prep (per arena, offset and layout)


def _offsets(segs: Segments, start: int = 0) -> tuple[list[int], int]:
    """Each segment's byte offset (aligned to its element size) from ``start``, and the end."""
    offs = []
    pos = start
    for dt, shape in segs:
        a = dt.itemsize
        pos = (pos + a - 1) & -a
        offs.append(pos)
        pos += math.prod(shape) * a
    return offs, pos


def _views(
    hb: np.ndarray, typed: Callable[[np.dtype], torch.Tensor], off: int, segs: Segments, offs: list[int]
) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """The host views (into ``hb``, the reserved bytes) and device views (into the arena at ``off``;
    ``typed(dtype)`` is the step's arena as that dtype) of ``segs`` at ``offs``: one
    ``split_with_sizes`` per run of segments of one dtype (a tensor slice costs several times more
    on the host, on a CUDA tensor)."""
    hs: list[np.ndarray] = []
    ts: list[torch.Tensor] = []
    i, k = 0, len(segs)
    while i < k:
        dt = segs[i][0]
        j = i
        while j < k and segs[j][0] is dt:
            j += 1
        size = dt.itemsize
        first = (off + offs[i]) // size
        counts = [math.prod(shape) for _, shape in segs[i:j]]
        whole = typed(dt)
        parts = whole.split_with_sizes([first, *counts, whole.shape[0] - first - sum(counts)])
        for (_, shape), o, n, t in zip(segs[i:j], offs[i:j], counts, parts[1:]):
            h = hb[o : o + n * size].view(dt)
            if len(shape) > 1:
                h, t = h.reshape(shape), t.view(shape)
            hs.append(h)
            ts.append(t)
        i = j
    return hs, ts


def _fill_sample(target: list[Any], hs: list[np.ndarray]) -> tuple[bool, ...]:
    """prepare_sample's arrays of ``target`` written into ``hs``: top-k, and one (4, m) view of the
    temperature, cfg scale, top-p and repetition penalty rows. Returns nano-vllm's flags, exactly: top-k
    is handed on when one is > 0; top-p and the repetition penalty when one equals 1.0 (its tests read
    "== 1.0" where "!= 1.0" looks meant)."""
    top_k = [s.top_k or 0 for s in target]
    top_p = [s.top_p for s in target]
    rep = [s.repetition_penalty for s in target]
    hs[0][:] = top_k
    hs[1][...] = (
        [s.temperature for s in target],
        [s.cfg_scale for s in target],
        [1.0 if p is None else p for p in top_p],
        [1.0 if r is None else r for r in rep],
    )
    # (C-level tests, no generator per call: None counts as 0 for top-k, and is never == 1.0)
    return max(top_k, default=0) > 0, 1.0 in top_p, 1.0 in rep


def _sampled(parts: list[torch.Tensor], keep: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
    """prepare_sample's return from the five sampling parts (top-k, temperature, cfg scale, top-p,
    repetition penalty), as ``keep`` (from :func:`_fill_sample`) says."""
    top_k, temp, cfg, top_p, rep = parts
    k, p, r = keep
    return temp, cfg, top_k if k else None, top_p if p else None, rep if r else None


def _sampling(m: int) -> Segments:
    """The sampling arrays of ``m`` sequences: top-k (int32), then the four float32 ones."""
    return ((_I32, (m,)), *(((_F32, (m,)),) * 4))


class Prep:
    """stagebuf's state for one runner: the step stager, the sampling stager, the graph slots."""

    def __init__(self, runner: Any):
        cfg = runner.config
        self.block_size = int(runner.block_size)
        self.max_bs = int(cfg.max_num_seqs)
        max_tokens = int(cfg.max_num_batched_tokens)
        max_blocks = -(-int(cfg.max_model_len) // self.block_size)
        # one decode, or a prefill at the batched-token budget, fits a slot without growing (with the
        # sampling arrays; a prefill grows it once where its blocks' slots pass that budget by much)
        cap = 20 * max_tokens + 28 * (self.max_bs + 1) + 4 * self.max_bs * (max_blocks + 4) + 16 * 8
        # in place: every step stages, then returns; no reader is enqueued before its flush. On UVA, one copy
        # per step: an eager forward reads its inputs in every layer, through UVA a host read each time
        # (a Qwen3-0.6B prefill's forward measured 16% slower than from device memory on an H200)
        tier = reread_tier(capabilities())
        self.stager = StepStager(capacity=max(1 << (cap - 1).bit_length(), 1 << 16), in_place=True, tier=tier)
        self.device = self.stager.device
        # for a prepare_sample that does not follow its prepare_prefill or prepare_decode (see sample()):
        # its own ring, as a second step per engine step on the first would reuse a slot still read
        self.sampler = StepStager(
            capacity=max(1 << (20 * self.max_bs + 16).bit_length(), 1 << 12),
            device=self.device,
            in_place=True,
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
        self._layouts: dict[tuple[Any, ...], tuple[Segments, list[int], int]] = {}
        """A step's key -> its fixed part's segments, their offsets and the end (see _arrays)."""
        self._views: BoundedCache[Any, tuple[list[np.ndarray], list[torch.Tensor], Typed]] = BoundedCache(
            _MAX_CACHED
        )
        """(arena address, offset, layout) -> the fixed part's host and device views, and the arena as
        each dtype (see _arrays)."""
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

    def _arrays(
        self, st: Step, key: tuple[Any, ...], fixed: Callable[[], Segments], extra: int = 0
    ) -> tuple[list[np.ndarray], list[torch.Tensor], tuple[np.ndarray, int, Typed, int]]:
        """The arrays of one step reserved in step ``st``: their host views, to fill before the step
        ends, and their device tensors; ``fixed()``'s, the same for every step of ``key`` (the sizes that
        decide them), then ``extra`` bytes more, from ``start``: the third item is (the reserved host
        bytes, ``start``, the arena as each dtype with its storage offset, the arena's byte offset of
        the reservation). The fixed part's views are made once per (arena, offset, key) and kept: a
        decode of the batch size and table width of an earlier one in that slot makes no view (on a
        CUDA tensor, views cost more on the host than the numpy work of a step)."""
        lay = self._layouts.get(key)
        if lay is None:
            segs = fixed()
            offs, end = _offsets(segs)
            lay = self._layouts[key] = (segs, offs, (end + 7) & -8)
        segs, offs, start = lay
        hb, arena, off = st.reserve(start + extra)
        vkey = (arena.data_ptr(), off, key)
        hit = self._views.get(vkey)
        if hit is None or (hit[0] and hit[0][0].base is not hb.base):  # (a grown slot: new memory)
            typed = {dt: st.typed(dt) for dt in (_I64, _I32, _F32)}
            hs, ts = _views(hb, typed.__getitem__, off, segs, offs)
            offsets: Typed = {dt: (t, int(t.storage_offset())) for dt, t in typed.items()}
            # the four float32 sampling arrays (every layout ends with them) as one (4, m) host view
            o, m = offs[-4], segs[-1][1][0]
            hs[-4:] = [hb[o : o + 16 * m].view(np.float32).reshape(4, m)]
            hit = self._views.put(vkey, (hs, ts, offsets))
        return hit[0], hit[1], (hb, start, hit[2], off)

    def _keep(
        self, seqs: list[Any], cfg: bool | None, ts: list[torch.Tensor], keep: tuple[bool, ...]
    ) -> None:
        """The sampling tensors ``ts`` staged with this step kept for run()'s prepare_sample."""
        self.pending = None if cfg is None else (seqs, cfg, _sampled(ts, keep))
        self.graph_ids = None

    def prefill(self, seqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        B = self.block_size
        ids: list[int] = []
        lens: list[int] = []
        cached: list[int] = []
        q: list[int] = []  # the tokens computed, per sequence
        cu_q, cu_k = [0], [0]
        blocks: list[int] = []  # each sequence's blocks from its first uncached one on
        nslots: list[int] = []  # the slots written: every token of those blocks
        # per sequence: where its slots begin among those of `blocks`, less the slots before it
        starts: list[int] = []
        nq = nk = ns = 0
        for s in seqs:
            length, c = s.num_tokens, s.num_cached_tokens
            ids += s.token_ids[c:] if c else s.token_ids
            lens.append(length)
            cached.append(c)
            q.append(length - c)
            nq += length - c
            nk += length
            cu_q.append(nq)
            cu_k.append(nk)
            starts.append(len(blocks) * B - ns)
            k = 0
            if s.block_table:  # warmup's sequences have no blocks, and no slots
                first = c // B
                blocks += s.block_table[first : -(-length // B)]
                k = length - first * B
            nslots.append(k)
            ns += k
        n, nb = len(seqs), len(blocks)
        prefix = nk > nq  # prefix-cache hits: the attention reads the block tables
        tables = [s.block_table for s in seqs] if prefix else []
        w = max(map(len, tables)) if prefix else 0
        cfg, target = self._next_sample(seqs)
        m = len(target)
        ar = self._ar
        need = max(nq, ns, max(lens, default=0))
        if len(ar) < need:
            ar = self._ar = np.arange(2 * need, dtype=np.int64)
        nbt = n * w
        with self.stager.step() as st:
            # after the fixed part: ids and positions (int64), the block tables, then every slot of the
            # blocks written (int32: the slot mapping is their first ns, or a gather of them)
            hs, ts, (hb, start, typed, at) = self._arrays(
                st, ("prefill", n, m), lambda: ((_I32, (n + 1,)), (_I32, (n + 1,)), *_sampling(m)),
                16 * nq + 4 * (nbt + nb * B),
            )  # fmt: skip
            h64 = hb[start : start + 16 * nq].view(np.int64)
            h32 = hb[start + 16 * nq :].view(np.int32)
            h64[:nq] = np.fromiter(ids, np.int64, nq)
            h_pos = h64[nq:]
            if n == 1:
                h_pos[:] = ar[cached[0] : lens[0]]
            else:  # range(cached, length) per sequence: one arange less each sequence's offset
                np.add(ar[:nq], np.subtract(cached, cu_q[:-1]).repeat(q), out=h_pos)
            hs[0][:] = cu_q
            hs[1][:] = cu_k
            if ns:
                bl = np.array(blocks, np.int32)
                bl *= B
                full = h32[nbt : nbt + nb * B]
                np.add(bl[:, None], self._in_block, out=full.reshape(nb, B))
                if nb * B - ns != -nslots[-1] % B:  # a block short but the last one: gather around the gaps
                    full[:ns] = full.take(ar[:ns] + np.array(starts).repeat(nslots))
            if prefix:
                _padded_tables(tables, out=h32[:nbt].reshape(n, w))
            keep = (False,) * 3 if cfg is None else _fill_sample(target, hs[2:])
        self._keep(seqs, cfg, ts[2:], keep)
        # the step's own tensors: one as_strided each (the cheapest view of a CUDA tensor measured)
        (i64, o64), (i32, o32) = typed[_I64], typed[_I32]
        at += start
        o64 += at // 8
        o32 += at // 4 + 4 * nq
        self.set_context(
            True, ts[0], ts[1], max([0, *q]), max([0, *lens]), i32.as_strided((ns,), (1,), o32 + nbt), None,
            i32.as_strided((n, w), (w, 1), o32) if prefix else None,
        )  # fmt: skip
        return i64.as_strided((nq,), (1,), o64), i64.as_strided((nq,), (1,), o64 + nq)

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
        with self.stager.step() as st:
            hs, ts, _ = self._arrays(
                st, ("decode", n, w, m),
                lambda: (
                    (_I64, (n,)), (_I64, (n,)), (_I32, (n,)), (_I32, (n,)), (_I32, (n, w)), *_sampling(m)
                ),
            )  # fmt: skip
            hs[0][:] = ids
            hs[1][:] = pos
            hs[2][:] = slots
            hs[3][:] = ctx
            _padded_tables(tables, out=hs[4])
            keep = (False,) * 3 if cfg is None else _fill_sample(target, hs[5:])
        self._keep(seqs, cfg, ts[5:], keep)
        self.set_context(False, slot_mapping=ts[2], context_lens=ts[3], block_tables=ts[4])
        return ts[0], ts[1]

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
        with self.sampler.step() as st:
            m = len(target)
            hs, ts, _ = self._arrays(st, ("sample", m), lambda: _sampling(m))
            keep = _fill_sample(target, hs)
        return _sampled(ts, keep)

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
        cur, buf = self.ring.acquire()
        host = buf.np
        gv = self.gv
        off = 0
        with torch.inference_mode():  # nano-vllm captures its graphs in inference mode
            for name, a in zip(GRAPH_INPUTS, arrays):
                dst = gv[name][: a.shape[0]]
                end = off + a.nbytes
                if buf.dev is buf.cpu:  # the device is the host itself: numpy writes the inputs
                    dst.numpy()[...] = a
                else:
                    host[off:end] = a.reshape(-1).view(np.uint8)
                    src = buf.cpu[off:end].view(dst.dtype).view(dst.shape)
                    dst.copy_(src, non_blocking=True)
                    self.copies += 1
                off = (end + 15) & -16
        self.ring.publish(cur, None if buf.dev is buf.cpu else off)
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
