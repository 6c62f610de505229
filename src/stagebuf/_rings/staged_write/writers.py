"""``StagedWriteTensor`` and ``FusedStagedWriter``: the public staged-write classes. An apply is
``launcher.py``'s three steps: the log, ``check`` (one batch per target), the launch by the writer's
``launcher_class``; a ``StagedWriteTensor`` apply is the one-target case of a fused one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ..._bytes.buffers import UvaBuffer, tier_class
from ..._common.cache import BoundedCache
from ..._common.convert import shape_of, torch_dtype
from ..._common.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    PinnedAllocationError,
    StagedWriteError,
    TierUnavailableError,
    UvaError,
)
from ..._common.log import warn_once
from ..._common.owner import Owner
from ..._common.sealed import Cell, Sealed, read_only
from ..._common.types import DeviceLike, DTypeLike, HostData
from ..._device.memory import alloc_device
from ..._tiers.probe import capabilities
from ..._tiers.settings import Kernel, check_mode
from ..guard import slot_count
from .launcher import CAPACITY, EditLog, Launcher, WriteTarget, check
from .staging import NP_INTS, int_in, stage_checked, stage_elem_checked, stage_writes

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

    Edits are collected on the host and applied all at once by ``apply_write()``, with one transfer and one
    launch; overlapping edits apply in staging order. A list of values is checked at apply, with the whole
    batch (staging stays a list append); every other input is checked when staged.

    Parameters
    ----------
    size : int or tuple of int
        ``(rows, cols)``, or ``n`` rows of one column (``stage_write_elem(i, v)`` sets ``gpu[i]``); ints >= 0.
    dtype : torch.dtype, numpy.dtype or str
        ``int32``, ``int64`` or ``float32``.
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`.
    max_concurrency : int or None, optional
        Staging slots, as for :class:`UvaBufferPool`.
    uva_instead_of_gpu : bool, default False
        Pinned host memory read through UVA instead of device memory (tier UVA only, else logged once).

    Attributes
    ----------
    gpu : torch.Tensor
        The target tensor (zero-filled, at a fixed address) of ``shape``, ``dtype`` and ``device``: ``rows``
        (``num_rows`` too) rows of ``cols`` values (1 for a 1-D target); ``tier`` is the device's.

    Raises
    ------
    InvalidArgumentError, ArgumentTypeError, DeviceAllocationError, HostAllocationError, SetupError,
    TierUnavailableError
        As :class:`UvaBufferPool` raises them for ``max_concurrency``, ``device`` and memory (on a CPU
        device the target is host memory: HostAllocationError);
        InvalidArgumentError also for a ``size`` or ``dtype`` not allowed above, ArgumentTypeError for a
        non-bool ``uva_instead_of_gpu``.
    """

    launcher_class: ClassVar[type[Launcher]] = Launcher
    """The launch step of this class's applies: made once per tensor as ``launcher_class(device,
    max_concurrency, capacity)``, then its ``launch(batches)`` writes each apply's checked batch and names
    the kernel it ran. A subclass names a ``Launcher`` subclass here to launch another way (vLLM's step
    mode defers the batches into its step)."""
    _target: WriteTarget
    _log: EditLog
    _fast: tuple[int, int, Any, Any, Any, Any]
    _launcher: Launcher
    _kernel: Cell[Kernel]
    _thread: Owner | None
    """Check mode: the thread this tensor belongs to."""

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
        log = EditLog(self.rows, self.cols, self.dtype)
        target = WriteTarget(self.gpu, self.device, self.row_stride, tier_class(self.tier).copies)
        self._init(
            _target=target,
            _log=log,
            # what the staging fast paths read, in one load: the bounds and the log's list methods
            _fast=(self.rows, self.cols, log.dst.append, log.lens.append, log.vals.extend, log.vals.append),
            _launcher=self.launcher_class(self.device, self.max_concurrency, CAPACITY),
            _kernel=Cell("host" if target.np is not None else "scatter"),
            _thread=Owner("StagedWriteTensor") if check_mode() else None,
        )

    @property
    def kernel(self) -> Kernel:
        """The kernel the last apply ran (``host``, ``scatter`` or ``triton``)."""
        return self._kernel.value

    def _alloc(self, uva: bool) -> torch.Tensor:
        if uva:
            why = ""
            buffers = tier_class(self.tier)
            if buffers.async_host_reads and not buffers.copies:  # the device reads host memory itself
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
        return self._log.count

    # --- staging: the fast paths are three list appends; anything else is checked now ---

    def stage_write(self, index: int, start: int, values: HostData) -> None:
        """Stage ``gpu[index, start:start + len(values)] = values``, applied by ``apply_write()``.

        ``index`` is the row and ``start`` the first column (Python or numpy ints); ``values`` are 1-D: a list
        (checked at apply, with the whole batch), tuple, numpy array or CPU tensor (checked now).

        Raises
        ------
        InvalidArgumentError, ArgumentTypeError
            InvalidArgumentError if ``index`` is not an int in ``[0, rows)``, ``start`` not an int >= 0, the
            edit ends past the row, or non-list ``values`` are not 1-D or do not fit the dtype;
            ArgumentTypeError if they are of an unsupported type or dtype. Nothing is staged then.
        """
        if type(values) is list and type(index) is int:
            if type(start) is not int:  # vLLM passes numpy ints here (a row's block count)
                if type(start) not in NP_INTS:
                    stage_checked(self._log, index, start, values)
                    return
                start = int(start)
            n = len(values)
            rows, cols, dst, lens, vals, _ = self._fast
            if 0 <= index < rows and start >= 0 and start + n <= cols and n:
                dst(index * cols + start)
                lens(n)
                vals(values)
                return
        stage_checked(self._log, index, start, values)

    def stage_write_elem(self, index: int, value: Any) -> None:
        """Stage ``gpu[index, 0] = value`` (``gpu[index]`` on a 1-D target); ``value`` is one scalar: an
        int or float (checked at apply) or a 0-d array. Raises as :meth:`stage_write` (a list, tuple or
        array that is not 0-d is InvalidArgumentError; a bool or a non-number ArgumentTypeError)."""
        rows, cols, dst, lens, _, val = self._fast
        if type(index) is int and 0 <= index < rows and (type(value) is int or type(value) is float):
            dst(index * cols)
            lens(1)
            val(value)
            return
        stage_elem_checked(self._log, index, value)

    def stage_writes(
        self, rows: HostData, starts: HostData, values: HostData, lengths: HostData | None = None
    ) -> None:
        """Stage a batch of edits from arrays: edit i writes row ``rows[i]`` from column ``starts[i]``.

        Everything is checked now, with numpy: a bad edit raises naming its position, and nothing is staged.

        Parameters
        ----------
        rows, starts : array-like of int
            One row and one start column per edit.
        values : array-like
            ``(E, L)`` (each edit writes L values), ``(E,)`` (one value each), or, with ``lengths``, a flat
            array whose consecutive runs of ``lengths[i]`` values are the edits.
        lengths : array-like of int, optional
            Per-edit lengths for flat ``values``.

        Raises
        ------
        InvalidArgumentError, ArgumentTypeError
            InvalidArgumentError as :meth:`stage_write` for each edit, or if the arrays' lengths disagree;
            ArgumentTypeError if an argument is of an unsupported type or dtype (``rows``, ``starts`` and
            ``lengths`` must hold integers).
        HostAllocationError
            If the host cannot hold the batch's copy (checked before allocating; the call peaks at about
            its inputs' size). Nothing is staged by the call; earlier edits stay staged.
        """
        if self._thread is not None:
            self._thread.check()
        stage_writes(self._log, rows, starts, values, lengths)

    # --- inspecting, applying ---

    def pending_writes(self) -> list[tuple[int, int, list[Any]]]:
        """The staged edits in staging order, as ``(index, start, values)``: an edit's position in this
        list is what ``StagedWriteError.edits`` and ``discard_staged`` use."""
        return self._log.pending()

    def discard_staged(self, positions: Iterable[int]) -> None:
        """Drop the staged edits at ``positions`` (as ``pending_writes()`` numbers them: ``err.edits`` of a
        ``StagedWriteError``, say). Raises InvalidArgumentError for a position outside ``[0, num_staged)``,
        ArgumentTypeError if ``positions`` is not an iterable of ints; nothing is dropped then."""
        self._log.discard(positions)

    def apply_write(self) -> None:
        """Apply every staged edit (one transfer, one launch), then clear them.

        Raises
        ------
        StagedWriteError
            If a staged list value is not a number or does not fit the dtype exactly: nothing is written and
            ``err.edits`` names every bad edit (``discard_staged(err.edits)``, then apply again).
        UsageError
            If a staging slot must grow while a CUDA graph is being captured.
        DeviceAllocationError, HostAllocationError
            If the device (or the host) runs out of memory for the staging slots; every edit stays staged.
        CudaError
            If recording or querying the guard's CUDA event fails.
        """
        if self._thread is not None:
            self._thread.check()
        g = check(self._log, self._target, self)
        if g is None:
            return
        self._kernel.value = self._launcher.launch([g])
        self._log.clear()

    def release_thread(self) -> None:
        """Hand this object to another thread, as :meth:`UvaBufferPool.release_thread`."""
        if self._thread is not None:
            self._thread.release()

    def clear_staged_writes(self) -> None:
        """Drop every staged edit without applying it."""
        self._log.clear()

    def stats(self) -> dict[str, int]:
        """This tensor's counters (of ``apply_write()``; a fused apply counts on its writer): ``transfers``
        and ``bytes`` (copies of packed edits and their size, on PINNED and PAGEABLE), ``growths`` (slots
        replaced by larger ones), ``guard_waits`` (times an apply waited for a slot's last launch) and
        ``steps`` (applies that packed a slot: none on HOST)."""
        return self._launcher.stats()

    def __repr__(self) -> str:
        return (
            f"StagedWriteTensor(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
            f"tier={self.tier.name}, staged={self.num_staged})"
        )


