"""Host planning of an apply: gather and check the staged edits, pack them into a slot, launch.

``_Launcher`` owns a writer's guarded ring of byte arenas; an apply packs the
destinations (or per-edit metadata) and the values into the next slot, publishes
it with one copy on the copy tiers (none on UVA), and runs one kernel: ``scatter``
(ATen ``index_copy_`` on the target's flat view), ``triton`` (``kernel.py``) or, on
HOST, one numpy assignment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._buffers import StagingBuffer, make_buffer
from .._constants import ALIGN, WRITE_KERNELS, write_kernel
from .._convert import _NUMPY_TO_TORCH, host_array
from .._errors import ArgumentTypeError, InvalidArgumentError, UsageError
from .._guard import SlotRing, empty_stats
from .._log import warn_once
from .._tier import Tier
from .kernel import _block_for, _launch_triton, _triton_error, triton_usable

if TYPE_CHECKING:
    from .api import StagedWriteTensor

KERNELS = WRITE_KERNELS
TRITON_MIN_ELEMS = 1 << 13
"""``auto`` uses the Triton kernel from this many staged elements on (measured: docs/DESIGN.md)."""
SCATTER_MAX_PARTS = 4
"""``auto`` writes up to this many targets with one ``index_copy_`` each (one packed transfer), more
with one Triton launch: on the H200 one Triton launch costs several ATen launches (docs/DESIGN.md)."""
_CAPACITY = 1 << 14
_GUARD_MODE = "auto"
"""The staging slots' guard (tests force ``wait`` to exercise it on the CPU tiers)."""


class _Batch:
    """Edits staged by one ``stage_writes`` call (checked), or sealed list edits (values unchecked).

    ``dst`` is each edit's flat offset in the target (``row * row_stride + start``).
    """

    __slots__ = ("dst", "lens", "vals", "checked")

    def __init__(self, dst: Any, lens: Any, vals: Any, checked: bool):
        self.dst, self.lens, self.vals, self.checked = dst, lens, vals, checked


