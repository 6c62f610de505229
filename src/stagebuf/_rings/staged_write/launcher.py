"""A staged-write apply in three steps, named as vLLM's ``StagedWriteTensor`` reads them:

- **log** (:class:`EditLog`): what was staged on one target, in staging order (``staging.py`` checks a
  staging call's arguments before they enter it);
- **check** (:func:`check`): the log as one :class:`WriteBatch` (``indices``, ``starts``, ``cu_lens`` and
  the values, as vLLM's kernel reads them), or a ``StagedWriteError`` naming every bad edit;
- **launch** (:meth:`Launcher.launch`): the batches packed into the next slot of the writer's guarded ring,
  published (one copy, none on UVA), and one kernel: ``scatter`` (ATen ``index_copy_``), ``triton``
  (``kernel.py``) or, where the target is host memory the device reads as it is, one numpy assignment.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from ..._bytes.buffers import StagingBuffer
from ..._bytes.make import make_buffer
from ..._common.cache import BoundedCache
from ..._common.convert import NUMPY_TO_TORCH, numpy_dtype
from ..._common.errors import ArgumentTypeError, InvalidArgumentError, StagedWriteError, UsageError
from ..._common.log import warn_once
from ..._tiers.settings import ALIGN, Kernel, write_kernel
from ..ring import Ring
from .kernel import launch_at, triton_usable, why_no_triton
from .values import INT_RANGES, Bad, list_values

# --- log ---------------------------------------------------------------------------------------


class StagedBatch:
    """Edits staged by one ``stage_writes`` call (checked), or sealed list edits (values unchecked): each
    edit's flat offset in the target (``dst``: ``row * row_stride + start``, 8 bytes an edit) and length;
    the values, flat."""

    __slots__ = ("dst", "lens", "vals", "checked")

    def __init__(self, dst: Any, lens: Any, vals: Any, checked: bool):
        self.dst, self.lens, self.vals, self.checked = dst, lens, vals, checked


class EditLog:
    """The edits staged on one target of ``rows`` x ``cols`` values of ``dtype``, in staging order: list
    edits in ``dst`` (each edit's flat offset, ``index * row_stride + start``), ``lens`` and ``vals`` (a
    ``stage_write`` appends to them; values unchecked), arrays in ``batches`` (``staging.py`` checks what
    enters either)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        self.rows, self.cols, self.row_stride = rows, cols, cols
        self.dtype = dtype
        self.np_dtype = numpy_dtype(dtype)
        self.dst: list[int] = []
        self.lens: list[int] = []
        self.vals: list[Any] = []
        self.batches: list[StagedBatch] = []
        self.mark: np.ndarray | None = None
        """A per-row marker array the check's overlap test reuses (made at its first use)."""

    @property
    def count(self) -> int:
        """Edits staged and not yet applied (empty ones are not kept)."""
        return len(self.dst) + sum(len(b.dst) for b in self.batches)

    def stage_batch(self, dst: np.ndarray, lens: np.ndarray, vals: np.ndarray) -> None:
        """Stage checked array edits (int64 flat offsets and lengths, flat values: the caller's copies)."""
        if dst.shape[0]:
            self.seal()
            self.batches.append(StagedBatch(dst, lens, vals, True))

    def seal(self) -> None:
        """Move the list-staged edits into a batch, so later batches keep staging order."""
        if self.dst:
            self.batches.append(StagedBatch(self.dst[:], self.lens[:], self.vals[:], False))
            self.dst.clear()
            self.lens.clear()
            self.vals.clear()

    def clear(self) -> None:
        self.dst.clear()
        self.lens.clear()
        self.vals.clear()
        self.batches.clear()

    def all_batches(self) -> list[StagedBatch]:
        return [*self.batches, StagedBatch(self.dst, self.lens, self.vals, False)]

    def pending(self) -> list[tuple[int, int, list[Any]]]:
        """The staged edits, in staging order: ``(index, start, values)``."""
        out: list[tuple[int, int, list[Any]]] = []
        for b in self.all_batches():
            vals = b.vals.tolist() if isinstance(b.vals, np.ndarray) else b.vals
            a = 0
            for d, n in zip(b.dst, b.lens):
                out.append((*divmod(int(d), self.row_stride), list(vals[a : a + int(n)])))
                a += int(n)
        return out

    def discard(self, positions: Iterable[Any]) -> None:
        """Drop the staged edits at ``positions`` (staging order, as ``pending()`` lists them)."""
        n = self.count
        try:
            drop = {operator.index(p) for p in positions}
        except TypeError:
            raise ArgumentTypeError(
                f"positions must be an iterable of ints (staged edits' positions); got {positions!r}"
            ) from None
        wrong = sorted(p for p in drop if not 0 <= p < n)
        if wrong:
            allowed = f"ints in [0, {n - 1}]" if n else "none: nothing is staged"
            raise InvalidArgumentError(f"positions holds {wrong[0]}; allowed: {allowed} (the staged edits)")
        if not drop:
            return
        self.seal()
        kept: list[StagedBatch] = []
        pos = 0
        for b in self.batches:
            e = len(b.dst)
            keep = [i for i in range(e) if pos + i not in drop]
            pos += e
            if len(keep) == e:
                kept.append(b)
            elif keep and b.checked:
                mask = np.zeros(e, bool)
                mask[keep] = True
                kept.append(StagedBatch(b.dst[mask], b.lens[mask], b.vals[np.repeat(mask, b.lens)], True))
            elif keep:
                first = np.cumsum([0, *b.lens]).tolist()
                vals = [v for i in keep for v in b.vals[first[i] : first[i + 1]]]
                kept.append(StagedBatch([b.dst[i] for i in keep], [b.lens[i] for i in keep], vals, False))
        self.batches[:] = kept

    def lens_at(self, pos: int) -> int:
        """The length of the staged edit at ``pos``."""
        for b in self.all_batches():
            if pos < len(b.lens):
                return int(b.lens[pos])
            pos -= len(b.lens)
        return 0


