"""Stand-ins for flash-attn's ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` as nano-vllm calls
them, for the end-to-end benchmark on machines where flash-attn does not install.

Both take flash-attn's keyword names and follow its documented semantics: grouped-query attention, a
bottom-right aligned causal mask (a query that sees no key gives zeros), ``softmax_scale`` defaulting to
``D ** -0.5``, softmax in float32, the output in the query's dtype; any other flash-attn argument only at
its default (else ``NotImplementedError``). On CUDA they run one Triton kernel that reads no device value
on the host and sizes its grid from shapes alone, so a decode call can be captured in a CUDA graph; a
padded row (``cache_seqlens == 0``, its block table row ``-1``) reads nothing and gives zeros. On the CPU
they run the kernel in Triton's interpreter under ``TRITON_INTERPRET=1``, else the plain-torch references
``reference_varlen`` and ``reference_kvcache``. ``install(module)`` binds flash-attn's own functions where
it imports, else these; ``backend()`` names which.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

try:
    import triton.language as tl
except ImportError:  # the references still run (the CPU path)
    tl = None

STAND_IN_MARK = "__stagebuf_stand_in__"
"""The attribute a stub ``flash_attn`` module carries: ``backend()`` does not take it for flash-attn."""

HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Query/key/value dtypes (flash-attn takes the first two; float32 is for tests)."""

PREFILL_BLOCK_M = 64
"""Query rows per program in a varlen call."""
DECODE_BLOCK_M = 16
"""Rows per program in a kvcache call: (query position, query head of the key head's group) pairs."""
BLOCK_N = 64
"""Keys per iteration (head dim <= 128; half above), halved until it divides the page size (>= 16)."""
NUM_WARPS = 4
NUM_STAGES = 3

_LOG2E = 1.4426950408889634

# ---------------------------------------------------------------------------------------------- kernel


# Triton reads a kernel's parameter annotations (they select its specialisation): leave them off.
def _attention_kernel(  # type: ignore[no-untyped-def]
    Q, K, V, Out, cu_q, cu_k, seqlens_k, table,
    qk_scale,  # softmax_scale * log2(e): the softmax runs in base 2
    seqlen_q_decode,  # DECODE: queries per sequence
    stride_qb, stride_qt, stride_qh,
    stride_ob, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    # Program (m, b, x). DECODE (flash_attn_with_kvcache): x is a key head; row r of the program's rows is
    # query position r // GROUP of sequence b for query head x * GROUP + r % GROUP (the group shares its
    # keys, read once); seqlen_k is seqlens_k[b]. Else (varlen): x is a query head, rows are the query
    # positions of sequence b (cu_q), keys from cu_k. PAGED: key j of sequence b is at page
    # table[b, j // PAGE], slot j % PAGE (BLOCK_N divides PAGE, so one page per key block). INTERPRET
    # (Triton's interpreter): the dots' operands in float32, as they were rounded (it multiplies bf16 as
    # integers), and the row reductions by their combine functions, which it runs in numpy: tl.max, tl.sum
    # (and tl.zeros, hence tl.full) are jit functions, which it cannot call where Triton was imported
    # before TRITON_INTERPRET=1 was set.
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


_kernels: dict[bool, Any] = {}


def _kernel(interpret: bool) -> Any:
    """The kernel as Triton's ``JITFunction`` or, with ``interpret``, its CPU ``InterpretedFunction``
    (chosen per call, so one process can run both; made once each)."""
    k = _kernels.get(interpret)
    if k is None:
        if tl is None:
            raise RuntimeError("the Triton stand-in for flash-attn needs triton")
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            k = InterpretedFunction(_attention_kernel)
        else:
            from triton.runtime.jit import JITFunction

            k = JITFunction(_attention_kernel)
        _kernels[interpret] = k
    return k


# ---------------------------------------------------------------------------------------- arguments

_VARLEN_DEFAULTS: dict[str, Any] = {
    "dropout_p": 0.0,
    "window_size": (-1, -1),
    "softcap": 0.0,
    "alibi_slopes": None,
    "deterministic": False,
    "return_attn_probs": False,
}
_KVCACHE_DEFAULTS: dict[str, Any] = {
    "k": None,
    "v": None,
    "rotary_cos": None,
    "rotary_sin": None,
    "cache_batch_idx": None,
    "cache_leftpad": None,
    "window_size": (-1, -1),
    "softcap": 0.0,
    "rotary_interleaved": True,
    "alibi_slopes": None,
    "num_splits": 0,
    "return_softmax_lse": False,
}


def _only_defaults(kwargs: dict[str, Any], defaults: dict[str, Any], fn: str) -> None:
    for name, value in kwargs.items():
        if name not in defaults:
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
        default = defaults[name]
        same = (
            value is None if default is None else isinstance(value, (int, float, tuple)) and value == default
        )
        if name == "window_size" and isinstance(value, list):
            same = tuple(value) == default
        if not same:
            got = f"a tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"{fn}: {name}={got} (the stand-in takes {default!r} only)")


def _check_index(t: Any, name: str, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != ndim:
        raise ValueError(f"{name} must be an int32 tensor of {ndim} dims")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the query on {device}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_dims: int, k_dims: int) -> None:
    for name, t, n in (("q", q, q_dims), ("k", k, k_dims), ("v", v, k_dims)):
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
    h, h_kv = q.shape[-2], k.shape[-2]
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"{h} query heads are not a multiple of {h_kv} key heads")