class _Gathered:
    """One target's staged edits as arrays: first-element offsets, lengths, values."""

    __slots__ = ("target", "dst", "lens", "vals", "dup", "width")

    def __init__(
        self,
        target: StagedWriteTensor,
        dst: np.ndarray,
        lens: np.ndarray,
        vals: np.ndarray,
        dup: bool,
        width: int = 0,
    ):
        self.target, self.dst, self.lens, self.vals, self.dup = target, dst, lens, vals, dup
        self.width = width
        """The length of every edit where they are all one length (0: unknown or mixed)."""

    def dest(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat destination of every element, and the values, de-duplicated (later wins) if needed."""
        first = self.dst
        n = self.vals.shape[0]
        if n == first.shape[0]:  # one element per edit
            dest = first
        elif self.width:  # every edit of one length: one broadcast add
            dest = (first[:, None] + _arange(self.width)).reshape(-1)
        else:
            lens = self.lens
            dest = np.repeat(first - (np.cumsum(lens) - lens), lens) + np.arange(n, dtype=np.int64)
        vals = self.vals
        if self.dup:
            rev = dest[::-1]
            _, last = np.unique(rev, return_index=True)  # each destination's last staged element
            keep = (n - 1) - last
            dest, vals = dest[keep], vals[keep]
        return dest, vals


_ARANGE = np.arange(1024, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64) from a cached array where it is long enough (read-only use)."""
    return _ARANGE[:n] if n <= _ARANGE.shape[0] else np.arange(n, dtype=np.int64)


def _ints(x: Any, name: str) -> np.ndarray:
    """A 1-D int64 array of the integers in ``x`` (bools and fractions are refused)."""
    a = x if isinstance(x, np.ndarray) else host_array(x, None, name, ndims=(1,))
    if a.ndim != 1:
        raise InvalidArgumentError(
            f"{name} has rank {a.ndim} (shape {a.shape}); allowed: a 1-D array of ints"
        )
    if a.dtype.kind not in "iu":
        if a.dtype.kind == "f" and a.size and np.isfinite(a).all() and (a == np.trunc(a)).all():
            pass  # integral floats are accepted, as elsewhere in stagebuf
        elif a.size:
            raise ArgumentTypeError(f"{name} has dtype {a.dtype}; allowed: an integer array")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{name} holds values beyond int64")
    return a.astype(np.int64, copy=False)


# --- the launcher: one packed transfer, one launch --------------------------------------


class _Launcher:
    """The staging slots behind one writer: one packed transfer and one launch per apply.

    A ring of ``max_concurrency`` byte arenas of the writer's tier (guarded like
    every ring: see :mod:`stagebuf._guard`). An apply writes its index (or per-edit
    metadata) array at offset 0 and the values after it, directly in the slot's
    host memory (private to the writer, so no scratch copy is needed), publishes
    the used prefix with one copy on the copy tiers (none on UVA) and launches.
    Device views of each layout are cached per slot.
    """

    def __init__(self, device: torch.device, max_concurrency: int, capacity: int):
        self.device = device
        self.n = max_concurrency
        self.capacity = max(capacity, ALIGN)
        self.bufs: list[StagingBuffer] = []
        self.views: list[
            dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor, int]]
        ] = []
        self.bases: list[dict[Any, torch.Tensor]] = []
        """Per slot: its whole device arena viewed as each dtype (views are slices of these)."""
        self.retired: list[list[StagingBuffer]] = []
        self.ring: SlotRing | None = None
        self.stats_ = {**empty_stats(), "steps": 0}
        self.forced = write_kernel()

    def stats(self) -> dict[str, int]:
        ring = self.ring
        return {
            **self.stats_,
            "guard_waits": ring.waits if ring is not None else 0,
            "steps": ring.seq if ring is not None else 0,
        }

    def _start(self) -> SlotRing:
        self.bufs = [make_buffer(self.capacity, torch.uint8, self.device) for _ in range(self.n)]
        self.views = [{} for _ in range(self.n)]
        self.bases = [{} for _ in range(self.n)]
        self.retired = [[] for _ in range(self.n)]
        tier = max(b.tier for b in self.bufs)
        self.ring = SlotRing(self.n, self.device, _GUARD_MODE, tier, "staged-write slot")
        return self.ring

    def _slot(
        self, cur: int, idx: np.ndarray, vals: np.ndarray
    ) -> tuple[StagingBuffer, tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor, int]]:
        """Slot ``cur``'s buffer and its views for this layout (made, and the slot grown, if needed)."""
        buf = self.bufs[cur]
        key = (idx.shape, vals.dtype, vals.shape[0])
        v = self.views[cur].get(key)
        if v is not None:
            return buf, v
        a_bytes = idx.nbytes
        off = (a_bytes + ALIGN - 1) & -ALIGN
        used = off + vals.nbytes
        if used > buf.shape[0]:
            if buf.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise UsageError(
                    "staged writes: a slot must grow while a CUDA graph is being captured; "
                    "apply once with the largest batch before capturing"
                )
            cap = 1 << max(used - 1, 1).bit_length()
            self.retired[cur].append(buf)  # read by this slot's last launch, until it comes round
            buf = self.bufs[cur] = make_buffer(cap, torch.uint8, self.device, buf.tier)
            self.views[cur].clear()
            self.bases[cur].clear()
            self.stats_["growths"] += 1
        elif len(self.views[cur]) >= 1024:
            self.views[cur].clear()
        # one slice per view, from whole-arena views of each dtype (a layout seen before is a lookup)
        bases = self.bases[cur]
        i64 = bases.get(np.int64)
        if i64 is None:
            i64 = bases[np.int64] = buf.dev.view(torch.int64)
        vt = bases.get(vals.dtype)
        if vt is None:
            vt = bases[vals.dtype] = buf.dev.view(_NUMPY_TO_TORCH[vals.dtype])
        n_idx = idx.size
        d_idx = i64[:n_idx] if idx.ndim == 1 else i64[:n_idx].view(idx.shape)
        first = off // vals.dtype.itemsize
        d_val = vt[first : first + vals.shape[0]]
        h_idx = buf.np[:a_bytes].view(np.int64).reshape(idx.shape)
        h_val = buf.np[off:used].view(vals.dtype)
        v = self.views[cur][key] = (h_idx, h_val, d_idx, d_val, used)
        return buf, v

    def _pack(self, idx: np.ndarray, vals: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``idx`` and ``vals`` into the next slot and publish them; their device views."""
        ring = self.ring if self.ring is not None else self._start()
        cur = ring.next()
        self.retired[cur].clear()  # the guard says this slot's last launch is done
        buf, (h_idx, h_val, d_idx, d_val, used) = self._slot(cur, idx, vals)
        h_idx[...] = idx
        h_val[...] = vals
        ring.take(cur)
        if buf.tier.copies:
            buf.uva(used)
            self.stats_["transfers"] += 1
            self.stats_["bytes"] += used
        return d_idx, d_val

    def kernel_for(self, parts: Sequence[_Gathered], n_elems: int) -> str:
        if parts[0].target.tier is Tier.HOST:
            return "host"
        if parts[0].dup if len(parts) == 1 else any(p.dup for p in parts):
            return "scatter"  # overlaps: de-duplicated on the host, then one scatter
        want = self.forced
        if want == "auto":
            want = "triton" if n_elems >= TRITON_MIN_ELEMS or len(parts) > SCATTER_MAX_PARTS else "scatter"
        if want == "triton" and not triton_usable(self.device):
            if self.forced == "triton":
                warn_once(
                    ("staged-write-no-triton", str(self.device)),
                    f"staged writes on {self.device} use the scatter kernel: Triton cannot run "
                    f"here ({_triton_error[0] if _triton_error else 'not on this device'})",
                )
            return "scatter"
        return want

    def apply(self, parts: Sequence[_Gathered]) -> str:
        """Write the gathered edits of ``parts``; the kernel's name."""
        n_elems = parts[0].vals.shape[0] if len(parts) == 1 else sum(p.vals.shape[0] for p in parts)
        kernel = self.kernel_for(parts, n_elems)
        if kernel == "host":
            for p in parts:
                dest, vals = p.dest()
                flat = p.target._flat_np
                assert flat is not None  # set on every HOST-tier target; all parts share one device
                flat[dest] = vals
            return kernel
        if kernel == "scatter":
            pieces = [p.dest() for p in parts]
            if len(pieces) == 1:
                dest, vals = pieces[0]
            else:
                dest = np.concatenate([d for d, _ in pieces])
                vals = np.concatenate([v for _, v in pieces])
            d_dest, d_vals = self._pack(dest, vals)
            if len(parts) == 1:
                parts[0].target._flat.index_copy_(0, d_dest, d_vals)
            else:
                a = 0
                for p, (d, _) in zip(parts, pieces):
                    b = a + d.shape[0]
                    p.target._flat.index_copy_(0, d_dest[a:b], d_vals[a:b])
                    a = b
        else:
            meta, vals, longest = _edit_meta(parts)
            d_meta, d_vals = self._pack(meta, vals)
            _launch_triton(self.device, d_meta, d_vals, meta.shape[0], _block_for(longest))
        assert self.ring is not None
        self.ring.mark()
        return kernel


def _edit_meta(parts: Sequence[_Gathered]) -> tuple[np.ndarray, np.ndarray, int]:
    """The Triton kernel's per-edit rows (target address, offset, length, source), values, longest edit."""
    metas, vals = [], []
    src = 0
    longest = 1
    for p in parts:
        e = p.dst.shape[0]
        m = np.empty((e, 4), np.int64)
        m[:, 0] = p.target.gpu.data_ptr()
        m[:, 1] = p.dst
        m[:, 2] = p.lens
        np.cumsum(p.lens, out=m[:, 3])
        m[:, 3] += src - p.lens
        src += p.vals.shape[0]
        longest = max(longest, int(p.lens.max()))
        metas.append(m)
        vals.append(p.vals)
    if len(parts) == 1:
        return metas[0], vals[0], longest
    return np.concatenate(metas), np.concatenate(vals), longest