class FusedStagedWriter(Sealed):
    """Applies the staged edits of several StagedWriteTensors of one dtype: one transfer, one launch.

    The writer owns its staging slots (made at the first apply that packs one), not the tensors'. ``device``
    and ``max_concurrency`` (at least 2) are the arguments, resolved.

    Parameters
    ----------
    device : torch.device, str, int or None, optional
        The tensors' device, as for :func:`capabilities`.
    max_writes : int, default 1024
        The expected edits per apply, >= 1: it sizes the staging slots (a larger apply grows them).
    max_concurrency : int or None, optional
        The staging slot count, as for :class:`UvaBufferPool`.

    Raises
    ------
    InvalidArgumentError, ArgumentTypeError, SetupError, TierUnavailableError
        As :class:`UvaBufferPool` raises them for ``max_concurrency`` and ``device``; InvalidArgumentError
        also if ``max_writes`` is not an int >= 1.
    """

    launcher_class: ClassVar[type[Launcher]] = Launcher
    """The launch step of this class's applies, as ``StagedWriteTensor.launcher_class``."""

    def __init__(self, device: DeviceLike = None, max_writes: int = 1024, max_concurrency: int | None = None):
        self._max_writes = int_in(max_writes, "max_writes", 1, None, "")
        self.max_concurrency = slot_count(max_concurrency)
        self.device = capabilities(device).device
        # a slot per apply: per edit an 8-byte destination and about 8 values of 8 bytes, or 32 bytes of rows
        self._launcher = self.launcher_class(self.device, self.max_concurrency, 1024 + 96 * self._max_writes)
        self._edit_growths = 0
        self._kernel: Cell[Kernel] = Cell("scatter")
        self._verified: BoundedCache[tuple[Any, ...], bool] = BoundedCache(64)
        """(name, data_ptr, version, expected) of device output_ptrs/strides already read and matched."""
        self._check = check_mode()
        self._thread = Owner("FusedStagedWriter") if self._check else None
        self._freeze()

    @property
    def kernel(self) -> Kernel:
        """The kernel the last apply ran, ``scatter`` (also before the first), ``triton`` or ``host`` (tier
        HOST). ``STAGEBUF_WRITE_KERNEL`` (``auto``, ``scatter``, ``triton``) picks where Triton runs;
        overlapping edits use ``scatter``."""
        return self._kernel.value

    @property
    def max_writes(self) -> int:
        """Edits per apply the slots were sized for (an apply with more sets the next power of two)."""
        return self._max_writes

    def apply(
        self, tensors: Iterable[StagedWriteTensor], output_ptrs: Any = None, output_strides: Any = None
    ) -> None:
        """Apply and clear the staged edits of ``tensors`` at once.

        All or nothing: every tensor's edits are checked before anything is written. A tensor listed twice is
        applied once; with nothing staged nothing happens.

        Parameters
        ----------
        tensors : iterable of StagedWriteTensor
            The tensors, all of one dtype and on this writer's device (a list, not a single tensor).
        output_ptrs : sequence of int, torch.Tensor or None, optional
            vLLM's call shape: each tensor's ``gpu.data_ptr()`` in ``tensors`` order, checked; a device tensor
            is read once per version (every call in check mode), as that read waits for the device.
        output_strides : sequence of int, torch.Tensor or None, optional
            Each tensor's row stride (``row_stride``), checked as ``output_ptrs``.

        Raises
        ------
        ArgumentTypeError
            If ``tensors`` is not an iterable of StagedWriteTensor (a single one included), or
            ``output_ptrs``/``output_strides`` is not a sequence (or tensor) of ints.
        InvalidArgumentError
            If the tensors mix dtypes or one is on another device, or ``output_ptrs``/``output_strides`` does
            not match them (values, length, dtype, or a device other than the CPU or this one).
        StagedWriteError
            As :meth:`StagedWriteTensor.apply_write`, over every tensor (nothing is written on any);
            ``err.tensor`` is the first tensor with a bad edit, ``err.edits`` its bad edits.
        UsageError, DeviceAllocationError, CudaError
            As :meth:`StagedWriteTensor.apply_write`.
        """
        if isinstance(tensors, StagedWriteTensor) or not isinstance(tensors, Iterable):
            raise ArgumentTypeError(
                f"tensors must be a list (or other iterable) of StagedWriteTensor; "
                f"got {type(tensors).__name__}"
            )
        tensors = list(tensors)
        targets: list[StagedWriteTensor] = []
        for i, t in enumerate(tensors):
            if not isinstance(t, StagedWriteTensor):
                raise ArgumentTypeError(f"tensors[{i}] is a {type(t).__name__}; expected StagedWriteTensor")
            if t.device != self.device:
                raise InvalidArgumentError(
                    f"tensors[{i}] is on {t.device}; this writer targets {self.device}"
                )
            if targets and t.dtype != targets[0].dtype:
                raise InvalidArgumentError(
                    f"tensors[{i}] has dtype {t.dtype} but tensors[0] has {targets[0].dtype}; "
                    "one fused apply needs one dtype"
                )
            if t not in targets:  # (identity: a tensor defines no ==)
                targets.append(t)
        if self._thread is not None:
            self._thread.check()
            for t in targets:
                if t._thread is not None:
                    t._thread.check()
        if output_ptrs is not None:
            ptrs = [t.gpu.data_ptr() for t in tensors]
            check_outputs(self.device, self._verified, self._check, output_ptrs, "output_ptrs", ptrs)
        if output_strides is not None:
            strides = [t.row_stride for t in tensors]
            check_outputs(self.device, self._verified, self._check, output_strides, "output_strides", strides)
        parts = []
        errors: list[tuple[int, StagedWriteError]] = []
        for t in targets:  # every tensor is checked before anything is written
            try:
                g = check(t._log, t._target, t)
            except StagedWriteError as err:
                errors.append((next(k for k, u in enumerate(tensors) if u is t), err))
                continue
            if g is not None:
                parts.append(g)
        if errors:
            raise _fused_error(errors) from None
        if not parts:
            return
        n = sum(p.first.shape[0] for p in parts)
        if n > self._max_writes:
            self._max_writes = 1 << (n - 1).bit_length()
            self._edit_growths += 1
        self._kernel.value = self._launcher.launch(parts)
        for t in targets:
            t._log.clear()

    def release_thread(self) -> None:
        """Hand this object to another thread, as :meth:`UvaBufferPool.release_thread`."""
        if self._thread is not None:
            self._thread.release()

    def stats(self) -> dict[str, int]:
        """The writer's counters: those of :meth:`StagedWriteTensor.stats`, for its applies, and
        ``edit_growths`` (times an apply's edits exceeded ``max_writes``)."""
        return {**self._launcher.stats(), "edit_growths": self._edit_growths}

    def __repr__(self) -> str:
        return f"FusedStagedWriter(device={self.device}, max_writes={self.max_writes})"


