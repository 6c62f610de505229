"""Staged writes: sparse ``(row, start, values)`` edits to device tensors (block tables, token ids), one
transfer and one launch per apply, in three steps named as vLLM's ``StagedWriteTensor`` reads them, all in
``launcher``: the **log** (``EditLog``; ``staging`` checks what enters it), the **check** (the log as one
``WriteBatch`` of ``indices``, ``starts``, ``cu_lens`` and values, or a ``StagedWriteError``; ``values``
reads list values) and the **launch** (``Launcher.launch``: one packed slot; ``scatter``, the ``kernel``
module's Triton kernel, or numpy on a CPU target). ``writers`` holds the public classes, which take their
launch step from ``launcher_class``. docs/DESIGN.md, "Staged writes", has the rest.
"""

from __future__ import annotations

from .writers import FusedStagedWriter, StagedWriteTensor

__all__ = ["FusedStagedWriter", "StagedWriteTensor"]
