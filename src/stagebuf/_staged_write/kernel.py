"""The staged-write Triton kernel, its launcher, and its plain-torch twin (the test oracle).

One program per edit reads a packed metadata row (target base address, flat offset
of the first element, length, source offset) and copies that edit's values, so
several targets go through one launch with no table to keep on the device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

MIN_BLOCK = 16
MAX_BLOCK = 1024
"""Columns one Triton program writes per iteration (a power of two in [MIN_BLOCK, MAX_BLOCK])."""

tl: Any = None  # triton.language, imported on first use (importing stagebuf stays cheap)
_triton_error: list[str] = []


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
    return True


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernel can run on ``device`` (CUDA, or the CPU interpreter)."""
    if device.type == "cuda":
        return _triton_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _triton_available()


# Triton reads a kernel's parameter annotations (they select its specialisation): leave them off.
def _staged_write_kernel(meta, content, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # One program per edit; meta row: target address, flat offset of the first element, length, source.
    e = tl.program_id(0)
    base = tl.load(meta + 4 * e).to(tl.pointer_type(content.dtype.element_ty))
    dst = tl.load(meta + 4 * e + 1)
    ln = tl.load(meta + 4 * e + 2)
    src = tl.load(meta + 4 * e + 3)
    cols = tl.arange(0, BLOCK)
    c0 = 0
    while c0 < ln:
        m = c0 + cols < ln
        v = tl.load(content + src + c0 + cols, mask=m)
        tl.store(base + dst + c0 + cols, v, mask=m)
        c0 += BLOCK


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


def _block_for(longest: int) -> int:
    b = MIN_BLOCK
    while b < longest and b < MAX_BLOCK:
        b *= 2
    return b


def _launch_triton(
    device: torch.device,
    meta: torch.Tensor,
    content: torch.Tensor,
    n_edits: int,
    block: int,
) -> None:
    if device.type == "cuda":
        launch = _triton_kernel(interpret=False)[(n_edits,)]
        warps = max(1, min(4, block // 128))
        if torch.cuda.current_device() == device.index:
            launch(meta, content, BLOCK=block, num_warps=warps)
        else:
            with torch.cuda.device(device):
                launch(meta, content, BLOCK=block, num_warps=warps)
    else:
        _triton_kernel(interpret=True)[(n_edits,)](meta, content, BLOCK=block)


def _torch_twin(
    flats: Sequence[torch.Tensor], addrs: Sequence[int], meta: torch.Tensor, content: torch.Tensor
) -> None:
    """The Triton kernel in plain torch ops, on the same packed layout (its test oracle).

    ``flats[k]`` receives the edits whose meta row names the target address ``addrs[k]``.
    """
    n = content.shape[0]
    tid, dst, ln, src = meta.unbind(1)
    edit_of = torch.repeat_interleave(ln, output_size=n)
    j = torch.arange(n, device=content.device) - (torch.cumsum(ln, 0) - ln)[edit_of]
    dest, source, owner = dst[edit_of] + j, src[edit_of] + j, tid[edit_of]
    for flat, addr in zip(flats, addrs):
        sel = owner == addr
        flat.index_copy_(0, dest[sel], content[source[sel]])
