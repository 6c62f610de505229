"""Staged writes: sparse ``(row, start, values)`` edits to device tensors, one transfer and one launch.

For per-request device state (block tables, prompt token ids): large device tensors that change a
little each step. Along the data flow: a tensor's edits go into its log (``log.py``: a list is staged
with O(1) checks and appends, its values checked at apply); an apply checks them all (``check.py``: all
or nothing), packs them into the next slot of the writer's guarded ring and writes them with one launch
(``launcher.py``): ``scatter`` (one ATen ``index_copy_``), ``triton`` (``kernel.py``: one program per
edit, several targets per launch) or one numpy assignment on HOST. Edits sharing a row are
de-duplicated on the host (later wins) for the scatter. docs/DESIGN.md, "Staged writes", has the rest.
"""

from __future__ import annotations

from .writers import FusedStagedWriter, StagedWriteTensor

__all__ = ["FusedStagedWriter", "StagedWriteTensor"]
