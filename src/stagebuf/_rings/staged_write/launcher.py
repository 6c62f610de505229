"""The launcher of a writer's applies: one packed transfer and one launch per apply (``_Launcher``):
``scatter`` (ATen ``index_copy_`` on the target's flat view), ``triton`` (``kernel.py``) or, on HOST,
one numpy assignment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from ..._bytes.buffers import StagingBuffer
from ..._bytes.make import make_buffer
from ..._common.cache import BoundedCache
from ..._common.convert import NUMPY_TO_TORCH
from ..._common.errors import UsageError
from ..._common.log import warn_once
from ..._common.tier import Tier
from ..._tiers.settings import ALIGN, Kernel, write_kernel
from ..ring import Ring
from .check import CheckedEdits
from .kernel import _block_for, _triton_error, launch_at, triton_usable

TRITON_MIN_ELEMS = 1 << 13
"""``auto`` writes one target with Triton from this many elements (two or more an edit on average) on."""
_INT64 = np.dtype(np.int64)
_PY_ROWS = 16
"""Up to this many edits, an apply's Triton rows are built in Python (numpy's per-call cost is more)."""
_ROWS_A_LAUNCH = 256
"""Triton rows of lone-element edits that cost the host about a launch: past ``_PY_ROWS``, fewer win."""
_CAPACITY = 1 << 14


def auto_kernel(parts: Sequence[CheckedEdits]) -> Literal["scatter", "triton"]:
    """The kernel ``auto`` runs for ``parts`` (no overlaps) on CUDA (docs/DESIGN.md, "Staged writes")."""
    if len(parts) == 1:
        n = parts[0].vals.shape[0]
        return "triton" if n >= TRITON_MIN_ELEMS and n >= 2 * parts[0].dst.shape[0] else "scatter"
    edits = elems = 0
    for p in parts:
        edits += p.dst.shape[0]
        elems += p.vals.shape[0]
    few = edits <= _PY_ROWS or edits + _ROWS_A_LAUNCH <= _ROWS_A_LAUNCH * (len(parts) - 1)
    return "triton" if elems >= 2 * edits or few else "scatter"


# --- the launcher: one packed transfer, one launch --------------------------------------


class _Launcher:
    """A writer's guarded ring of ``max_concurrency`` byte arenas of its tier. An apply writes its
    destinations (or the Triton kernel's per-edit rows) at offset 0 and the values after them straight
    into the slot's host memory (private: no scratch copy), publishes the used prefix and launches."""

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

    def apply(self, parts: Sequence[CheckedEdits]) -> Kernel:
        """Write the checked edits of ``parts`` (one packed slot, one launch); the kernel's name."""
        p0 = parts[0]
        one = len(parts) == 1
        if p0.target.tier is Tier.HOST:  # numpy writes straight into the targets
            for p in parts:
                dest, vals = p.dest()
                assert p.target.flat_np is not None  # set on every HOST-tier target
                p.target.flat_np[dest] = vals
            return "host"
        kernel = self.forced
        if p0.dup if one else any(p.dup for p in parts):
            kernel = "scatter"  # overlaps: de-duplicated on the host, then one scatter
        elif kernel == "auto":  # on CUDA (elsewhere the scatter: Triton's interpreter is never cheaper)
            kernel = auto_kernel(parts)
        if kernel == "triton" and self.triton is None:
            self.triton = triton_usable(self.device)
        if kernel == "triton" and not self.triton:
            if self.forced == "triton":
                warn_once(
                    ("staged-write-no-triton", str(self.device)),
                    f"staged writes on {self.device} use the scatter kernel: Triton cannot run "
                    f"here ({_why_no_triton(self.device)})",
                )
            kernel = "scatter"
        if kernel == "triton":
            head, vals, longest = _edit_meta(parts)
        elif one:
            head, vals = p0.dest()
        else:
            pairs = [p.dest() for p in parts]
            dests = [d for d, _ in pairs]
            head, vals = np.concatenate(dests), np.concatenate([x for _, x in pairs])
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
        copies = buf.tier.copies
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

            launch_at(self.device, base, base + off, dtype, n, _block_for(longest), tensors)
        elif one:
            p0.target.flat.index_copy_(0, d_dest, d_vals)
        else:
            a = 0
            for p, d in zip(parts, dests):
                b = a + d.shape[0]
                p.target.flat.index_copy_(0, d_dest[a:b], d_vals[a:b])
                a = b
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


def _edit_meta(parts: Sequence[CheckedEdits]) -> tuple[np.ndarray, np.ndarray, int]:
    """The Triton kernel's per-edit rows (target address, offset, length, source), values, longest edit."""
    if sum(p.dst.shape[0] for p in parts) <= _PY_ROWS:  # a few edits: rows in Python, one conversion
        rows: list[int] = []
        src = 0
        for p in parts:
            ptr = p.target.ptr
            for d, n in zip(p.dst.tolist(), p.lens.tolist()):
                rows += (ptr, d, n, src)
                src += n
        vals_ = parts[0].vals if len(parts) == 1 else np.concatenate([p.vals for p in parts])
        return np.array(rows, np.int64).reshape(-1, 4), vals_, max(rows[2::4])
    metas, vals, src, longest = [], [], 0, 1
    for p in parts:
        e = p.dst.shape[0]
        m = np.empty((e, 4), np.int64)
        m[:, 0] = p.target.ptr
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


def _why_no_triton(device: torch.device) -> str:
    """Why ``triton_usable(device)`` said no, and what would make it run."""
    if _triton_error:
        return _triton_error[0]
    if device.type == "cpu":
        return (
            "on the CPU only Triton's interpreter runs it: set TRITON_INTERPRET=1 before Python starts "
            "(slow: meant for tests), or unset STAGEBUF_WRITE_KERNEL"
        )
    return f"Triton has no backend for {device.type}; unset STAGEBUF_WRITE_KERNEL"
