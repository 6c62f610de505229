"""stagebuf: host-to-device staging for inference engines, on every machine.

Tiers, best first: UVA (zero copies) -> PINNED (one async copy) -> PAGEABLE
(one copy from plain memory) -> HOST (no accelerator). ``capabilities()``
decides the tier once per device; everything else asks it.

Importing stagebuf does not initialise CUDA: probing happens on first use.
"""

from __future__ import annotations

from typing import Any

from ._async_copy import async_copy_to_gpu
from ._buffers import HostBuffer, NonUvaBuffer, PinnedBuffer, StagingBuffer, UvaBuffer, make_buffer
from ._errors import (
    ArgumentTypeError,
    CudaError,
    DeviceAllocationError,
    InvalidArgumentError,
    PinnedAllocationError,
    ReadOnlyAttributeError,
    SetupError,
    SlotInFlightError,
    StagebufError,
    StagedWriteError,
    StepRuleError,
    TierUnavailableError,
    UnknownFieldError,
    UsageError,
    UvaError,
)
from ._guard import begin_step, set_default_max_concurrency
from ._param_table import DeviceParamTable, ParamField
from ._pool import UvaBackedTensor, UvaBufferPool
from ._probe import (
    Capabilities,
    capabilities,
    is_pin_memory_available,
    is_uva_available,
    reset_capabilities,
)
from ._staged_write import FusedStagedWriter, StagedWriteTensor
from ._stager import Step, StepStager
from ._tier import Tier

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "Capabilities",
    "CudaError",
    "DeviceAllocationError",
    "DeviceParamTable",
    "FusedStagedWriter",
    "HostBuffer",
    "InvalidArgumentError",
    "NonUvaBuffer",
    "ParamField",
    "PinnedAllocationError",
    "PinnedBuffer",
    "ReadOnlyAttributeError",
    "SetupError",
    "SlotInFlightError",
    "StagebufError",
    "StagedWriteError",
    "StagedWriteTensor",
    "StagingBuffer",
    "Step",
    "StepRuleError",
    "StepStager",
    "Tier",
    "TierUnavailableError",
    "UnknownFieldError",
    "UsageError",
    "UvaBackedTensor",
    "UvaBuffer",
    "UvaBufferPool",
    "UvaError",
    "async_copy_to_gpu",
    "begin_step",
    "capabilities",
    "is_pin_memory_available",
    "is_uva_available",
    "make_buffer",
    "reset_capabilities",
    "set_default_max_concurrency",
]


def __getattr__(name: str) -> Any:
    # PIN_MEMORY is computed on first access so that import does not touch CUDA.
    if name == "PIN_MEMORY":
        return is_pin_memory_available()
    raise AttributeError(f"module 'stagebuf' has no attribute {name!r}")
