"""``benchmarks.e2e_attention``: the flash-attn stand-in's kernel against an independent model, and the
calls it refuses.

The model is dense attention on each sequence's own keys (the ones a case scatters into packed or paged
caches), through ``scaled_dot_product_attention`` in float64 with an explicit bottom-right causal mask.
On the CPU the Triton kernel runs in Triton's interpreter on small shapes with small tiles (several query
and key blocks a sequence); cache slots that hold no key, spare pages and the kernel's output start as
NaN, so a read out of place or a row left unwritten fails. The GPU tests run the compiled kernel at
nano-vllm's shape (16 query heads, 8 key heads, head dim 128, bf16, page 256), and a decode captured in
a CUDA graph replayed on new values written into its static tensors.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from benchmarks import e2e_attention as ea
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NAN = float("nan")
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def examples(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )


# --- cases: each sequence's own keys, laid out as a call takes them ------------------------------------


@dataclass
class Case:
    """One call's arguments (``kwargs``, with ``q`` first) and each sequence's queries and keys."""

    kwargs: dict[str, Any]
    queries: list[torch.Tensor]  # [s_q, H, D] each
    keys: list[torch.Tensor]  # [s_k, H_kv, D] each
    values: list[torch.Tensor]
    decode: bool

    def rows(self) -> Iterator[tuple[int, slice | int]]:
        """(sequence, its rows of the output: a slice of the packed rows, or the batch index)."""
        start = 0
        for b, q in enumerate(self.queries):
            if self.decode:
                yield b, b
            else:
                yield b, slice(start, start + q.shape[0])
                start += q.shape[0]


def _rand(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def _paged(keys: list[torch.Tensor], values: list[torch.Tensor], page: int, gen: torch.Generator,
           spare: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:  # fmt: skip
    """The sequences' keys and values in NaN-filled paged caches, on randomly permuted pages (``spare``
    pages left unused): the two caches and each sequence's pages."""
    need = [-(-k.shape[0] // page) for k in keys]
    order = torch.randperm(sum(need) + spare, generator=gen).tolist()
    k0 = keys[0]
    k_cache = torch.full((len(order), page, *k0.shape[1:]), NAN, dtype=k0.dtype, device=k0.device)
    v_cache = torch.full_like(k_cache, NAN)
    pages: list[list[int]] = []
    for k, v, n in zip(keys, values, need):
        mine, order = order[:n], order[n:]
        for i, p in enumerate(mine):
            at = slice(i * page, (i + 1) * page)
            k_cache[p, : k[at].shape[0]] = k[at]
            v_cache[p, : v[at].shape[0]] = v[at]
        pages.append(mine)
    return k_cache, v_cache, pages


def _table(pages: list[list[int]], device: str) -> torch.Tensor:
    """The block table: each sequence's pages, padded with -1 (one column more than the longest needs)."""
    width = max(len(p) for p in pages) + 1
    t = torch.full((len(pages), width), -1, dtype=torch.int32)
    for b, p in enumerate(pages):
        t[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
    return t.to(device)


def _cu(lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


Sequences = tuple[torch.Generator, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def _sequences(seed: int, seqlens_q: list[int], seqlens_k: list[int], h_kv: int, group: int, d: int,
               dtype: torch.dtype, device: str) -> Sequences:  # fmt: skip
    """Each sequence's random queries [n_q, H, D], keys and values [n_k, H_kv, D], from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    queries = [_rand(gen, (n, h_kv * group, d), dtype, device) for n in seqlens_q]
    keys = [_rand(gen, (n, h_kv, d), dtype, device) for n in seqlens_k]
    values = [_rand(gen, (n, h_kv, d), dtype, device) for n in seqlens_k]
    return gen, queries, keys, values


def varlen_case(seqlens_q: list[int], seqlens_k: list[int], h_kv: int, group: int, d: int, dtype: torch.dtype,
                page: int | None, seed: int, causal: bool = True, device: str = "cpu") -> Case:  # fmt: skip
    """A ``flash_attn_varlen_func`` call: packed keys (three NaN rows past the last), or with ``page``
    the paged caches and a block table."""
    gen, queries, keys, values = _sequences(seed, seqlens_q, seqlens_k, h_kv, group, d, dtype, device)
    kwargs: dict[str, Any] = {
        "q": torch.cat(queries),
        "max_seqlen_q": max(seqlens_q),
        "cu_seqlens_q": _cu(seqlens_q, device),
        "max_seqlen_k": max(seqlens_k),
        "cu_seqlens_k": _cu(seqlens_k, device),
        "softmax_scale": d**-0.5 * 1.3,
        "causal": causal,
    }
    if page is None:
        pad = torch.full((3, h_kv, d), NAN, dtype=dtype, device=device)
        kwargs.update(k=torch.cat([*keys, pad]), v=torch.cat([*values, pad]), block_table=None)
    else:
        k_cache, v_cache, pages = _paged(keys, values, page, gen, spare=2)
        kwargs.update(k=k_cache, v=v_cache, block_table=_table(pages, device))
    return Case(kwargs, queries, keys, values, decode=False)


def kvcache_case(seqlens_k: list[int], s: int, h_kv: int, group: int, d: int, dtype: torch.dtype,
                 page: int | None, seed: int, device: str = "cpu") -> Case:  # fmt: skip
    """A ``flash_attn_with_kvcache`` call of ``s`` queries a sequence: paged caches and a block table
    (rows of sequences without keys all -1), or without ``page`` a [B, longest + 2] NaN-padded cache."""
    gen, queries, keys, values = _sequences(
        seed, [s] * len(seqlens_k), seqlens_k, h_kv, group, d, dtype, device
    )
    kwargs: dict[str, Any] = {
        "q": torch.stack(queries),
        "cache_seqlens": torch.tensor(seqlens_k, dtype=torch.int32, device=device),
        "softmax_scale": d**-0.5,
        "causal": True,
    }
    if page is None:
        longest = max(seqlens_k) + 2
        k_cache = torch.full((len(keys), longest, h_kv, d), NAN, dtype=dtype, device=device)
        v_cache = torch.full_like(k_cache, NAN)
        for b, (kb, vb) in enumerate(zip(keys, values)):
            k_cache[b, : kb.shape[0]] = kb
            v_cache[b, : vb.shape[0]] = vb
        kwargs.update(k_cache=k_cache, v_cache=v_cache, block_table=None)
    else:
        k_cache, v_cache, pages = _paged(keys, values, page, gen, spare=2)
        kwargs.update(k_cache=k_cache, v_cache=v_cache, block_table=_table(pages, device))
    return Case(kwargs, queries, keys, values, decode=True)


def call(fn: Any, case: Case) -> torch.Tensor:
    kw = dict(case.kwargs)
    if case.decode:
        return fn(kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"), **kw)
    return fn(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


# --- the independent model -----------------------------------------------------------------------------


def model(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Dense attention of one sequence in float64: [s_q, H, D] over [s_k, H_kv, D]; a query that sees no
    key gives zeros (flash-attn's documented output for an all-masked row)."""
    s_q, h, d = q.shape
    s_k, h_kv = k.shape[0], k.shape[1]
    out = torch.zeros(s_q, h, d, dtype=torch.float64, device=q.device)
    if s_q == 0 or s_k == 0:
        return out
    kv_head = torch.arange(h, device=q.device) // (h // h_kv)
    qh = q.double().transpose(0, 1)  # [H, s_q, D]
    kh = k.double().transpose(0, 1)[kv_head]
    vh = v.double().transpose(0, 1)[kv_head]
    seen = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if causal:  # bottom-right: query i sees keys j - i <= s_k - s_q
        seen = torch.tril(seen, diagonal=s_k - s_q)
    got = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, scale=scale).transpose(0, 1)
    live = seen.any(dim=1)
    out[live] = got[live]
    return out


def paged_model(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                block_table: torch.Tensor, softmax_scale: float, causal: bool) -> torch.Tensor:  # fmt: skip
    """The model of a decode call over paged caches: each sequence's keys gathered from its pages."""
    page, out = k_cache.shape[1], torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(cache_seqlens.tolist()):
        used = block_table[b, : -(-n // page)].long()
        k, v = (c[used].reshape(-1, *c.shape[2:])[:n] for c in (k_cache, v_cache))
        out[b] = model(q[b], k, v, softmax_scale, causal)
    return out


def expected(case: Case) -> list[torch.Tensor]:
    scale, causal = case.kwargs["softmax_scale"], case.kwargs["causal"]
    return [model(q, k, v, scale, causal) for q, k, v in zip(case.queries, case.keys, case.values)]


def assert_close(out: torch.Tensor, ref: torch.Tensor, case: Case, tol: float) -> None:
    """Finite everywhere, and each sequence's rows within ``tol`` of ``ref``'s in relative norm."""
    assert out.shape == ref.shape and out.dtype == case.kwargs["q"].dtype
    assert torch.isfinite(out).all(), "an output row is NaN (unwritten, or a NaN slot was read)"
    for b, rows in case.rows():
        o, r = out[rows].double(), ref[rows].double()
        err, size = (o - r).norm().item(), r.norm().item()
        assert err <= tol * size + 1e-6, f"sequence {b}: error {err:.3g} against norm {size:.3g}"


def assert_model(out: torch.Tensor, case: Case, tol: float) -> None:
    ref = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    for (_, rows), m in zip(case.rows(), expected(case)):
        ref[rows] = m
    assert_close(out, ref, case, tol)


# --- strategies ------------------------------------------------------------------------------------------


@st.composite
def varlen_lengths(draw: st.DrawFn, paged: bool, most: int) -> tuple[list[int], list[int]]:
    """(seqlens_q, seqlens_k): paged, a prefix-cached prefill (s_k = prefix + s_q, no more than ``most``);
    else any lengths (s_k < s_q gives queries that see no key)."""
    n = draw(st.integers(1, 3))
    sq = [draw(st.integers(0, most)) for _ in range(n)]
    if sum(sq) == 0:
        sq[0] = 1
    if paged:
        sk = [q + draw(st.integers(0, most - q)) for q in sq]
    else:
        sk = [draw(st.integers(0, most)) for _ in range(n)]
    if max(sk) == 0:
        sk[0] = 1
    return sq, sk


@st.composite
def decode_lengths(draw: st.DrawFn, most: int) -> list[int]:
    """cache_seqlens of a padded decode batch: some rows (not all) may be 0."""
    lens = draw(st.lists(st.integers(0, most), min_size=1, max_size=4))
    if max(lens) == 0:
        lens[0] = 1
    return lens


# --- calls the stand-in refuses ---------------------------------------------------------------------


def test_on_the_cpu_without_the_interpreter_the_stand_in_says_so(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    v = varlen_case([5, 3], [7, 3], 2, 2, 16, torch.float32, 16, 1)
    d = kvcache_case([0, 9], 1, 2, 2, 16, torch.float32, 16, 2)
    for fn, case in ((ea.flash_attn_varlen_func, v), (ea.flash_attn_with_kvcache, d)):
        with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
            call(fn, case)


def test_other_flash_attn_arguments_are_refused_by_name() -> None:
    v = varlen_case([4], [4], 1, 2, 16, torch.float32, None, 0)
    d = kvcache_case([4], 1, 1, 2, 16, torch.float32, 16, 0)
    for name, value in [("dropout_p", 0.1), ("window_size", (8, 0)), ("softcap", 30.0), ("nonsense", 1)]:
        bad = Case({**v.kwargs, name: value}, v.queries, v.keys, v.values, False)
        with pytest.raises(NotImplementedError, match=name):
            call(ea.flash_attn_varlen_func, bad)
    for name, value in [
        ("k", d.kwargs["q"]),
        ("return_softmax_lse", True),
        ("cache_batch_idx", d.kwargs["q"]),
    ]:
        bad = Case({**d.kwargs, name: value}, d.queries, d.keys, d.values, True)
        with pytest.raises(NotImplementedError, match=name):
            call(ea.flash_attn_with_kvcache, bad)


def test_shapes_and_dtypes_are_checked() -> None:
    v = varlen_case([4], [4], 2, 2, 16, torch.float32, None, 0)
    with pytest.raises(NotImplementedError, match="head dim"):
        ea.flash_attn_varlen_func(
            v.kwargs["q"][..., :8], v.kwargs["k"][..., :8], v.kwargs["v"][..., :8], **_index_args(v)
        )
    with pytest.raises(ValueError, match="query heads"):
        ea.flash_attn_varlen_func(v.kwargs["q"][:, :3], v.kwargs["k"], v.kwargs["v"], **_index_args(v))
    with pytest.raises(ValueError, match="int32"):
        bad = {**_index_args(v), "cu_seqlens_q": v.kwargs["cu_seqlens_q"].long()}
        ea.flash_attn_varlen_func(v.kwargs["q"], v.kwargs["k"], v.kwargs["v"], **bad)
    with pytest.raises(ValueError, match="k "):
        ea.flash_attn_varlen_func(v.kwargs["q"], v.kwargs["k"].double(), v.kwargs["v"], **_index_args(v))
    with pytest.raises(ValueError, match="q must be a tensor of 3 dims"):
        ea.flash_attn_varlen_func(v.kwargs["q"][None], v.kwargs["k"], v.kwargs["v"], **_index_args(v))
    d = kvcache_case([4, 0], 1, 2, 2, 16, torch.float32, 16, 0)
    with pytest.raises(ValueError, match="cache_seqlens"):
        ea.flash_attn_with_kvcache(
            d.kwargs["q"], d.kwargs["k_cache"], d.kwargs["v_cache"],
            cache_seqlens=d.kwargs["cache_seqlens"][:1], block_table=d.kwargs["block_table"],
        )  # fmt: skip
    with pytest.raises(NotImplementedError, match="cache_seqlens"):
        ea.flash_attn_with_kvcache(
            d.kwargs["q"], d.kwargs["k_cache"], d.kwargs["v_cache"], block_table=d.kwargs["block_table"]
        )


def _index_args(case: Case) -> dict[str, Any]:
    return {k: case.kwargs[k] for k in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}


def _fake_flash_attn(**attrs: Any) -> types.ModuleType:
    mod = types.ModuleType("flash_attn")
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def test_backend_and_install_take_a_real_flash_attn_and_not_a_stub(monkeypatch) -> None:
    def real_varlen(*a: Any, **k: Any) -> None:
        return None

    def real_kvcache(*a: Any, **k: Any) -> None:
        return None

    target = types.ModuleType("nanovllm_attention_stand_in")
    stub = _fake_flash_attn(
        __stagebuf_stand_in__=True,
        flash_attn_varlen_func=ea.flash_attn_varlen_func,
        flash_attn_with_kvcache=ea.flash_attn_with_kvcache,
    )
    monkeypatch.setitem(sys.modules, "flash_attn", stub)
    assert ea.backend() == "triton stand-in"
    assert ea.install(target) == "triton stand-in"
    assert target.flash_attn_varlen_func is ea.flash_attn_varlen_func
    assert target.flash_attn_with_kvcache is ea.flash_attn_with_kvcache
    real = _fake_flash_attn(
        __version__="2.99.0", flash_attn_varlen_func=real_varlen, flash_attn_with_kvcache=real_kvcache
    )
    monkeypatch.setitem(sys.modules, "flash_attn", real)
    assert ea.backend() == "flash-attn 2.99.0"
    assert ea.install(target) == "flash-attn 2.99.0"
    assert target.flash_attn_varlen_func is real_varlen
    assert target.flash_attn_with_kvcache is real_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails: the stand-in
    assert ea.install(target) == "triton stand-in"
    assert target.flash_attn_with_kvcache is ea.flash_attn_with_kvcache


# --- the kernel in Triton's interpreter against the model ----------------------------------------------


@pytest.fixture
def small_tiles(monkeypatch, triton_interpreted) -> None:
    """The interpreter, small query tiles (sequences span several) and NaN-filled outputs."""
    monkeypatch.setattr(ea, "PREFILL_BLOCK_M", 16)
    monkeypatch.setattr(ea, "BLOCK_N", 16)
    monkeypatch.setattr(ea, "_new_out", lambda q: torch.full(q.shape, NAN, dtype=q.dtype, device=q.device))


DTYPE_GROUP = pytest.mark.parametrize(
    ("dtype", "group"), [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 1), (torch.bfloat16, 2)]
)


@DTYPE_GROUP
@examples(6)
@given(causal=st.booleans(), d=st.sampled_from([16, 32]), seed=st.integers(0, 2**31), data=st.data())
def test_interpreted_kernel_varlen(small_tiles, dtype, group, causal, d, seed, data) -> None:
    sq, sk = data.draw(varlen_lengths(False, 40))
    case = varlen_case(sq, sk, 2, group, d, dtype, None, seed, causal)
    assert_model(call(ea.flash_attn_varlen_func, case), case, TOL[dtype])


@DTYPE_GROUP
@examples(6)
@given(page=st.sampled_from([16, 32]), block_n=st.sampled_from([16, 32]), seed=st.integers(0, 2**31))
def test_interpreted_kernel_paged_prefix_prefill(small_tiles, monkeypatch, dtype, group, page, block_n, seed):
    monkeypatch.setattr(ea, "BLOCK_N", block_n)
    rng = torch.Generator().manual_seed(seed)
    sq = torch.randint(1, 36, (3,), generator=rng).tolist()
    prefix = [page * int(torch.randint(0, 2, (), generator=rng)) for _ in sq]  # whole cached pages
    prefix[0] += 5  # and one that is not
    sk = [p + q for p, q in zip(prefix, sq)]
    case = varlen_case(sq, sk, 2, group, 16, dtype, page, seed)
    assert_model(call(ea.flash_attn_varlen_func, case), case, TOL[dtype])


@DTYPE_GROUP
@examples(6)
@given(paged=st.booleans(), s=st.integers(1, 2), page=st.sampled_from([16, 32]), seed=st.integers(0, 2**31))
def test_interpreted_kernel_decode(small_tiles, dtype, group, paged, s, page, seed) -> None:
    rng = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 50, (4,), generator=rng).tolist()
    lens[int(torch.randint(0, 4, (), generator=rng))] = 0  # a padded row: no keys, its table row all -1
    case = kvcache_case(lens, s, 2, group, 32, dtype, page if paged else None, seed)
    if paged:
        assert (case.kwargs["block_table"][lens.index(0)] == -1).all()
    out = call(ea.flash_attn_with_kvcache, case)
    assert_model(out, case, TOL[dtype])
    assert (out[lens.index(0)] == 0).all()


def test_a_query_that_sees_no_key_gives_zeros(triton_interpreted) -> None:
    # s_q = 3 queries over 1 key: the first two see none (bottom-right causal)
    case = varlen_case([3], [1], 1, 1, 16, torch.float32, None, 0)
    out = call(ea.flash_attn_varlen_func, case)
    assert (out[:2] == 0).all() and (out[2] != 0).any()
    assert torch.allclose(out[2], case.values[0][0], atol=1e-6)  # the one key: its value, scaled by 1


def test_interpreted_kernel_matches_the_model_with_default_tiles(triton_interpreted, monkeypatch) -> None:
    monkeypatch.setattr(ea, "_new_out", lambda q: torch.full(q.shape, NAN, dtype=q.dtype, device=q.device))
    v = varlen_case([70, 3, 0], [90, 2, 5], 2, 2, 64, torch.float32, None, 5)
    assert_model(call(ea.flash_attn_varlen_func, v), v, 1e-3)
    p = varlen_case([70, 1], [70 + 128, 1], 1, 4, 32, torch.bfloat16, 128, 6)
    assert_model(call(ea.flash_attn_varlen_func, p), p, 1e-2)
    d = kvcache_case([0, 130, 64], 1, 2, 2, 128, torch.bfloat16, 64, 7)
    assert_model(call(ea.flash_attn_with_kvcache, d), d, 1e-2)


def test_a_page_that_is_not_a_multiple_of_16_is_refused_by_the_kernel(triton_interpreted) -> None:
    d = kvcache_case([9], 1, 1, 1, 16, torch.float32, 8, 0)
    with pytest.raises(NotImplementedError, match="page size 8"):
        call(ea.flash_attn_with_kvcache, d)


# --- GPU: the compiled kernel at nano-vllm's shape -----------------------------------------------------

H_KV, GROUP, D, PAGE = 8, 2, 128, 256


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_gpu_varlen_prefill() -> None:
    _cuda()
    case = varlen_case(
        [1, 17, 200, 513], [1, 17, 200, 513], H_KV, GROUP, D, torch.bfloat16, None, 11, device="cuda"
    )
    assert_model(call(ea.flash_attn_varlen_func, case), case, 1e-2)


@pytest.mark.gpu
def test_gpu_paged_prefix_prefill() -> None:
    _cuda()
    sq = [5, 300, 1, 64]
    sk = [q + p for q, p in zip(sq, [256, 512, 0, 256 + 100])]
    case = varlen_case(sq, sk, H_KV, GROUP, D, torch.bfloat16, PAGE, 12, device="cuda")
    assert_model(call(ea.flash_attn_varlen_func, case), case, 1e-2)


@pytest.mark.gpu
def test_gpu_decode() -> None:
    _cuda()
    gen = torch.Generator().manual_seed(13)
    lens = torch.randint(1, 800, (64,), generator=gen).tolist()
    lens[5] = lens[40] = 0
    case = kvcache_case(lens, 1, H_KV, GROUP, D, torch.bfloat16, PAGE, 13, device="cuda")
    out = call(ea.flash_attn_with_kvcache, case)
    assert_model(out, case, 1e-2)
    assert (out[5] == 0).all() and (out[40] == 0).all()


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph_on_new_values() -> None:
    _cuda()
    batch, width = 32, 4  # block table columns: up to 1024 keys
    first = kvcache_case([300] * batch, 1, H_KV, GROUP, D, torch.bfloat16, PAGE, 14, device="cuda")
    k_cache, v_cache = first.kwargs["k_cache"], first.kwargs["v_cache"]
    pages = k_cache.shape[0]
    q = first.kwargs["q"].clone()
    seqlens = first.kwargs["cache_seqlens"].clone()
    table = torch.full((batch, width), -1, dtype=torch.int32, device="cuda")
    table[:, :2] = first.kwargs["block_table"][:, :2]
    args = dict(cache_seqlens=seqlens, block_table=table, softmax_scale=D**-0.5, causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        ea.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ea.flash_attn_with_kvcache(q, k_cache, v_cache, **args)

    # finite keys everywhere now: any page may serve any sequence
    k_cache.copy_(torch.randn(k_cache.shape, dtype=k_cache.dtype, device="cuda"))
    v_cache.copy_(torch.randn(v_cache.shape, dtype=v_cache.dtype, device="cuda"))
    gen = torch.Generator().manual_seed(15)
    for _ in range(3):
        lens = torch.randint(0, width * PAGE + 1, (batch,), generator=gen)
        lens[: batch // 4] = 0  # padded rows
        new_table = torch.full((batch, width), -1, dtype=torch.int32)
        for b, n in enumerate(lens.tolist()):
            used = -(-n // PAGE)
            new_table[b, :used] = torch.randperm(pages, generator=gen)[:used].to(torch.int32)
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        seqlens.copy_(lens.to(torch.int32))
        table.copy_(new_table)
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_model(q, k_cache, v_cache, **args)
        dec = Case({"q": q}, [q[b] for b in range(batch)], [], [], decode=True)
        assert_close(out, ref, dec, 1e-2)
        assert (out[: batch // 4] == 0).all()
