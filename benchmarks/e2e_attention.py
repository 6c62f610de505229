"""Stand-ins for flash-attn's ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` as nano-vllm calls
them, for the end-to-end benchmark where flash-attn does not install.

Both follow flash-attn's semantics (grouped-query attention, a bottom-right aligned causal mask, softmax in
float32; another argument raises ``NotImplementedError``) in one Triton kernel that reads no device value on
the host (a decode call can be captured in a CUDA graph), interpreted on a CPU (``TRITON_INTERPRET=1``).
``install(module)`` binds flash-attn's own functions where it imports, else these.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from types import ModuleType
from typing import Any

import torch

try:
    import triton.language as tl
except ImportError:  # (the kernel is defined all the same; running it needs Triton)
    tl = None

STAND_IN_MARK = "__stagebuf_stand_in__"  # A stub ``flash_attn`` module's attribute: not flash-attn.

HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # flash-attn takes the first two; float32: tests

PREFILL_BLOCK_M = 64  # Query rows per program in a varlen call.
DECODE_BLOCK_M = 16  # Rows per program in a kvcache call: (query position, query head of the group) pairs.
BLOCK_N = 64  # Keys per iteration (head dim <= 128; half above), halved until it divides the page size.
NUM_WARPS = 4
NUM_STAGES = 3

_LOG2E = 1.4426950408889634

# ---------------------------------------------------------------------------------------------- kernel


# Triton reads a kernel's parameter annotations (they select its specialisation): leave them off.
def _attention_kernel(
    Q,
    K,
    V,
    Out,
    cu_q,
    cu_k,
    seqlens_k,
    table,
    qk_scale,
    seqlen_q_decode,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Program (m, b, x). DECODE (flash_attn_with_kvcache): x is a key head; row r is query position r // GROUP
    # of sequence b for query head x * GROUP + r % GROUP (the group reads its keys once). Else (varlen): x is
    # a query head, rows are sequence b's query positions (cu_q), keys from cu_k. PAGED: key j of sequence b
    # is at page table[b, j // PAGE], slot j % PAGE. INTERPRET (Triton's interpreter): the dots' operands in
    # float32 (it multiplies bf16 as integers) and the row reductions by their combine functions (tl.max,
    # tl.sum, tl.zeros are jit functions it cannot call where Triton was imported before TRITON_INTERPRET=1).
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    x = tl.program_id(2)
    b64 = b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if DECODE:
        kvh = x
        seqlen_q = seqlen_q_decode
        seqlen_k = tl.load(seqlens_k + b)
        n_rows = seqlen_q * GROUP
        pos = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        last_pos = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
        q_base = b64 * stride_qb
        o_base = b64 * stride_ob
        k_base = b64 * stride_kb
        v_base = b64 * stride_vb
    else:
        kvh = x // GROUP
        q_start = tl.load(cu_q + b)
        seqlen_q = tl.load(cu_q + b + 1) - q_start
        k_start = tl.load(cu_k + b)
        seqlen_k = tl.load(cu_k + b + 1) - k_start
        n_rows = seqlen_q
        pos = offs_m
        head = x + 0 * offs_m
        last_pos = tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1
        q_base = q_start.to(tl.int64) * stride_qt
        o_base = q_start.to(tl.int64) * stride_ot
        k_base = k_start.to(tl.int64) * stride_kt
        v_base = k_start.to(tl.int64) * stride_vt
    if pid_m * BLOCK_M >= n_rows:
        return
    row_ok = offs_m < n_rows
    q = tl.load(
        Q + q_base + pos[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if INTERPRET:
        q = q.to(tl.float32)
    # Keys past the block's last row's causal limit are masked for every row: the loop stops before them.
    hi = seqlen_k
    if CAUSAL:
        hi = tl.minimum(seqlen_k, last_pos + 1 + seqlen_k - seqlen_q)
    # m_i starts finite: a row whose keys are all masked so far keeps p = 0 and alpha = 1, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    offs_j = tl.arange(0, BLOCK_N)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_j
        key_ok = offs_n < seqlen_k
        if PAGED:
            page = tl.load(table + b64 * stride_tb + start_n // PAGE).to(tl.int64)
            slot = start_n % PAGE + offs_j
            k_ptrs = K + page * stride_kb + slot[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None]
            v_ptrs = V + page * stride_vb + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        else:
            k_ptrs = K + k_base + offs_n[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None]
            v_ptrs = V + v_base + offs_n[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
        if INTERPRET:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        ok = key_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= pos[:, None] + (seqlen_k - seqlen_q))
        s = tl.where(ok, s, float("-inf"))
        if INTERPRET:
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        if INTERPRET:
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        pv = p.to(V.dtype.element_ty)
        if INTERPRET:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        Out + o_base + pos[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The kernel as Triton's ``JITFunction``, or (``interpret``) its ``InterpretedFunction``."""
    if tl is None:
        raise RuntimeError("the Triton stand-in for flash-attn needs triton")
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_attention_kernel)
    from triton.runtime.jit import JITFunction

    return JITFunction(_attention_kernel)