def check_outputs(
    device: torch.device,
    verified: BoundedCache[tuple[Any, ...], bool],
    every: bool,
    given: Any,
    name: str,
    expect: list[int],
) -> None:
    """Check vLLM's ``output_ptrs``/``output_strides`` (``given``) against ``expect``, with no sync per
    call: a device tensor's contents are read once per (tensor, version, expected values), remembered in
    ``verified``, or every call with ``every`` (check mode); everything else is checked every call."""
    if given is None:
        return
    key = None
    if isinstance(given, torch.Tensor):
        if given.dtype not in (torch.int64, torch.uint64, torch.int32) or given.numel() != len(expect):
            raise InvalidArgumentError(
                f"{name} is a tensor of shape {tuple(given.shape)}, dtype {given.dtype}; allowed: "
                f"{len(expect)} integers (int64, uint64 or int32), one per tensor"
            )
        if given.device.type != "cpu":
            if given.device != device:
                raise InvalidArgumentError(
                    f"{name} is on {given.device}; allowed: the CPU or this writer's {device}"
                )
            key = (name, given.data_ptr(), given._version, tuple(expect))
            if key in verified and not every:
                return
        given = given.detach().cpu().reshape(-1).tolist()  # a sync only for a new device tensor
    try:
        got = [int(v) for v in given]
    except (TypeError, ValueError):
        raise ArgumentTypeError(
            f"{name} must be None or a sequence (or tensor) of ints, one per tensor; "
            f"got {type(given).__name__}"
        ) from None
    if got != expect:
        raise InvalidArgumentError(
            f"{name}={got} does not match the tensors passed ({expect}); "
            f"allowed: None, or exactly those values in the same order"
        )
    if key is not None:
        verified.put(key, True)


def _fused_error(errors: list[tuple[int, StagedWriteError]]) -> StagedWriteError:
    """One error for every tensor of a fused apply with bad edits (``errors``: its place in ``tensors``)."""
    lines = [f"tensors[{i}] ({len(e.edits)} bad edit(s)): {e._what or e}" for i, e in errors]
    first = errors[0][1]
    return StagedWriteError(
        "\n".join(lines) + "\nNothing was written to any tensor, and every staged edit is still staged: "
        "for t, edits in err.by_tensor: t.discard_staged(edits) drops the bad ones",
        first.position,
        first.index,
        first.start,
        first.edits,
        first.tensor,
        by_tensor=tuple((e.tensor, e.edits) for _, e in errors),
    )
