"""Staged writes: sparse ``(row, start, values)`` edits to device tensors, one transfer and one launch.

Per-request device state (block tables, prompt token ids) lives in large device
tensors that change a little each step. ``StagedWriteTensor`` collects edits on
the host and applies all of them at once; ``FusedStagedWriter`` does the same
for several tensors of one dtype.

Staging is as cheap as appending to a list: ``stage_write`` checks the row and
the column range (O(1) integer checks) and appends; values given as a Python
list are checked at apply, vectorised over the whole batch. ``stage_writes``
stages a batch of edits from numpy arrays with a few array operations.

Apply (one per call, whatever the number of edits):

1. Gather and check every staged edit (numpy; ``check.py``, from each tensor's ``log.py``). A bad value raises
   ``StagedWriteError`` naming every bad edit (``err.edits``); then nothing is
   written and every staged edit stays staged (``discard_staged`` drops the bad).
2. Pack them (``launcher.py``) into the next slot of the writer's own guarded ring (written in
   place: the slots are private): one host-to-device transfer on the copy
   tiers, none on UVA.
3. Write them with one launch, the cheaper of two kernels for the batch:

   * ``scatter``: the flat destination index of every element, computed on the
     host, and one ATen ``index_copy_`` on the target's flat view;
   * ``triton``: one program per edit (``_staged_write_kernel``), reading
     (tensor, offset, length, source) per edit, so large edits move their
     values only; several targets go through one launch (each edit carries its target address).

   On the HOST tier the scatter is one numpy assignment into the target.

Overlapping edits apply in staging order ("later wins"): when two edits share
a row (a Python set for a few edits, else one scatter into a per-row marker
array), the elements are
de-duplicated on the host, keeping each destination's last staged value, and
the scatter kernel runs.
"""

from __future__ import annotations

from .writers import FusedStagedWriter, StagedWriteTensor

__all__ = ["FusedStagedWriter", "StagedWriteTensor"]
