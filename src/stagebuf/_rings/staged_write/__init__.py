"""Staged writes: sparse ``(row, start, values)`` edits to device tensors (block tables, token ids), one
transfer and one launch per apply, along the data flow: ``log`` (staged lists, values checked at apply),
``check`` (all or nothing), ``launcher`` (one packed slot; ``scatter``, the ``kernel`` module's Triton
kernel, or numpy on HOST). docs/DESIGN.md, "Staged writes", has the rest.
"""

from __future__ import annotations

from .writers import FusedStagedWriter, StagedWriteTensor

__all__ = ["FusedStagedWriter", "StagedWriteTensor"]
