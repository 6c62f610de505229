"""``StagedWriteTensor`` and ``FusedStagedWriter``: the public staged-write classes.

The staged state and its checks live in ``edits.py``, the packed transfer and the
kernel choice in ``launcher.py``, the Triton kernel in ``kernel.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..._bytes.buffers import UvaBuffer
from ..._bytes.memory import alloc_device
from ..._common.convert import shape_of, torch_dtype
from ..._common.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    PinnedAllocationError,
    TierUnavailableError,
    UvaError,
)
from ..._common.log import warn_once
from ..._common.sealed import Sealed, read_only
from ..._common.tier import Tier
from ..._common.types import DeviceLike, DTypeLike, HostData
from ..._tiers.probe import capabilities
from ..._tiers.settings import Kernel
from ..guard import slot_count
from .edits import CheckedEdits, Edits, WriteTarget
from .launcher import _CAPACITY, _Launcher

ALLOWED_DTYPES = (torch.int32, torch.int64, torch.float32)


def _dtype(dtype: DTypeLike) -> torch.dtype:
    allowed = ", ".join(str(d).replace("torch.", "") for d in ALLOWED_DTYPES)
    try:
        dt = torch_dtype(dtype)
    except TypeError:
        dt = None
    if dt not in ALLOWED_DTYPES:
        raise InvalidArgumentError(f"dtype={dtype!r} is not supported for staged writes; allowed: {allowed}")
    return dt


@read_only(
    {
        "gpu": "applies write the tensor made at construction; edit it with stage_write() + apply_write()",
        "stage_write": "it is this tensor's staging call",
        "stage_write_elem": "it is this tensor's staging call",
    }
)
class StagedWriteTensor(Sealed):
    """A zero-filled device tensor edited by staged ``(row, start, values)`` writes.

    Edits are collected on the host and applied all at once by ``apply_write()``,
    with one transfer and one launch; overlapping edits apply in staging order.

    Parameters
    ----------
    size : int or tuple of int
        ``(rows, cols)``, or ``n`` (n rows of one column: ``stage_write_elem(i, v)``
        sets ``gpu[i]``).
    dtype : torch.dtype or numpy dtype or str
        ``int32``, ``int64`` or ``float32``.
    device : torch.device or str or int, optional
        Default: the current accelerator, else the CPU.
    max_concurrency : int, optional
        Staging slots (default: ``set_default_max_concurrency``'s value, at least 2).
    uva_instead_of_gpu : bool, default False
        Keep the tensor in pinned host memory that kernels read through UVA (tier UVA
        only; elsewhere it is a device tensor, logged once).

    Attributes
    ----------
    gpu : torch.Tensor
        The target tensor, at a fixed address (zero-filled at construction).
    shape : tuple of int
        Its shape.
    dtype : torch.dtype
        Its element type.
    device : torch.device
        The target device.
    tier : Tier
        The device's tier (``capabilities(device).tier``).
    rows : int
        The row count (``num_rows`` too).
    cols : int
        Values per row (1 for a 1-D target).

    Raises
    ------
    InvalidArgumentError
        If ``size`` is not an int >= 0 or a tuple of one or two of them, ``dtype`` is
        not one of the allowed dtypes, or ``max_concurrency`` is not None or an int
        >= 1.
    ArgumentTypeError
        If ``device`` is of a type that is not accepted.
    DeviceAllocationError
        If the device runs out of memory for the tensor.
    SetupError, TierUnavailableError
        As :func:`capabilities` raises them for ``device`` and the settings.

    Notes
    -----
    A list of values is checked at apply, with the whole batch (staging stays a list
    append); every other input is checked when staged. A bad list value makes the
    apply write nothing and raise ``StagedWriteError`` naming every bad edit
    (``err.edits``); ``discard_staged(err.edits)`` drops exactly those.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: DTypeLike,
        device: DeviceLike = None,
        max_concurrency: int | None = None,
        uva_instead_of_gpu: bool = False,
    ):
        shape = shape_of(size)
        if len(shape) not in (1, 2):
            raise InvalidArgumentError(
                f"size={size!r} has rank {len(shape)}; allowed: 1 (n) or 2 (rows, cols)"
            )
        if not isinstance(uva_instead_of_gpu, (bool, np.bool_)):
            raise ArgumentTypeError(f"uva_instead_of_gpu={uva_instead_of_gpu!r}; allowed: True or False")
        self.shape = shape
        self.dtype = _dtype(dtype)
        caps = capabilities(device)
        self.device = caps.device
        self.tier = caps.tier
        self.num_rows = self.rows = shape[0]
        self.cols = shape[1] if len(shape) == 2 else 1
        self.row_stride = self.cols
        self.max_concurrency = slot_count(max_concurrency)
        self.uva_buffer: UvaBuffer | None = None
        self.gpu = self._alloc(uva_instead_of_gpu)
        self._edits = Edits(self, WriteTarget(self.gpu, self.tier), self.rows, self.cols, self.dtype)
        self._launcher = _Launcher(self.device, self.max_concurrency, _CAPACITY)
        # the staging calls are the edits' closures: a stage_write costs three list appends
        self.stage_write = self._edits.stage_write  # type: ignore[method-assign,assignment]
        self.stage_write_elem = self._edits.stage_write_elem  # type: ignore[method-assign,assignment]
        self._kernel: Kernel = "host" if self.tier is Tier.HOST else "scatter"
        self._freeze()

    @property
    def kernel(self) -> Kernel:
        """The kernel the last apply ran: ``host``, ``scatter`` or ``triton``."""
        return self._kernel

    def _alloc(self, uva: bool) -> torch.Tensor:
        if uva:
            why = ""
            if self.tier is Tier.UVA:
                try:
                    self.uva_buffer = UvaBuffer(self.shape, self.dtype, self.device)
                    return self.uva_buffer.dev
                except (PinnedAllocationError, UvaError, TierUnavailableError) as e:
                    why = f"the UVA allocation failed ({e})"
            else:
                why = f"the tier of {self.device} is {self.tier.name}, not UVA"
            warn_once(
                ("staged-write-uva", str(self.device), self.tier),
                f"StagedWriteTensor(uva_instead_of_gpu=True) on {self.device} is a device tensor: {why}",
            )
        return alloc_device(self.shape, self.dtype, self.device)

    @property
    def in_host_memory(self) -> bool:
        """True when ``.gpu`` is pinned host memory read through UVA."""
        return self.uva_buffer is not None

    @property
    def num_staged(self) -> int:
        """Edits staged and not yet applied (empty ones are not kept)."""
        return self._edits.count

    # --- staging (each tensor replaces the two single-edit calls with its edits' closures) ---

    def stage_write(self, index: int, start: int, values: HostData) -> None:
        """Stage ``gpu[index, start:start + len(values)] = values``, applied by ``apply_write()``.

        Parameters
        ----------
        index : int
            The row, in ``[0, rows)``.
        start : int
            The first column (a Python or numpy int >= 0); the edit must end within the row.
        values : list, tuple, numpy.ndarray or CPU tensor
            1-D values. A list is checked at apply, with the whole batch; other inputs now.

        Raises
        ------
        InvalidArgumentError
            If ``index`` or ``start`` is not an int in range, the edit ends past the
            row, or non-list ``values`` are not 1-D or do not fit the dtype; nothing is
            staged.
        ArgumentTypeError
            If non-list ``values`` are of an unsupported type or dtype; nothing is
            staged.
        """
        self._edits.stage_write(index, start, values)

    def stage_write_elem(self, index: int, value: Any) -> None:
        """Stage ``gpu[index, 0] = value`` (``gpu[index]`` on a 1-D target).

        Parameters
        ----------
        index : int
            The row, in ``[0, rows)``.
        value : int or float or 0-d array
            One scalar (a Python int or float is checked at apply).

        Raises
        ------
        InvalidArgumentError
            If ``index`` is not an int in ``[0, rows)``, ``value`` is a list or tuple
            or an array that is not 0-d, or a numpy value does not fit the dtype;
            nothing is staged.
        ArgumentTypeError
            If ``value`` is a bool, not a number, or an array of an unsupported dtype;
            nothing is staged.
        """
        self._edits.stage_write_elem(index, value)

    def stage_writes(
        self, rows: HostData, starts: HostData, values: HostData, lengths: HostData | None = None
    ) -> None:
        """Stage a batch of edits from arrays: edit i writes row ``rows[i]`` from column ``starts[i]``.

        Parameters
        ----------
        rows, starts : array-like of int
            One row and one start column per edit.
        values : array-like
            ``(E, L)`` (each edit writes L values), ``(E,)`` (one value each), or,
            with ``lengths``, a flat array whose consecutive runs of ``lengths[i]``
            values are the edits.
        lengths : array-like of int, optional
            Per-edit lengths for flat ``values``.

        Raises
        ------
        InvalidArgumentError
            If the arrays' lengths disagree, a row, start or length is out of range, an
            edit ends past its row, or a value does not fit the dtype. Everything is
            checked now, with numpy; a bad edit raises naming its position, and nothing
            of the batch is staged.
        ArgumentTypeError
            If an argument is of an unsupported type or dtype (``rows``, ``starts`` and
            ``lengths`` must hold integers); nothing of the batch is staged.
        """
        self._edits.stage_writes(rows, starts, values, lengths)

    # --- inspecting, applying ---

    def pending_writes(self) -> list[tuple[int, int, list[Any]]]:
        """The staged edits, in staging order.

        Returns
        -------
        list of (int, int, list)
            ``(index, start, values)`` per edit; an edit's position in this list is
            what ``StagedWriteError.edits`` and ``discard_staged`` use.
        """
        return self._edits.pending()

    def discard_staged(self, positions: Iterable[int]) -> None:
        """Drop the staged edits at ``positions`` (as ``pending_writes()`` numbers them).

        Parameters
        ----------
        positions : iterable of int
            E.g. ``err.edits`` of a ``StagedWriteError``: the next apply then writes
            the remaining edits.

        Raises
        ------
        InvalidArgumentError
            If a position is not a staged edit's (outside ``[0, num_staged)``);
            nothing is dropped.
        ArgumentTypeError
            If ``positions`` is not an iterable of ints; nothing is dropped.
        """
        self._edits.discard(positions)

    def apply_write(self) -> None:
        """Apply every staged edit (one transfer, one launch), then clear them.

        Raises
        ------
        StagedWriteError
            If a staged list value is not a number or does not fit the dtype exactly:
            nothing is written, every staged edit stays staged, and ``err.edits`` names
            every bad one (``discard_staged(err.edits)``, then apply again).
        UsageError
            If a staging slot must grow while a CUDA graph is being captured.
        DeviceAllocationError
            If the device runs out of memory for the staging slots.
        CudaError
            If recording or querying the guard's CUDA event fails.
        """
        g = self._edits.gather()
        if g is None:
            return
        self._kernel = self._write([g])
        self._edits.clear()

    def _write(self, parts: list[CheckedEdits]) -> Kernel:
        """Write checked edits (the launcher's packed transfer and launch; step mode defers them)."""
        return self._launcher.apply(parts)

    def clear_staged_writes(self) -> None:
        """Drop every staged edit without applying it."""
        self._edits.clear()

    def stats(self) -> dict[str, int]:
        """This tensor's staging counters (of ``apply_write()``; a fused apply counts on its writer).

        Returns
        -------
        dict of str to int
            ``transfers`` and ``bytes`` (host-to-device copies of packed edits and
            their size: on PINNED and PAGEABLE), ``growths`` (slots replaced by larger
            ones), ``guard_waits`` (times an apply waited for a slot's last launch)
            and ``steps`` (applies that packed a slot: none on HOST).
        """
        return self._launcher.stats()

    def __repr__(self) -> str:
        return (
            f"StagedWriteTensor(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
            f"tier={self.tier.name}, staged={self.num_staged})"
        )


def edits_of(t: StagedWriteTensor) -> Edits:
    """``t``'s staged edits, for :class:`FusedStagedWriter` (which gathers and clears them)."""
    return t._edits