def _scale(softmax_scale: float | None, d: int) -> float:
    return float(d**-0.5 if softmax_scale is None else softmax_scale)


def _block_n(d: int, page: int | None) -> int:
    n = max(BLOCK_N if d <= 128 else BLOCK_N // 2, 16)
    if page is not None:
        while n > 16 and page % n:
            n //= 2
        if page % n:
            raise NotImplementedError(f"page size {page} (the stand-in takes multiples of 16)")
    return n


def _use_kernel(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _new_out(q: torch.Tensor) -> torch.Tensor:
    """The kernel's output tensor, uninitialised (tests poison it through this)."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _last1(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------- the calls


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
    """Attention over packed sequences: ``q`` [total_q, H, D]; ``k``, ``v`` [total_k, H_kv, D] packed the
    same way (``cu_seqlens_k``), or with ``block_table`` [B, max_blocks] the paged caches
    [num_blocks, page, H_kv, D]. Returns [total_q, H, D] in ``q``'s dtype."""
    _only_defaults(kwargs, _VARLEN_DEFAULTS, "flash_attn_varlen_func")
    paged = block_table is not None
    _check_qkv(q, k, v, 3, 4 if paged else 3)
    _check_index(cu_seqlens_q, "cu_seqlens_q", 1, q.device)
    _check_index(cu_seqlens_k, "cu_seqlens_k", 1, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0 or cu_seqlens_k.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, cu_seqlens_k {tuple(cu_seqlens_k.shape)}"
        )
    if block_table is not None:
        _check_index(block_table, "block_table", 2, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for {batch} sequences")
    if not _use_kernel(q.device):
        return reference_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=softmax_scale, causal=causal, block_table=block_table,
        )  # fmt: skip
    q, k, v = _last1(q), _last1(k), _last1(v)
    out = _new_out(q)
    h, d = q.shape[1], q.shape[2]
    if batch == 0 or q.shape[0] == 0 or max_seqlen_q <= 0:
        return out.zero_()
    block_n = _block_n(d, k.shape[1] if paged else None)
    grid = (-(-int(max_seqlen_q) // PREFILL_BLOCK_M), batch, h)
    if paged:
        assert block_table is not None
        table, stride_tb, page = block_table, block_table.stride(0), k.shape[1]
        kb, kt, kh = k.stride(0), k.stride(1), k.stride(2)
        vb, vt, vh = v.stride(0), v.stride(1), v.stride(2)
    else:
        table, stride_tb, page = cu_seqlens_k, 0, block_n
        kb, kt, kh = 0, k.stride(0), k.stride(1)
        vb, vt, vh = 0, v.stride(0), v.stride(1)
    _launch(
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k, table, grid,
        _scale(softmax_scale, d), 1,
        (0, q.stride(0), q.stride(1)), (0, out.stride(0), out.stride(1)),
        (kb, kt, kh), (vb, vt, vh), stride_tb,
        group=h // k.shape[-2], page=page, block_m=PREFILL_BLOCK_M, block_n=block_n,
        decode=False, paged=paged, causal=bool(causal),
    )  # fmt: skip
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
    """Attention of ``q`` [B, S, H, D] over a cache: ``k_cache``, ``v_cache`` [num_blocks, page, H_kv, D]
    through ``block_table`` [B, max_blocks], or [B, max_len, H_kv, D] without one; sequence ``b`` has
    ``cache_seqlens[b]`` keys (int32 [B]). Returns [B, S, H, D] in ``q``'s dtype. Graph-capturable."""
    _only_defaults(kwargs, _KVCACHE_DEFAULTS, "flash_attn_with_kvcache")
    _check_qkv(q, k_cache, v_cache, 4, 4)
    if cache_seqlens is None or not isinstance(cache_seqlens, torch.Tensor):
        raise NotImplementedError("cache_seqlens: the stand-in takes an int32 tensor [B] only")
    _check_index(cache_seqlens, "cache_seqlens", 1, q.device)
    batch, s, h, d = q.shape
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries for {batch} sequences")
    paged = block_table is not None
    if block_table is not None:
        _check_index(block_table, "block_table", 2, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for {batch} sequences")
    elif k_cache.shape[0] != batch:
        raise ValueError(f"k_cache has {k_cache.shape[0]} sequences for {batch} (no block_table)")
    if not _use_kernel(q.device):
        return reference_kvcache(
            q, k_cache, v_cache,
            cache_seqlens=cache_seqlens, block_table=block_table, softmax_scale=softmax_scale, causal=causal,
        )  # fmt: skip
    q, k_cache, v_cache = _last1(q), _last1(k_cache), _last1(v_cache)
    out = _new_out(q)
    if batch == 0 or s == 0:
        return out
    h_kv = k_cache.shape[2]
    group = h // h_kv
    block_n = _block_n(d, k_cache.shape[1] if paged else None)
    grid = (-(-(s * group) // DECODE_BLOCK_M), batch, h_kv)
    table = block_table if block_table is not None else cache_seqlens
    _launch(
        q, k_cache, v_cache, out, cache_seqlens, cache_seqlens, cache_seqlens, table, grid,
        _scale(softmax_scale, d), s,
        q.stride()[:3], out.stride()[:3], k_cache.stride()[:3], v_cache.stride()[:3],
        table.stride(0) if paged else 0,
        group=group, page=k_cache.shape[1] if paged else block_n, block_m=DECODE_BLOCK_M, block_n=block_n,
        decode=True, paged=paged, causal=bool(causal),
    )  # fmt: skip
    return out


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    seqlens_k: torch.Tensor,
    table: torch.Tensor,
    grid: tuple[int, int, int],
    scale: float,
    seqlen_q_decode: int,
    q_strides: tuple[int, ...],
    o_strides: tuple[int, ...],
    k_strides: tuple[int, ...],
    v_strides: tuple[int, ...],
    stride_tb: int,
    *,
    group: int,
    page: int,
    block_m: int,
    block_n: int,
    decode: bool,
    paged: bool,
    causal: bool,
) -> None:
    interpret = q.device.type != "cuda"
    kernel = _kernel(interpret)
    args = (
        q, k, v, out, cu_q, cu_k, seqlens_k, table, scale * _LOG2E, seqlen_q_decode,
        *q_strides, *o_strides, *k_strides, *v_strides, stride_tb,
    )  # fmt: skip
    consts = dict(
        GROUP=group,
        HEAD_DIM=q.shape[-1],
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DECODE=decode,
        PAGED=paged,
        CAUSAL=causal,
        PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32",
        INTERPRET=interpret,
    )
    if interpret:
        kernel[grid](*args, **consts)
        return
    with torch.cuda.device(q.device):
        kernel[grid](*args, **consts, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


# ---------------------------------------------------------------------------------------- references


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence in float32: ``q`` [s_q, H, D], ``k``, ``v`` [s_k, H_kv, D] -> [s_q, H, D]."""
    s_q, h, _ = q.shape
    s_k, h_kv, _ = k.shape
    if s_k == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qf, kf, vf = q.float(), k.float(), v.float()
    kf = kf.repeat_interleave(h // h_kv, dim=1)
    vf = vf.repeat_interleave(h // h_kv, dim=1)
    scores = torch.einsum("ihd,jhd->hij", qf, kf) * scale
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(s_q, device=q.device)[:, None]
        j = torch.arange(s_k, device=q.device)[None, :]
        keep = j <= i + (s_k - s_q)
    scores = scores.masked_fill(~keep, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp_min(-1e30)  # a row with no key: -inf, not NaN
    p = torch.exp(scores - top)
    total = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("hij,jhd->ihd", p, vf)


def _paged_keys(cache: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` keys of a sequence whose pages are ``pages`` (a block table row), [n, H_kv, D]."""
    page = cache.shape[1]
    used = pages[: -(-n // page)].long()
    return cache[used].reshape(-1, *cache.shape[2:])[:n]


def reference_varlen(
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
    """``flash_attn_varlen_func`` in plain torch, one sequence at a time (reads the index tensors)."""
    _only_defaults(kwargs, _VARLEN_DEFAULTS, "reference_varlen")
    scale = _scale(softmax_scale, q.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        n = ck[b + 1] - ck[b]
        if block_table is None:
            kb, vb = k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
        else:
            kb, vb = _paged_keys(k, block_table[b], n), _paged_keys(v, block_table[b], n)
        out[cq[b] : cq[b + 1]] = _attend(q[cq[b] : cq[b + 1]], kb, vb, scale, causal)
    return out.to(q.dtype)


def reference_kvcache(
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
    """``flash_attn_with_kvcache`` in plain torch, one sequence at a time (reads the index tensors)."""
    _only_defaults(kwargs, _KVCACHE_DEFAULTS, "reference_kvcache")
    if cache_seqlens is None:
        raise NotImplementedError("cache_seqlens: the stand-in takes an int32 tensor [B] only")
    scale = _scale(softmax_scale, q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(cache_seqlens.tolist()):
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            kb, vb = _paged_keys(k_cache, block_table[b], n), _paged_keys(v_cache, block_table[b], n)
        out[b] = _attend(q[b], kb, vb, scale, causal)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------- binding


def _flash_attn() -> ModuleType | None:
    """The real ``flash_attn`` with both functions, or None (missing, broken, or a stand-in stub)."""
    try:
        mod = importlib.import_module("flash_attn")
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    if getattr(mod, STAND_IN_MARK, False):
        return None
    if not (hasattr(mod, "flash_attn_varlen_func") and hasattr(mod, "flash_attn_with_kvcache")):
        return None
    return mod


def backend() -> str:
    """``"flash-attn <version>"`` where the real ``flash_attn`` imports (a module without
    ``__stagebuf_stand_in__``), else ``"triton stand-in"``."""
    mod = _flash_attn()
    if mod is None:
        return "triton stand-in"
    return f"flash-attn {getattr(mod, '__version__', '?')}"


def install(module: ModuleType) -> str:
    """Bind ``module.flash_attn_varlen_func`` and ``module.flash_attn_with_kvcache`` (nano-vllm's
    ``nanovllm.layers.attention``) to flash-attn's where it imports, else to the stand-ins; returns
    ``backend()``."""
    mod = _flash_attn()
    varlen: Callable[..., Any] = flash_attn_varlen_func
    kvcache: Callable[..., Any] = flash_attn_with_kvcache
    if mod is not None:
        varlen, kvcache = mod.flash_attn_varlen_func, mod.flash_attn_with_kvcache
    module.flash_attn_varlen_func = varlen  # type: ignore[attr-defined]
    module.flash_attn_with_kvcache = kvcache  # type: ignore[attr-defined]
    return backend()
