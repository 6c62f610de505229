"""The staged-write Triton kernel and its launcher: a packed metadata row per edit (target base address,
flat offset of the first element, length, source offset), so several targets go through one launch with no
table to keep on the device. The grid is (edits, programs per edit): a long edit's columns are spread over
several programs (a lone long edit, a prompt read from host memory on UVA, is then no serial loop).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..._common.log import warn_once

MIN_BLOCK = 16
MAX_BLOCK = 1024
"""Columns one Triton program writes per iteration (a power of two in [MIN_BLOCK, MAX_BLOCK])."""
SPREAD = 1 << 10
"""Programs a launch's edits are spread over, at most, where edits are longer than a block: each edit gets
``SPREAD // edits`` (at least one, at most one per block of its longest edit's columns)."""

tl: Any = None  # triton.language, imported on first use (importing stagebuf stays cheap)
_triton_error: list[str] = []
_knobs: Any = None
"""``triton.knobs.runtime`` (its launch hooks), once Triton is imported."""


def _triton_available() -> bool:
    global tl
    if tl is not None:
        return True
    if _triton_error:
        return False
    try:
        import triton.language as _tl
    except Exception as e:  # not installed, or broken
        _triton_error.append(f"{type(e).__name__}: {e}"[:200])
        return False
    tl = _tl
    global _knobs
    _knobs = _runtime_knobs()
    return True


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernel can run on ``device`` (CUDA, or the CPU interpreter)."""
    if device.type == "cuda":
        return _triton_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _triton_available()


# Triton reads a kernel's parameter annotations (they select its specialisation): leave them off.
def _staged_write_kernel(meta, content, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # Program (e, p) of (edits, P) writes blocks p, p + P, ... of edit e; meta row: target address, flat
    # offset of the first element, length, source offset.
    e = tl.program_id(0)
    base = tl.load(meta + 4 * e).to(tl.pointer_type(content.dtype.element_ty))
    dst = tl.load(meta + 4 * e + 1)
    ln = tl.load(meta + 4 * e + 2)
    src = tl.load(meta + 4 * e + 3)
    cols = tl.arange(0, BLOCK)
    c0 = tl.program_id(1) * BLOCK
    stride = tl.num_programs(1) * BLOCK
    while c0 < ln:
        m = c0 + cols < ln
        v = tl.load(content + src + c0 + cols, mask=m)
        tl.store(base + dst + c0 + cols, v, mask=m)
        c0 += stride


_triton_functions: dict[tuple[Callable[..., None], bool], Any] = {}


def triton_function(fn: Callable[..., None], interpret: bool) -> Any:
    """The Triton kernel ``fn``: a ``JITFunction``, or with ``interpret`` an ``InterpretedFunction``
    (Triton's CPU interpreter); made once per (``fn``, ``interpret``)."""
    k = _triton_functions.get((fn, interpret))
    if k is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            k = InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction

            k = JITFunction(fn)
        _triton_functions[(fn, interpret)] = k
    return k


def _triton_kernel(interpret: bool) -> Any:
    return triton_function(_staged_write_kernel, interpret)


def why_no_triton(device: torch.device) -> str:
    """Why ``triton_usable(device)`` said no, and what would make it run."""
    if _triton_error:
        return _triton_error[0]
    if device.type == "cpu":
        return (
            "on the CPU only Triton's interpreter runs it: set TRITON_INTERPRET=1 before Python starts "
            "(slow: meant for tests), or unset STAGEBUF_WRITE_KERNEL"
        )
    return f"Triton has no backend for {device.type}; unset STAGEBUF_WRITE_KERNEL"


def _block_for(longest: int) -> int:
    """The power of two in [MIN_BLOCK, MAX_BLOCK] nearest above ``longest`` (MAX_BLOCK past it)."""
    # (comparisons, not min/max: this runs at every launch, and a builtin's call costs more than the rule)
    if longest <= MIN_BLOCK:
        return MIN_BLOCK
    return MAX_BLOCK if longest >= MAX_BLOCK else 1 << (longest - 1).bit_length()


def programs_per_edit(n_edits: int, longest: int, block: int) -> int:
    """The grid's second dimension: one program per ``block`` columns of the longest edit, at most
    ``SPREAD // n_edits`` (at least one)."""
    if longest <= block:
        return 1
    per = -(-longest // block)
    cap = SPREAD // n_edits if n_edits > 1 else SPREAD
    return per if per <= cap else cap or 1


_compiled: dict[tuple[Any, ...], Any] = {}
"""(device index, BLOCK, content dtype, both addresses 16-byte aligned) -> Triton's compiled kernel."""
_direct: list[bool] = [True]
"""Whether launches may skip Triton's dispatcher (off after a launcher that refused the call)."""


def launch_at(
    device: torch.device,
    meta_addr: int,
    content_addr: int,
    dtype: torch.dtype,
    n_edits: int,
    longest: int,
    tensors: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    block: int | None = None,
) -> None:
    """Launch the kernel over metadata and content at these device addresses (CPU: the interpreter), in
    programs of the power of two ``BLOCK`` columns that covers ``longest`` (the longest edit) within
    [``MIN_BLOCK``, ``MAX_BLOCK``] (or ``block``, where the caller fixes it), ``programs_per_edit`` of them an
    edit.

    The first launch of each specialisation (``key``: what Triton specialises these arguments on) goes
    through Triton's dispatcher, with the tensors ``tensors()`` makes; later ones call the compiled
    kernel's launcher directly (docs/DESIGN.md, "Staged writes"). A launch hook (a profiler) or a
    launcher that refuses the call sends every launch through the dispatcher.
    """
    if block is None:
        block = _block_for(longest)
    per = 1 if longest <= block else programs_per_edit(n_edits, longest, block)
    if device.type != "cuda":
        meta, content = tensors()
        _triton_kernel(interpret=True)[(n_edits, per)](meta, content, BLOCK=block)
        return
    key = (device.index, block, dtype, not (meta_addr | content_addr) & 15)
    k = _compiled.get(key) if _direct[0] else None
    current = torch.cuda.current_device() == device.index
    if k is not None and current and not _hooked():
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        try:
            k.run(
                n_edits, per, 1, stream, k.function, k.packed_metadata, None, None, None,
                meta_addr, content_addr, block,
            )  # fmt: skip
            return
        except TypeError as e:  # another Triton's launcher signature: the dispatcher from now on
            _direct[0] = False
            warn_once(("triton-direct",), f"staged-write launches go through Triton's dispatcher ({e})")
    meta, content = tensors()
    launch = _triton_kernel(interpret=False)[(n_edits, per)]
    warps = max(1, min(4, block // 128))
    if current:
        got = launch(meta, content, BLOCK=block, num_warps=warps)
    else:
        with torch.cuda.device(device):
            got = launch(meta, content, BLOCK=block, num_warps=warps)
    if current and _direct[0] and hasattr(got, "packed_metadata") and hasattr(got, "function"):
        _compiled[key] = got


def _hooked() -> bool:
    """Whether a launch hook is set (Triton's ``HookChain`` with calls, or a hook function)."""
    if _knobs is None:
        return True
    hook = _knobs.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


def _runtime_knobs() -> Any:
    try:
        from triton import knobs

        return knobs.runtime
    except Exception:  # an older Triton without knobs: launches go through the dispatcher
        return None