# ---------------------------------------------------------------------------------------- the calls


def _check_index(t: Any, name: str, ndim: int, device: torch.device, rows: int | None = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != ndim:
        raise ValueError(f"{name} must be an int32 tensor of {ndim} dims")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the query on {device}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows for {rows} sequences")


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: tuple[int, int], kwargs: dict[str, Any], fn: str
) -> None:
    """Shapes and dtypes flash-attn takes, and no argument it would take that the stand-in does not."""
    if kwargs:
        raise NotImplementedError(f"{fn}: {', '.join(kwargs)} (the stand-in takes flash-attn's defaults)")
    for name, t, n in (("q", q, dims[0]), ("k", k, dims[1]), ("v", v, dims[1])):
        if not isinstance(t, torch.Tensor) or t.dim() != n:
            raise ValueError(f"{name} must be a tensor of {n} dims")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q {q.dtype} on {q.device}")
    if q.dtype not in DTYPES:
        raise NotImplementedError(f"dtype {q.dtype} (the stand-in takes {DTYPES})")
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise NotImplementedError(f"head dim {d} (the stand-in takes {HEAD_DIMS})")
    if k.shape != v.shape or k.shape[-1] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must match, with head dim {d}")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{q.shape[-2]} query heads are not a multiple of {k.shape[-2]} key heads")