UNIFORM: BoundedCache[tuple[int, int], tuple[np.ndarray, np.ndarray]] = BoundedCache(256)
"""(edits, width) -> ``uniform_lens``: what the check of edits all of one length reads, made once."""
SMALL = 1 << 12
"""Up to this many edits ``uniform_lens`` keeps arrays of their own (what the per-step paths read fastest)."""


def uniform_lens(e: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Lengths and ``cu_lens`` of ``e`` edits of ``width`` values (int64, read-only), cached in ``UNIFORM``
    up to ``SMALL`` edits; past that the lengths are a broadcast view (no memory per edit) and ``cu_lens`` is
    made per call."""
    got = UNIFORM.get((e, width))
    if got is not None:
        return got
    cu = np.arange(width, (e + 1) * width, width, dtype=np.int64)  # (width >= 1)
    cu.flags.writeable = False
    if e > SMALL:
        return np.broadcast_to(np.int64(width), (e,)), cu  # (read-only)
    lens = np.full(e, width, np.int64)
    lens.flags.writeable = False
    return UNIFORM.put((e, width), (lens, cu))


# --- check -------------------------------------------------------------------------------------


class WriteTarget:
    """What an apply writes: a target's flat device view, row stride and address, and its numpy view where
    numpy writes it (a CPU target whose staging buffers need no copy: the host memory is the device's)."""

    __slots__ = ("flat", "np", "ptr", "stride")

    def __init__(self, tensor: torch.Tensor, device: torch.device, stride: int, copies: bool):
        self.flat = tensor.view(-1)
        self.np = self.flat.numpy() if device.type == "cpu" and not copies else None
        self.ptr = tensor.data_ptr()
        self.stride = stride


class WriteBatch(NamedTuple):
    """One target's staged edits, checked: what vLLM's kernel reads, and what stagebuf adds.

    Edit ``k`` writes ``values[cu_lens[k] - lens[k] : cu_lens[k]]`` into row ``indices[k]`` from column
    ``starts[k]``, as vLLM's ``StagedWriteTensor`` kernel reads its ``indices``, ``starts`` and ``cu_lens``
    (all int64; ``cu_lens`` the running total of the lengths). Where vLLM's kernel computes each edit's
    flat offset ``indices * stride + starts``, stagebuf's log keeps it (``first``; ``indices`` and
    ``starts`` are read from it). Where two edits shared a row the check has resolved them (``overlaps``)
    into one-element edits, each element's last staged value: the edits of a batch write distinct elements.
    """

    target: WriteTarget
    first: np.ndarray
    """Each edit's flat offset in the target: ``indices * target.stride + starts``."""
    cu_lens: np.ndarray
    values: np.ndarray
    lens: np.ndarray
    """Each edit's length (``cu_lens`` differenced)."""
    width: int
    """The length of every edit where they are all one length (0: unknown or mixed)."""
    overlaps: bool
    """Two staged edits shared a row (resolved as above; the launch then runs the scatter)."""

    @property
    def indices(self) -> np.ndarray:
        """Each edit's row."""
        return self.first // self.target.stride

    @property
    def starts(self) -> np.ndarray:
        """Each edit's first column."""
        return self.first % self.target.stride


def check(log: EditLog, target: WriteTarget, tensor: Any) -> WriteBatch | None:
    """Every edit of ``log`` as one checked batch for ``target`` (None: nothing staged); raises
    StagedWriteError naming every bad edit (and ``tensor``, the log's), changing nothing."""
    bad: Bad = []
    dt = log.np_dtype
    if not log.batches:  # the common case: list edits only
        dl = log.dst
        if not dl:
            return None
        ll, vals = log.lens, log.vals
        e = len(dl)
        w = ll[0] if ll.count(ll[0]) == e else 0  # (one C-level pass; an array of lengths costs more)
        if w:
            got = UNIFORM.get((e, w))
            n, cu = got if got is not None else uniform_lens(e, w)
        else:
            n = np.array(ll, np.int64)
            cu = np.add.accumulate(n)  # (np.cumsum's Python wrapper costs a microsecond more)
        v = a = lohi = None
        if dt.kind in "iu":  # ints read exactly in one pass (floats, strings, past 64 bits: refused)
            try:
                a = np.frombuffer(array("q", vals), np.int64)
            except (TypeError, OverflowError):
                a = None
            if a is not None:  # every value fits, and no edit can be all bools: done
                lohi = lo, hi = (min(vals), max(vals)) if len(vals) <= 128 else (a.min(), a.max())
                r = INT_RANGES[dt]
                maybe_bools = lo <= 1 and hi >= 0 and (len(vals) > 256 or bool(BOOLS & set(map(type, vals))))
                if r[0] <= lo and hi <= r[1] and not maybe_bools:
                    v = a.astype(dt, copy=False)
        if v is None:  # the general reading, edit by edit where it must
            v = list_values(vals, dl, n, dt, bad, width=w, read=a, extremes=lohi)
            if bad:
                raise_bad(log, tensor, bad)
        if e <= 32:  # a few edits: the overlap test is cheaper in Python
            stride = log.row_stride
            dup = e > 1 and len(set(map(stride.__rfloordiv__, dl) if stride != 1 else dl)) != e
            batch = WriteBatch(target, np.array(dl, np.int64), cu, v, n, w, dup)
            return last_wins(batch) if dup else batch
        return with_overlaps(log, target, np.array(dl, np.int64), n, v, w, cu)
    if len(log.batches) == 1 and not log.dst and log.batches[0].checked and len(log.batches[0].dst) == 1:
        b = log.batches[0]  # one checked edit (a prompt's tokens): nothing to read, no overlap to find
        return WriteBatch(target, b.dst, b.lens, b.vals, b.lens, 0, False)
    batches = log.all_batches() if log.dst else [*log.batches]
    dsts, lens, vals_ = [], [], []
    pos = 0
    for b in batches:
        if b.checked:
            dsts.append(b.dst)
            lens.append(b.lens)
            vals_.append(b.vals)
        else:
            lens_b = np.array(b.lens, np.int64)
            vals_.append(list_values(b.vals, b.dst, lens_b, dt, bad, pos))
            dsts.append(np.array(b.dst, np.int64))
            lens.append(lens_b)
        pos += len(b.dst)
    if bad:
        raise_bad(log, tensor, bad)
    if len(batches) == 1:
        return with_overlaps(log, target, dsts[0], lens[0], vals_[0])
    return with_overlaps(log, target, np.concatenate(dsts), np.concatenate(lens), np.concatenate(vals_))


BOOLS = frozenset({bool, np.bool_})
"""The types of values that make a list edit all bools (refused), though numpy reads them as ints."""


def raise_bad(log: EditLog, tensor: Any, bad: Bad) -> None:
    """Raise the StagedWriteError of ``bad`` (a check's bad edits, at least one) on ``tensor``."""
    pos, flat, why = bad[0]
    row, start = divmod(flat, log.row_stride)
    more = f"; {len(bad) - 1} more bad edit(s), at positions {[b[0] for b in bad[1:9]]}" if bad[1:] else ""
    n = log.lens_at(pos)
    what = (
        f"staged edit {pos} (stage_write(index={row}, start={start}, {n} values)) cannot be applied "
        f"to {log.dtype}: {why}{more}"
    )
    err = StagedWriteError(
        f"{what}. Nothing was written and every staged edit is still staged: "
        "discard_staged(err.edits) drops the bad ones, clear_staged_writes() all",
        pos,
        row,
        start,
        edits=tuple(b[0] for b in bad),
        tensor=tensor,
    )
    err._what = what  # (what a fused apply's error quotes, per tensor)
    raise err


def with_overlaps(
    log: EditLog,
    target: WriteTarget,
    d: np.ndarray,
    n: np.ndarray,
    v: np.ndarray,
    width: int = 0,
    cu: np.ndarray | None = None,
) -> WriteBatch:
    """The gathered edits (flat offsets ``d``, lengths ``n``, values ``v``; ``cu``: their ``cu_lens`` if
    known) as a batch, its overlaps resolved (``last_wins``) where two share a row; ``width`` as for
    ``WriteBatch``."""
    e = d.shape[0]
    dup = False
    if e > 1:  # two edits on one row may overlap: then each element's last staged value wins
        mark = log.mark
        if mark is None:
            mark = log.mark = np.empty(log.rows, np.int64)
        r = d // log.row_stride if log.row_stride != 1 else d
        ar = np.arange(e, dtype=np.int64)
        mark[r] = ar
        dup = bool((mark[r] != ar).any())  # exact whichever duplicate numpy wrote last
    if cu is None:
        cu = n if e == 1 else np.add.accumulate(n)  # (one edit's running total is its length)
    batch = WriteBatch(target, d, cu, v, n, width, dup)
    return last_wins(batch) if dup else batch


def last_wins(b: WriteBatch) -> WriteBatch:
    """``b`` as one-element edits of distinct elements, each its last staged value (staging order)."""
    total = b.values.shape[0]
    dest = np.repeat(b.first - (b.cu_lens - b.lens), b.lens) + np.arange(total, dtype=np.int64)
    _, last = np.unique(dest[::-1], return_index=True)  # each element's last staged value
    keep = (total - 1) - last
    ones, cu = uniform_lens(keep.shape[0], 1)
    return WriteBatch(b.target, dest[keep], cu, b.values[keep], ones, 1, True)


# --- launch ------------------------------------------------------------------------------------

TRITON_MIN_ELEMS = 1 << 13
"""``auto`` writes one target with Triton from this many elements (two or more an edit on average) on."""
PY_ROWS = 16
"""Up to this many edits, an apply's Triton rows are built in Python (numpy's per-call cost is more)."""
ROWS_A_LAUNCH = 256
"""Triton rows of lone-element edits that cost the host about a launch: past ``PY_ROWS``, fewer win."""
CAPACITY = 1 << 14
"""A ``StagedWriteTensor``'s first slot size in bytes."""
_INT64 = np.dtype(np.int64)


def auto_kernel(batches: Sequence[WriteBatch]) -> Literal["scatter", "triton"]:
    """The kernel ``auto`` runs for ``batches`` on CUDA (docs/DESIGN.md, "Staged writes")."""
    if len(batches) == 1:
        n = batches[0].values.shape[0]
        return "triton" if n >= TRITON_MIN_ELEMS and n >= 2 * batches[0].first.shape[0] else "scatter"
    edits = elems = 0
    for b in batches:
        edits += b.first.shape[0]
        elems += b.values.shape[0]
    few = edits <= PY_ROWS or edits + ROWS_A_LAUNCH <= ROWS_A_LAUNCH * (len(batches) - 1)
    return "triton" if elems >= 2 * edits or few else "scatter"


class Launcher:
    """The launch step of a writer: a guarded ring of ``max_concurrency`` byte arenas of the device's tier.

    :meth:`launch` writes the flat destinations (or the Triton kernel's per-edit rows) at offset 0 of the
    next slot and the values after them, straight into its host memory (private: no scratch copy), publishes
    the used prefix and runs the kernel. A writer makes its launcher from its class's ``launcher_class``:
    a subclass that overrides :meth:`launch` (and :meth:`stats`) takes every apply's checked batches instead
    (vLLM's step mode defers them into its step).
    """

    def __init__(self, device: torch.device, max_concurrency: int, capacity: int):
        self.device = device
        self.n = max_concurrency
        self.capacity = max(capacity, ALIGN)
        self.ring: Ring | None = None  # made at the first apply: a tensor never applied allocates no slots
        self.views: list[BoundedCache[Any, Any]] = []  # the ring's per-slot view caches (emptied at growth)
        self.forced = "scatter" if (k := write_kernel()) == "auto" and device.type != "cuda" else k
        self.triton: bool | None = None  # whether Triton runs here, asked at the first apply that wants it

    def stats(self) -> dict[str, int]:
        ring = self.ring
        if ring is None:
            return {"transfers": 0, "bytes": 0, "growths": 0, "guard_waits": 0, "steps": 0}
        return ring.stats(steps=True)

    def launch(self, batches: Sequence[WriteBatch]) -> Kernel:
        """Write ``batches`` (one packed slot, one launch; their targets' numpy views where they have them);
        the kernel's name."""
        b0 = batches[0]
        one = len(batches) == 1
        kernel = "host" if b0.target.np is not None else self.forced
        if kernel != "host" and (b0.overlaps if one else any(b.overlaps for b in batches)):
            kernel = "scatter"  # overlaps, resolved by the check: one scatter, as before they were
        elif kernel == "auto":  # on CUDA (elsewhere the scatter: Triton's interpreter is never cheaper)
            kernel = auto_kernel(batches)
        if kernel == "triton" and self.triton is None:
            self.triton = triton_usable(self.device)
        if kernel == "triton" and not self.triton:
            if self.forced == "triton":
                warn_once(
                    ("staged-write-no-triton", str(self.device)),
                    f"staged writes on {self.device} use the scatter kernel: Triton cannot run "
                    f"here ({why_no_triton(self.device)})",
                )
            kernel = "scatter"
        if kernel == "triton":
            head, vals, longest = edit_meta(batches)
        else:  # each element's flat destination: row * stride + start, then the columns of its edit
            dests = []
            for b in batches:
                first = b.first
                total = b.values.shape[0]
                if total == first.shape[0]:  # one element per edit
                    dests.append(first)
                elif b.width:  # every edit of one length: one broadcast add
                    dests.append((first[:, None] + np.arange(b.width, dtype=np.int64)).reshape(-1))
                else:  # each edit's first offset, less the elements before it, repeated; plus the index
                    lens = b.lens
                    dests.append(
                        np.repeat(first - (b.cu_lens - lens), lens) + np.arange(total, dtype=np.int64)
                    )
            if kernel == "host":  # numpy writes straight into the targets' host memory
                for b, d in zip(batches, dests):
                    b.target.np[d] = b.values  # type: ignore[index]
                return "host"
            head = dests[0] if one else np.concatenate(dests)
            vals = b0.values if one else np.concatenate([b.values for b in batches])
        # pack: the head (int64) at offset 0, the values after it, in the next slot's host memory
        off = (head.nbytes + ALIGN - 1) & -ALIGN
        used = off + vals.nbytes
        ring = self.ring or self._make_ring()
        cur, buf = ring.acquire()
        if used > buf.shape[0]:
            buf = self._grow(ring, cur, used)
        if kernel == "triton":
            host = buf.np
            host[: head.nbytes].view(np.int64)[:] = head.reshape(-1)
            host[off:used].view(vals.dtype)[:] = vals
        else:
            key = (head.shape[0], vals.dtype, vals.shape[0])
            views = self.views[cur]
            v = views.get(key)
            if v is None:
                v = _views_for(ring, cur, views, key, off, used)
            h_dest, h_vals, d_dest, d_vals = v
            h_dest[...] = head
            h_vals[...] = vals
        copies = buf.copies
        if copies:
            buf.uva(used)
        # its one reader, the launch below, is enqueued before any event can be recorded: marked
        ring.publish(cur, used if copies else None, marked=True)
        if kernel == "triton":
            dev = buf.dev
            base = dev.data_ptr()
            n, dtype = head.shape[0], NUMPY_TO_TORCH[vals.dtype]

            def tensors() -> tuple[torch.Tensor, torch.Tensor]:
                return dev[: head.nbytes].view(torch.int64), dev[off:used].view(dtype)

            launch_at(self.device, base, base + off, dtype, n, longest, tensors)
        elif one:
            b0.target.flat.index_copy_(0, d_dest, d_vals)
        else:
            a = 0
            for b, d in zip(batches, dests):
                e = a + d.shape[0]
                b.target.flat.index_copy_(0, d_dest[a:e], d_vals[a:e])
                a = e
        return kernel

    def _make_ring(self) -> Ring:
        self.ring = ring = Ring(
            self.n, lambda: make_buffer(self.capacity, torch.uint8, self.device), "auto", "staged-write slot"
        )
        self.views = [ring.views(i) for i in range(ring.slots)]
        return ring

    def _grow(self, ring: Ring, cur: int, used: int) -> StagingBuffer:
        """Slot ``cur``'s buffer, replaced by one of at least ``used`` bytes (not while capturing)."""
        if ring.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise UsageError(
                "staged writes: a slot must grow while a CUDA graph is being captured; "
                "apply once with the largest batch before capturing"
            )
        cap = 1 << max(used - 1, 1).bit_length()
        return ring.grow(cur, lambda tier: make_buffer(cap, torch.uint8, self.device, tier))


def _views_for(ring: Ring, cur: int, views: BoundedCache[Any, Any], key: Any, off: int, used: int) -> Any:
    """Host and device views of slot ``cur`` for a scatter of ``key``'s layout, cached in ``views`` (the
    slot's cache, which the ring empties when the slot grows)."""
    (e, dtype, n), host = key, ring.buf(cur).np
    first = off // dtype.itemsize
    return views.put(
        key,
        (
            host[: 8 * e].view(np.int64),
            host[off:used].view(dtype),
            ring.typed(cur, _INT64)[:e],
            ring.typed(cur, dtype)[first : first + n],
        ),
    )


def edit_meta(batches: Sequence[WriteBatch]) -> tuple[np.ndarray, np.ndarray, int]:
    """The Triton kernel's per-edit rows (target address, flat offset of the first element, length, source
    offset), the values, and the longest edit."""
    one = len(batches) == 1
    if (batches[0].first.shape[0] if one else sum(b.first.shape[0] for b in batches)) <= PY_ROWS:
        # a few edits: rows in Python, one conversion
        rows: list[int] = []
        src = 0
        for b in batches:  # (a batch's values are its edits' in order: each source offset is a running sum)
            ptr = b.target.ptr
            for d, n in zip(b.first.tolist(), b.lens.tolist()):
                rows += (ptr, d, n, src)
                src += n
        vals = batches[0].values if one else np.concatenate([b.values for b in batches])
        return np.array(rows, np.int64).reshape(-1, 4), vals, max(rows[2::4])
    metas, values, src, longest = [], [], 0, 1
    for b in batches:
        e = b.first.shape[0]
        m = np.empty((e, 4), np.int64)
        m[:, 0] = b.target.ptr
        m[:, 1] = b.first
        m[:, 2] = b.lens
        np.subtract(b.cu_lens, b.lens, out=m[:, 3])
        m[:, 3] += src
        src += b.values.shape[0]
        longest = max(longest, int(b.lens.max()))
        metas.append(m)
        values.append(b.values)
    if one:
        return metas[0], values[0], longest
    return np.concatenate(metas), np.concatenate(values), longest
