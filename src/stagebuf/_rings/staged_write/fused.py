"""``FusedStagedWriter``: the staged edits of several ``StagedWriteTensor`` of one dtype, one apply."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..._common.errors import ArgumentTypeError, InvalidArgumentError, StagedWriteError
from ..._common.sealed import Sealed
from ..._common.types import DeviceLike
from ..._tiers.probe import capabilities
from ..._tiers.settings import Kernel, check_mode
from ..guard import slot_count
from .api import StagedWriteTensor, edits_of
from .edits import CheckedEdits, int_in
from .launcher import _Launcher


class FusedStagedWriter(Sealed):
    """Applies the staged edits of several StagedWriteTensors of one dtype: one transfer, one launch.

    The writer owns its staging slots (made at the first apply that packs one); the
    tensors' own slots are not used.

    Parameters
    ----------
    device : torch.device, str, int or None, optional
        The device of the tensors, as for :func:`capabilities`; None (the default) is
        the default device.
    max_writes : int, optional
        The expected number of edits per apply, >= 1 (default 1024): it sizes the
        staging slots; a larger apply grows them.
    max_concurrency : int or None, optional
        The staging slot count, >= 1 (values below 2 are raised to 2); None (the
        default) is :func:`set_default_max_concurrency`'s value.

    Attributes
    ----------
    device : torch.device
        The target device.
    max_concurrency : int
        The staging slot count (at least 2).

    Raises
    ------
    InvalidArgumentError
        If ``max_writes`` is not an int >= 1, or ``max_concurrency`` is not None or
        an int >= 1.
    ArgumentTypeError
        If ``device`` is of a type that is not accepted.
    SetupError, TierUnavailableError
        As :func:`capabilities` raises them for ``device`` and the settings.
    """

    def __init__(self, device: DeviceLike = None, max_writes: int = 1024, max_concurrency: int | None = None):
        self._max_writes = int_in(max_writes, "max_writes", 1, None, "")
        self.max_concurrency = slot_count(max_concurrency)
        self.device = capabilities(device).device
        self._launcher = _Launcher(self.device, self.max_concurrency, self._capacity(self._max_writes))
        self._edit_growths = 0
        self._kernel: Kernel = "scatter"
        self._verified: set[tuple[Any, ...]] = set()
        """(name, data_ptr, version, expected) of device output_ptrs/strides already read and matched."""
        self._check = check_mode()
        self._freeze()

    @property
    def kernel(self) -> Kernel:
        """The kernel the last apply ran: ``scatter`` or ``triton`` (``host`` on tier HOST).

        ``scatter`` before the first apply. ``STAGEBUF_WRITE_KERNEL`` (``auto``,
        ``scatter`` or ``triton``) chooses where Triton can run (else ``scatter``);
        overlapping edits always use ``scatter``.
        """
        return self._kernel

    @property
    def max_writes(self) -> int:
        """Edits per apply the slots were sized for (an apply with more sets the next power of two)."""
        return self._max_writes

    @staticmethod
    def _capacity(max_writes: int) -> int:
        # per edit: an 8-byte destination and about 8 values of 8 bytes, or 32 bytes of Triton metadata
        return 1024 + 96 * max_writes

    def apply(
        self, tensors: Iterable[StagedWriteTensor], output_ptrs: Any = None, output_strides: Any = None
    ) -> None:
        """Apply and clear the staged edits of ``tensors`` (one dtype, this device) at once.

        All or nothing: every tensor's edits are gathered and checked before anything
        is written, then they go out in one packed transfer and one launch. A tensor
        listed twice is applied once; with nothing staged nothing happens.

        Parameters
        ----------
        tensors : iterable of StagedWriteTensor
            The tensors, all of one dtype and on this writer's device (a list, not a
            single tensor).
        output_ptrs : sequence of int, torch.Tensor or None, optional
            vLLM's call shape: each tensor's ``gpu.data_ptr()``, in the order of
            ``tensors``; checked against them when given. A device tensor's contents
            are read once per tensor version (every call in check mode), since that
            read waits for the device.
        output_strides : sequence of int, torch.Tensor or None, optional
            Each tensor's row stride (``row_stride``), checked as ``output_ptrs``.

        Raises
        ------
        ArgumentTypeError
            If ``tensors`` is not an iterable of StagedWriteTensor (a single one
            included), or ``output_ptrs``/``output_strides`` is not a sequence (or
            tensor) of ints.
        InvalidArgumentError
            If the tensors mix dtypes or one is on another device, or
            ``output_ptrs``/``output_strides`` does not match the tensors (values,
            length, a tensor's dtype, or a device other than the CPU or this one).
        StagedWriteError
            If a staged list value is not a number or does not fit the dtype exactly:
            nothing is written on any tensor and every staged edit stays staged.
            ``err.tensor`` is the first tensor with a bad edit and ``err.edits`` its
            bad edits' positions in ``err.tensor.pending_writes()``; call
            ``err.tensor.discard_staged(err.edits)``, then apply again.
        UsageError
            If a staging slot must grow while a CUDA graph is being captured.
        DeviceAllocationError
            If the device runs out of memory for the staging slots.
        CudaError
            If recording or querying the guard's CUDA event fails.
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
            if not any(t is u for u in targets):
                targets.append(t)
        if output_ptrs is not None:
            ptrs = [t.gpu.data_ptr() for t in tensors]
            check_outputs(self.device, self._verified, self._check, output_ptrs, "output_ptrs", ptrs)
        if output_strides is not None:
            strides = [t.row_stride for t in tensors]
            check_outputs(self.device, self._verified, self._check, output_strides, "output_strides", strides)
        parts = []
        edits = [edits_of(t) for t in targets]
        for t, e in zip(targets, edits):  # every tensor is checked before anything is written
            try:
                g = e.gather()
            except StagedWriteError as err:
                i = next(k for k, u in enumerate(tensors) if u is t)
                raise StagedWriteError(
                    f"tensors[{i}]: {err}; nothing was written to any tensor",
                    err.position,
                    err.index,
                    err.start,
                    err.edits,
                    err.tensor,
                ) from None
            if g is not None:
                parts.append(g)
        if not parts:
            return
        n = sum(p.dst.shape[0] for p in parts)
        if n > self._max_writes:
            self._max_writes = 1 << (n - 1).bit_length()
            self._edit_growths += 1
        self._kernel = self._write(parts)
        for e in edits:
            e.clear()

    def _write(self, parts: list[CheckedEdits]) -> Kernel:
        """Write checked edits (the launcher's packed transfer and launch; step mode defers them)."""
        return self._launcher.apply(parts)

    def stats(self) -> dict[str, int]:
        """The writer's counters.

        Returns
        -------
        dict of str to int
            ``transfers`` and ``bytes`` (host-to-device copies of packed edits and
            their size: on PINNED and PAGEABLE), ``growths`` (staging slots replaced
            by larger ones), ``guard_waits`` (times an apply waited for a slot's last
            launch), ``steps`` (applies that packed a slot: none on HOST) and
            ``edit_growths`` (times an apply's edits exceeded ``max_writes``).
        """
        return {**self._launcher.stats(), "edit_growths": self._edit_growths}

    def __repr__(self) -> str:
        return f"FusedStagedWriter(device={self.device}, max_writes={self.max_writes})"


def check_outputs(
    device: torch.device,
    verified: set[tuple[Any, ...]],
    every: bool,
    given: Any,
    name: str,
    expect: list[int],
) -> None:
    """Check vLLM's ``output_ptrs``/``output_strides`` (``given``) against ``expect``; no sync per call.

    A sequence, or a CPU tensor, is compared every call. A device tensor's shape,
    dtype and device are checked every call; its contents are read once per
    distinct (tensor, version, expected values) and remembered in ``verified``, since reading
    device memory on the host waits for the device. ``every`` (``STAGEBUF_CHECK=1``)
    reads them every call.
    """
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
        if len(verified) >= 64:
            verified.clear()
        verified.add(key)