def _block_n(d: int, page: int | None) -> int:
    n = max(BLOCK_N if d <= 128 else BLOCK_N // 2, 16)
    while page is not None and n > 16 and page % n:
        n //= 2
    if page is not None and page % n:
        raise NotImplementedError(f"page size {page} (the stand-in takes multiples of 16)")
    return n


def _new_out(q: torch.Tensor) -> torch.Tensor:
    """The kernel's output tensor, uninitialised (tests poison it through this)."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _last1(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_table: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Attention over packed sequences (``block_table``: paged caches); [total_q, H, D] in q's dtype."""
    paged = block_table is not None
    _check(q, k, v, (3, 4 if paged else 3), kwargs, "flash_attn_varlen_func")
    batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else -1
    _check_index(cu_seqlens_q, "cu_seqlens_q", 1, q.device)
    _check_index(cu_seqlens_k, "cu_seqlens_k", 1, q.device, batch + 1)
    if block_table is not None:
        _check_index(block_table, "block_table", 2, q.device, batch)
    q, k, v = _last1(q), _last1(k), _last1(v)
    out, (h, d) = _new_out(q), q.shape[1:]
    if batch == 0 or q.shape[0] == 0 or max_seqlen_q <= 0:
        return out.zero_()
    block_n = _block_n(d, k.shape[1] if paged else None)
    if block_table is not None:
        table, stride_tb, page = block_table, block_table.stride(0), k.shape[1]
        kb, vb = k.stride(), v.stride()
    else:
        table, stride_tb, page, kb, vb = cu_seqlens_k, 0, block_n, (0, *k.stride()), (0, *v.stride())
    grid = (-(-int(max_seqlen_q) // PREFILL_BLOCK_M), batch, h)
    strides = (0, *q.stride()[:2], 0, *out.stride()[:2], *kb[:3], *vb[:3], stride_tb)
    sizes = {"GROUP": h // k.shape[-2], "PAGE": page, "BLOCK_M": PREFILL_BLOCK_M, "BLOCK_N": block_n}
    flags = {"DECODE": False, "PAGED": paged, "CAUSAL": bool(causal)}
    tensors = (q, k, v, out, cu_seqlens_q, cu_seqlens_k, table)
    _launch(grid, tensors, softmax_scale, 1, strides, sizes | flags)
    return out


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """Attention of ``q`` [B, S, H, D] over a (paged) cache of ``cache_seqlens`` keys; graph-capturable."""
    _check(q, k_cache, v_cache, (4, 4), kwargs, "flash_attn_with_kvcache")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise NotImplementedError("cache_seqlens: the stand-in takes an int32 tensor [B] only")
    batch, s, h, d = q.shape
    _check_index(cache_seqlens, "cache_seqlens", 1, q.device, batch)
    paged = block_table is not None
    if block_table is not None:
        _check_index(block_table, "block_table", 2, q.device, batch)
    elif k_cache.shape[0] != batch:
        raise ValueError(f"k_cache has {k_cache.shape[0]} sequences for {batch} (no block_table)")
    q, k_cache, v_cache = _last1(q), _last1(k_cache), _last1(v_cache)
    out = _new_out(q)
    if batch == 0 or s == 0:
        return out
    group = h // k_cache.shape[2]
    block_n = _block_n(d, k_cache.shape[1] if paged else None)
    table = block_table if block_table is not None else cache_seqlens
    grid = (-(-(s * group) // DECODE_BLOCK_M), batch, k_cache.shape[2])
    kv = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    strides = (*q.stride()[:3], *out.stride()[:3], *kv, table.stride(0) if paged else 0)
    page = k_cache.shape[1] if paged else block_n
    sizes = {"GROUP": group, "PAGE": page, "BLOCK_M": DECODE_BLOCK_M, "BLOCK_N": block_n}
    flags = {"DECODE": True, "PAGED": paged, "CAUSAL": bool(causal)}
    tensors = (q, k_cache, v_cache, out, cache_seqlens, cache_seqlens, table)
    _launch(grid, tensors, softmax_scale, s, strides, sizes | flags)
    return out


def _launch(
    grid: tuple[int, ...],
    tensors: tuple[torch.Tensor, ...],
    softmax_scale: float | None,
    seqlen_q_decode: int,
    strides: tuple[int, ...],
    consts: dict[str, Any],
) -> None:
    """The kernel on ``grid``: q, k, v, out, cu_q, seqlens_k and table, its strides and constants."""
    q, k, v, out, cu_q, seqlens_k, table = tensors
    interpret = q.device.type != "cuda"
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        why = f"the stand-in on {q.device} runs in Triton's interpreter: set TRITON_INTERPRET=1"
        raise NotImplementedError(why)
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale) * _LOG2E
    args = (q, k, v, out, cu_q, seqlens_k, seqlens_k, table, scale, seqlen_q_decode, *strides)
    precision = "ieee" if q.dtype == torch.float32 or interpret else "tf32"
    consts = consts | {"HEAD_DIM": q.shape[-1], "PRECISION": precision, "INTERPRET": interpret}
    if interpret:
        _kernel(True)[grid](*args, **consts)
        return
    with torch.cuda.device(q.device):
        _kernel(False)[grid](*args, **consts, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


# ---------------------------------------------------------------------------------------- binding


NAMES = ("flash_attn_varlen_func", "flash_attn_with_kvcache")


def _flash_attn() -> ModuleType | None:
    """The real ``flash_attn`` with both functions, or None (missing, broken, or a stand-in stub)."""
    try:
        mod = importlib.import_module("flash_attn")
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    real = not getattr(mod, STAND_IN_MARK, False) and all(hasattr(mod, n) for n in NAMES)
    return mod if real else None


def backend() -> str:
    """``"flash-attn <version>"`` where the real ``flash_attn`` imports, else ``"triton stand-in"``."""
    mod = _flash_attn()
    return "triton stand-in" if mod is None else f"flash-attn {getattr(mod, '__version__', '?')}"


def install(module: ModuleType) -> str:
    """Bind ``module``'s two flash-attn functions to flash-attn's, else the stand-ins; ``backend()``."""
    source = _flash_attn() or sys.modules[__name__]
    for n in NAMES:
        setattr(module, n, getattr(source, n))
    return backend()
