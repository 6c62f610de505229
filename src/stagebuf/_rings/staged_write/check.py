"""The check: a target's edit log as one batch of checked arrays (``CheckedEdits``, for the launch), or a
``StagedWriteError`` naming every bad list edit (then nothing changes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..._common.errors import StagedWriteError
from ..._common.tier import Tier
from .log import FULL_LENS, EditLog, full_lens
from .values import Bad, list_values


class WriteTarget:
    """What an apply writes: a target's flat device view, its numpy view on HOST, address, tier."""

    __slots__ = ("flat", "flat_np", "ptr", "tier")

    def __init__(self, tensor: torch.Tensor, tier: Tier):
        self.flat = tensor.view(-1)
        self.flat_np = self.flat.numpy() if tier is Tier.HOST else None
        self.ptr = tensor.data_ptr()
        self.tier = tier


class CheckedEdits:
    """One target's staged edits as checked arrays: first-element offsets, lengths, values."""

    __slots__ = ("target", "dst", "lens", "vals", "dup", "width")

    def __init__(
        self,
        target: WriteTarget,
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
            dest = (first[:, None] + np.arange(self.width, dtype=np.int64)).reshape(-1)
        else:  # runs: each edit's first offset, less the elements before it, repeated; plus the index
            lens = self.lens
            dest = np.repeat(first - (np.cumsum(lens) - lens), lens) + np.arange(n, dtype=np.int64)
        vals = self.vals
        if self.dup:
            _, last = np.unique(dest[::-1], return_index=True)  # each destination's last staged element
            keep = (n - 1) - last
            dest, vals = dest[keep], vals[keep]
        return dest, vals


def check(log: EditLog, target: WriteTarget, tensor: Any) -> CheckedEdits | None:
    """Every edit of ``log`` as checked arrays for ``target`` (None: nothing staged), noting overlaps;
    raises StagedWriteError naming every bad edit (and ``tensor``, the log's), changing nothing."""
    bad: Bad = []
    if not log.batches:  # the common case: list edits only
        if not log.dst:
            return None
        dl, ll = log.dst, log.lens
        e = len(dl)
        w = ll[0] if ll.count(ll[0]) == e else 0  # (one C-level pass; an array of lengths costs more)
        if w:
            n = FULL_LENS.get((e, w))
            if n is None:
                n = full_lens(e, w)
        else:
            n = np.array(ll, np.int64)
        v = list_values(log.vals, dl, n, log.np_dtype, bad, width=w)
        if bad:
            _raise(log, tensor, bad)
        if e <= 32:  # a few edits: the overlap test is cheaper in Python
            stride = log.row_stride
            dup = e > 1 and len(set(map(stride.__rfloordiv__, dl) if stride != 1 else dl)) != e
            return CheckedEdits(target, np.array(dl, np.int64), n, v, dup, w)
        return _with_overlaps(log, target, np.array(dl, np.int64), n, v, w)
    batches = log.all_batches() if log.dst else [*log.batches]
    dsts, lens, vals = [], [], []
    pos = 0
    for b in batches:
        if b.checked:
            dsts.append(b.dst)
            lens.append(b.lens)
            vals.append(b.vals)
        else:
            lens_b = np.array(b.lens, np.int64)
            vals.append(list_values(b.vals, b.dst, lens_b, log.np_dtype, bad, pos))
            dsts.append(np.array(b.dst, np.int64))
            lens.append(lens_b)
        pos += len(b.dst)
    if bad:
        _raise(log, tensor, bad)
    if len(batches) == 1:
        d, n, v = dsts[0], lens[0], vals[0]
    else:
        d, n, v = (np.concatenate(x) for x in (dsts, lens, vals))
    return _with_overlaps(log, target, d, n, v)


def _raise(log: EditLog, tensor: Any, bad: Bad) -> None:
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


def _with_overlaps(
    log: EditLog, target: WriteTarget, d: np.ndarray, n: np.ndarray, v: np.ndarray, width: int = 0
) -> CheckedEdits:
    """The gathered edits, noting whether two share a row (then they may overlap); ``width`` as for
    ``CheckedEdits``."""
    e = d.shape[0]
    dup = False
    if e > 1:  # two edits on one row may overlap: then apply them in order, on the host
        mark = log.mark
        if mark is None:
            mark = log.mark = np.empty(log.rows, np.int64)
        r = d // log.row_stride if log.row_stride != 1 else d
        ar = np.arange(e, dtype=np.int64)
        mark[r] = ar
        dup = bool((mark[r] != ar).any())  # exact whichever duplicate numpy wrote last
    return CheckedEdits(target, d, n, v, dup, width)
