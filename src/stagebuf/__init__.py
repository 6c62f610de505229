"""stagebuf: host-to-device staging buffers for inference engines, on every machine.

The host writes inputs into buffers; stagebuf makes them readable on the device by the best transfer that
works here, its *tier* (:class:`Tier`), best first: UVA (zero copies: the device reads pinned host memory),
PINNED (one asynchronous copy), PAGEABLE (one copy from plain memory) and HOST (no accelerator: the CPU
tensor is the device tensor). :func:`capabilities` probes each device once and decides its tier; everything
else asks it, and ``STAGEBUF_TIER`` forces one.

* :func:`make_buffer` and the buffer classes: one host buffer and its device side.
* :class:`UvaBufferPool`, :class:`UvaBackedTensor`, :class:`StepStager` and :class:`DeviceParamTable`:
  rings of slots, so the host fills the next step's inputs while the device reads this step's;
  :func:`begin_step` marks steps for engines whose rings skip some.
* :class:`StagedWriteTensor` and :class:`FusedStagedWriter`: sparse edits of a device tensor, in one launch.
* :func:`async_copy_to_gpu`: one array to the device.

Every exception raised is a :class:`StagebufError`. Importing stagebuf does not initialise CUDA: the probe
runs on first use, as does ``stagebuf.PIN_MEMORY`` (the default device's :func:`is_pin_memory_available`).
"""

from __future__ import annotations

from typing import Any

from ._bytes.async_copy import async_copy_to_gpu
from ._bytes.buffers import HostBuffer, NonUvaBuffer, PinnedBuffer, StagingBuffer, UvaBuffer
from ._bytes.make import make_buffer
from ._common.errors import (
    ArgumentTypeError,
    CudaError,
    DeviceAllocationError,
    HostAllocationError,
    InvalidArgumentError,
    NotCopyableError,
    PinnedAllocationError,
    ReadOnlyAttributeError,
    SettingValueError,
    SetupError,
    SlotInFlightError,
    StagebufError,
    StagedWriteError,
    StepRuleError,
    TierUnavailableError,
    UnknownAttributeError,
    UnknownDeviceError,
    UnknownFieldError,
    UsageError,
    UvaError,
)
from ._common.tier import Tier
from ._rings.guard import begin_step, set_default_max_concurrency
from ._rings.param_table import DeviceParamTable, ParamField
from ._rings.pool import UvaBackedTensor, UvaBufferPool
from ._rings.staged_write import FusedStagedWriter, StagedWriteTensor
from ._rings.stager import Step, StepStager
from ._tiers.capabilities import Capabilities
from ._tiers.probe import capabilities, is_pin_memory_available, is_uva_available, reset_capabilities

__version__ = "0.1.0"

# fmt: off
__all__ = [
    "ArgumentTypeError", "Capabilities", "CudaError", "DeviceAllocationError", "DeviceParamTable",
    "FusedStagedWriter", "HostAllocationError", "HostBuffer", "InvalidArgumentError", "NonUvaBuffer",
    "NotCopyableError", "ParamField", "PinnedAllocationError", "PinnedBuffer", "ReadOnlyAttributeError",
    "SettingValueError", "SetupError", "SlotInFlightError", "StagebufError", "StagedWriteError",
    "StagedWriteTensor", "StagingBuffer", "Step", "StepRuleError", "StepStager", "Tier",
    "TierUnavailableError", "UnknownAttributeError", "UnknownDeviceError", "UnknownFieldError",
    "UsageError", "UvaBackedTensor", "UvaBuffer", "UvaBufferPool", "UvaError", "async_copy_to_gpu",
    "begin_step", "capabilities", "is_pin_memory_available", "is_uva_available", "make_buffer",
    "reset_capabilities", "set_default_max_concurrency",
]
# fmt: on


def __getattr__(name: str) -> Any:
    # PIN_MEMORY is computed on first access, so that import does not touch CUDA
    if name == "PIN_MEMORY":
        return is_pin_memory_available()
    if name.startswith("__"):  # protocol probes (pickle, doctest, inspect) expect the plain error
        raise AttributeError(f"module 'stagebuf' has no attribute {name!r}")
    raise UnknownAttributeError(
        f"module 'stagebuf' has no attribute {name!r}; its public names are stagebuf.__all__ and PIN_MEMORY"
    )
