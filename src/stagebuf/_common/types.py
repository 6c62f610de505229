"""Type aliases of the public API: annotations only (each entry point still checks its arguments)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

DeviceLike: TypeAlias = torch.device | str | int | None
"""A device argument: a ``torch.device``, a name like ``"cuda:0"``, an index, or None (the default)."""

DTypeLike: TypeAlias = torch.dtype | np.dtype | type | str
"""A dtype argument: a torch dtype, a numpy dtype or scalar type, or a dtype name like ``"int32"``."""

HostData: TypeAlias = np.ndarray | torch.Tensor | Sequence[Any]
"""Host input to stage: a numpy array, a CPU tensor, or a (nested) list or tuple of numbers."""
