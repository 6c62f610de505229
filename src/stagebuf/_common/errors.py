"""Every exception stagebuf raises: each is a ``StagebufError`` and a builtin, so either can be caught."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StagebufError(Exception):
    """The base of every exception stagebuf raises: ``except stagebuf.StagebufError`` catches them all."""


class InvalidArgumentError(StagebufError, ValueError):
    """An argument (or a value in it) that stagebuf cannot use; the message names it and what is allowed."""


class ArgumentTypeError(StagebufError, TypeError):
    """An argument of a type that stagebuf cannot use; the message names it and what is allowed."""


class UsageError(StagebufError, RuntimeError):
    """A call out of order (a step still open, a flushed step staged into, a growth during capture)."""


class SetupError(StagebufError):
    """A setting that cannot work here, explained: what was asked, why, what would work and what to do.

    Each argument is kept as an attribute (``allowed`` as a tuple). A bad setting value or a device torch does
    not know raises a ``ValueError`` subclass (:class:`SettingValueError`, :class:`UnknownDeviceError`).

    Parameters
    ----------
    problem : str
        What was asked, and that it cannot work.
    setting : str, optional
        What was set: ``"STAGEBUF_TIER"`` (or another environment variable), ``"device"`` or ``"tier"``.
    value : Any, optional
        The value it was set to.
    cause : str, optional
        Why it cannot work on this machine.
    allowed : sequence of str, optional
        The values that would work here.
    fix : str, optional
        What to do.
    hint : str, optional
        The part of ``fix`` that does not depend on how the setting was given.
    """

    def __init__(
        self,
        problem: str,
        *,
        setting: str | None = None,
        value: Any = None,
        cause: str | None = None,
        allowed: Sequence[str] = (),
        fix: str | None = None,
        hint: str | None = None,
    ):
        self.problem = problem
        self.setting = setting
        self.value = value
        self.cause = cause
        self.allowed = tuple(allowed)
        self.fix = fix
        self.hint = hint
        text = problem + (f": {cause}" if cause else "")
        if self.allowed:
            text += f"; allowed: {', '.join(self.allowed)}"
        if fix:
            text += f". Fix: {fix}"
        super().__init__(text)


class TierUnavailableError(SetupError, RuntimeError):
    """A tier or device was asked for (by STAGEBUF_TIER or an argument) that cannot work here."""


class SettingValueError(SetupError, ValueError):
    """A ``STAGEBUF_*`` environment setting holds a value it does not take."""


class UnknownDeviceError(SetupError, ValueError, RuntimeError):
    """A device that torch does not know (a RuntimeError too, as torch.device raises)."""


class PinnedAllocationError(StagebufError, MemoryError, RuntimeError):
    """Page-locked host memory could not be allocated (memlock limit, WSL cap, driver); the message names the
    bytes and the tier. ``make_buffer`` falls back to tier PAGEABLE on it; the tier classes raise it."""


class DeviceAllocationError(StagebufError, MemoryError, RuntimeError):
    """Device memory could not be allocated; the message names the bytes asked for and the device."""


class HostAllocationError(StagebufError, MemoryError, RuntimeError):
    """Plain host memory could not be allocated; nothing was written (what was staged before stays staged)."""


class UvaError(StagebufError, RuntimeError):
    """A device view of host memory could not be made or is not a live alias."""


class SlotInFlightError(StagebufError, RuntimeError):
    """A slot came round again while the device may still read it (guard='raise')."""


class StepRuleError(StagebufError, RuntimeError):
    """STAGEBUF_CHECK=1: the step clock would have released a slot the device may still read."""


class StagedWriteError(InvalidArgumentError):
    """A staged edit cannot be applied: nothing was written, and every staged edit is still staged.

    Attributes
    ----------
    edits : tuple of int
        The positions (staging order, as ``pending_writes()`` lists them) of every bad edit of ``tensor``;
        ``tensor.discard_staged(err.edits)`` drops exactly those.
    tensor : StagedWriteTensor or None
        The tensor whose edits they are.
    position : int
        The first bad edit's position (``edits[0]``); ``index`` and ``start`` are its row and start column.
    by_tensor : tuple of (StagedWriteTensor, tuple of int)
        Every tensor with bad edits and their positions: one pair from ``apply_write``, one per such tensor
        from ``FusedStagedWriter.apply`` (``for t, edits in err.by_tensor: t.discard_staged(edits)``).
    """

    _what = ""
    """The first bad edit and why, without what to do (a fused apply's error quotes it per tensor)."""

    def __init__(
        self,
        message: str,
        position: int,
        index: int,
        start: int,
        edits: tuple[int, ...] | None = None,
        tensor: Any = None,
        by_tensor: tuple[tuple[Any, tuple[int, ...]], ...] | None = None,
    ):
        super().__init__(message)
        self.position = position
        self.index = index
        self.start = start
        self.edits = (position,) if edits is None else edits
        self.tensor = tensor
        self.by_tensor = ((tensor, self.edits),) if by_tensor is None else by_tensor


class ReadOnlyAttributeError(StagebufError, AttributeError):
    """A write to an attribute that stagebuf would ignore (it is fixed at construction)."""


class UnknownAttributeError(StagebufError, AttributeError):
    """A read of an attribute that a public object (or the module ``stagebuf``) does not have; the message
    names its public attributes and, where the name is close to one, what to write instead."""


class NotCopyableError(StagebufError, TypeError):
    """``copy.copy``, ``copy.deepcopy`` or pickling of an object that owns buffers, slots or device memory: a
    copy would share its slots or read back zeros. The message says what to make instead."""


class UnknownFieldError(StagebufError, KeyError):
    """``DeviceParamTable[name]`` for a name that is not one of its fields."""


class CudaError(StagebufError, RuntimeError):
    """A CUDA runtime call that stagebuf makes directly (events, through cuda-bindings) failed."""
