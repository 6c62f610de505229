"""The launcher of a writer's applies: one packed transfer and one launch per apply.

``_Launcher`` owns a writer's guarded ring of byte arenas. An apply packs the
destinations (or per-edit metadata) and the values of the gathered batches
(``check.CheckedEdits``) into the next slot, publishes it with one copy on the copy
tiers (none on UVA), and runs one kernel: ``scatter`` (ATen ``index_copy_`` on the
target's flat view), ``triton`` (``kernel.py``) or, on HOST, one numpy assignment.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..._bytes.buffers import StagingBuffer
from ..._bytes.make import make_buffer
from ..._common.convert import NUMPY_TO_TORCH
from ..._common.errors import UsageError
from ..._common.log import warn_once
from ..._common.tier import Tier
from ..._tiers.settings import ALIGN, Kernel, write_kernel
from ..ring import MAX_VIEWS, Ring
from .check import CheckedEdits
from .kernel import _block_for, _triton_error, launch_at, triton_usable

TRITON_MIN_ELEMS = 1 << 13
"""``auto`` uses the Triton kernel from this many staged elements on (measured: docs/DESIGN.md)."""
SCATTER_MAX_PARTS = 4
"""``auto`` writes up to this many targets with one ``index_copy_`` each (one packed transfer), more
with one Triton launch (docs/DESIGN.md)."""
_INT64 = np.dtype(np.int64)
_PY_ROWS = 16
"""Up to this many edits, an apply's Triton rows are built in Python (numpy's per-call cost is more)."""
_CAPACITY = 1 << 14


# --- the launcher: one packed transfer, one launch --------------------------------------


class _Launcher:
    """The staging slots behind one writer: one packed transfer and one launch per apply.

    A ring of ``max_concurrency`` byte arenas of the writer's tier (guarded like
    every ring: see :mod:`stagebuf._rings.guard`). An apply writes its index (or per-edit
    metadata) array at offset 0 and the values after it, directly in the slot's
    host memory (private to the writer, so no scratch copy is needed), publishes
    the used prefix with one copy on the copy tiers (none on UVA) and launches.
    Device views of each layout are cached per slot.
    """

    def __init__(self, device: torch.device, max_concurrency: int, capacity: int):
        self.device = device
        self.n = max_concurrency
        self.capacity = max(capacity, ALIGN)
        self.ring: Ring | None = None
        """Made at the first apply (a tensor that is never applied allocates no slots)."""
        self.forced = write_kernel()

    def stats(self) -> dict[str, int]:
        ring = self.ring
        if ring is None:
            return {"transfers": 0, "bytes": 0, "growths": 0, "guard_waits": 0, "steps": 0}
        return ring.stats(steps=True)

    def _acquire(self, used: int) -> tuple[Ring, int, StagingBuffer]:
        """The ring (made at the first apply), its next slot and that slot's buffer, grown to hold
        ``used`` bytes if it is smaller."""
        ring = self.ring
        if ring is None:
            ring = self.ring = Ring(
                self.n, lambda: make_buffer(self.capacity, torch.uint8, self.device), "auto",
                "staged-write slot",
            )  # fmt: skip
        cur, buf = ring.acquire()
        if used <= buf.shape[0]:
            return ring, cur, buf
        if buf.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise UsageError(
                "staged writes: a slot must grow while a CUDA graph is being captured; "
                "apply once with the largest batch before capturing"
            )
        cap = 1 << max(used - 1, 1).bit_length()
        return ring, cur, ring.grow(cur, lambda tier: make_buffer(cap, torch.uint8, self.device, tier))

    def _pack(self, idx: np.ndarray, vals: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``idx`` and ``vals`` into the next slot and publish them; their device views
        (cached per slot and layout)."""
        off = (idx.nbytes + ALIGN - 1) & -ALIGN
        used = off + vals.nbytes
        ring, cur, buf = self._acquire(used)
        views = ring.views(cur)
        key = (idx.shape, vals.dtype, vals.shape[0])
        v = views.get(key)
        if v is None:
            if len(views) >= MAX_VIEWS:
                views.clear()
            # one slice per view, from whole-arena views of each dtype
            d_idx = ring.typed(cur, _INT64)[: idx.size]
            if idx.ndim != 1:
                d_idx = d_idx.view(idx.shape)
            first = off // vals.dtype.itemsize
            d_val = ring.typed(cur, vals.dtype)[first : first + vals.shape[0]]
            h_idx = buf.np[: idx.nbytes].view(np.int64).reshape(idx.shape)
            v = views[key] = (h_idx, buf.np[off:used].view(vals.dtype), d_idx, d_val)
        h_idx, h_val, d_idx, d_val = v
        h_idx[...] = idx
        h_val[...] = vals
        self._publish(ring, cur, buf, used)
        return d_idx, d_val

    @staticmethod
    def _publish(ring: Ring, cur: int, buf: StagingBuffer, used: int) -> None:
        """Publish the slot's first ``used`` bytes (one copy on the copy tiers). Its one reader, the
        caller's launch, is enqueued next, before any event can be recorded: the use is marked."""
        copies = buf.tier.copies
        if copies:
            buf.uva(used)
        ring.publish(cur, used if copies else None, marked=True)

    def _launch_packed(self, meta: np.ndarray, vals: np.ndarray, block: int) -> None:
        """Write the Triton rows and values into the next slot, publish them, launch at their addresses."""
        off = (meta.nbytes + ALIGN - 1) & -ALIGN
        used = off + vals.nbytes
        ring, cur, buf = self._acquire(used)
        host = buf.np
        host[: meta.nbytes].view(np.int64)[:] = meta.reshape(-1)
        host[off:used].view(vals.dtype)[:] = vals
        self._publish(ring, cur, buf, used)
        dev = buf.dev
        base = dev.data_ptr()
        n, dtype = meta.shape[0], NUMPY_TO_TORCH[vals.dtype]

        def tensors() -> tuple[torch.Tensor, torch.Tensor]:
            return dev[: meta.nbytes].view(torch.int64), dev[off:used].view(dtype)

        launch_at(self.device, base, base + off, dtype, n, block, tensors)

    def kernel_for(self, parts: Sequence[CheckedEdits], n_elems: int) -> Kernel:
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

    def apply(self, parts: Sequence[CheckedEdits]) -> Kernel:
        """Write the gathered edits of ``parts``; the kernel's name."""
        n_elems = parts[0].vals.shape[0] if len(parts) == 1 else sum(p.vals.shape[0] for p in parts)
        kernel = self.kernel_for(parts, n_elems)
        if kernel == "host":
            for p in parts:
                dest, vals = p.dest()
                flat = p.target.flat_np
                assert flat is not None  # set on every HOST-tier target; all parts share one device
                flat[dest] = vals
            return kernel
        if kernel == "triton":
            meta, vals, longest = _edit_meta(parts)
            self._launch_packed(meta, vals, _block_for(longest))
        elif len(parts) == 1:
            parts[0].target.flat.index_copy_(0, *self._pack(*parts[0].dest()))
        else:
            pieces = [p.dest() for p in parts]
            d_dest, d_vals = self._pack(
                np.concatenate([d for d, _ in pieces]), np.concatenate([v for _, v in pieces])
            )
            a = 0
            for p, (d, _) in zip(parts, pieces):
                b = a + d.shape[0]
                p.target.flat.index_copy_(0, d_dest[a:b], d_vals[a:b])
                a = b
        return kernel


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
    metas, vals = [], []
    src = 0
    longest = 1
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
