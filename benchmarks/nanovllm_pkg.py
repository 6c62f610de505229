"""nano-vllm-fork's released package, fetched at test or bench time and imported as released.

``fetch()`` keeps the wheel unpacked in ``cache_dir()``, with xxhash wheels for CPython 3.10-3.12 beside it.
``load()`` imports the real package, stand-ins taking the place of missing modules input preparation never
reaches (``transformers``, ``flash_attn``, ``safetensors``, ``tqdm``, ``triton``) during the import only;
``runner()`` builds a ``ModelRunner`` less the process group, model, warm-up and KV cache.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from . import fetch as F
from .e2e_model import SHAPES
from .fetch import Unavailable  # noqa: F401  (this module's name too)

VERSION = "20260210"  # The release every function here defaults to.
DIST = "nano-vllm-fork"
ENV_DIR = "STAGEBUF_NANOVLLM_DIR"  # Where the wheel is unpacked (default: the checkout's .cache).
XXHASH_PYTHONS = ("3.10", "3.11", "3.12")


def cache_dir(version: str = VERSION) -> Path:
    given = os.environ.get(ENV_DIR)
    return Path(given) if given else Path(__file__).resolve().parents[1] / ".cache" / f"nanovllm-{version}"


def _py() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def fetch(version: str = VERSION) -> Path:
    """The folder holding nano-vllm (``pkg/nanovllm``) and xxhash; fetched once; raises Unavailable."""
    root = cache_dir(version)
    whole = lambda pkg: (pkg / "nanovllm/engine/model_runner.py").is_file()
    F.kept(root / "pkg", whole, F.unpacked(f"{DIST}=={version}", timeout=300))
    for py in XXHASH_PYTHONS:
        fill = F.unpacked("xxhash", *F.binary("manylinux2014_x86_64", py))
        try:
            F.kept(root / f"xxhash-py{py}", lambda d: (d / "xxhash").is_dir(), fill)
        except Unavailable:
            if importlib.util.find_spec("xxhash") is None and py == _py():
                raise
    return root


def available() -> str | None:
    """Why nano-vllm cannot be loaded here (None: it can); fetches once."""
    return F.why_not(f"{DIST} {VERSION}", load)


# --- importing it ---------------------------------------------------------------------------------


class AutoConfig:
    """transformers' ``AutoConfig`` as nano-vllm uses it: config.json as written, as attributes."""

    @staticmethod
    def from_pretrained(path: str, **_: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(**json.loads((Path(path) / "config.json").read_text()))


def _stand_ins() -> dict[str, types.ModuleType]:
    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__dict__.update(attrs, __stagebuf_stand_in__=True)
        return m

    def unused(what: str) -> Any:
        def f(*a: Any, **k: Any) -> Any:
            raise NotImplementedError(f"nanovllm_pkg: {what} is a stand-in (never called to prepare inputs)")

        return f

    fa = {f"flash_attn_{n}": unused(f"flash_attn_{n}") for n in ("varlen_func", "with_kvcache")}
    tl = module("triton.language", constexpr=int)
    tqdm = module("tqdm.auto", tqdm=unused("tqdm"))
    tokenizer = types.SimpleNamespace(from_pretrained=unused("transformers.AutoTokenizer"))
    hf = {"AutoConfig": AutoConfig, "AutoTokenizer": tokenizer, "Qwen3Config": unused("Qwen3Config")}
    return {
        "transformers": module("transformers", **hf),
        "flash_attn": module("flash_attn", **fa),
        "safetensors": module("safetensors", safe_open=unused("safetensors.safe_open")),
        "tqdm": module("tqdm", auto=tqdm),
        "tqdm.auto": tqdm,
        "triton": module("triton", jit=lambda fn=None, **_: fn or (lambda f: f), language=tl),
        "triton.language": tl,
    }


Nano = types.SimpleNamespace  # nano-vllm's modules: ``root``, ``nanovllm`` and each of MODULES' last name
MODULES = ("config", "engine.sequence", "sampling_params", "engine.block_manager", "engine.scheduler",
           "engine.model_runner", "utils.context", "engine.llm_engine")  # fmt: skip


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


@functools.cache
def load() -> Nano:
    """nano-vllm's real modules (fetched if needed; imported once per process); raises Unavailable."""
    added = [str(fetch() / "pkg")]
    if _missing("xxhash"):
        added.append(str(cache_dir() / f"xxhash-py{_py()}"))
    stand = {k: v for k, v in _stand_ins().items() if _missing(k.split(".")[0])}
    import torch._dynamo  # noqa: F401  (nano-vllm's torch.compile imports it; it must not see stand-ins)

    sys.path[:0] = added
    sys.modules.update(stand)
    try:
        mods = [importlib.import_module(f"nanovllm.{n}") for n in MODULES]
        top = importlib.import_module("nanovllm")
    except ImportError as e:
        raise Unavailable(f"{DIST} {VERSION} could not be imported: {e}") from e
    finally:
        for k in stand:
            sys.modules.pop(k, None)
        for p in added:
            if p in sys.path and p.endswith("pkg"):
                sys.path.remove(p)
    named = {n.rpartition(".")[2]: m for n, m in zip(MODULES, mods)}
    return Nano(root=Path(top.__file__).parents[1], nanovllm=top, **named)


# --- a runner without a model ---------------------------------------------------------------------

HF_CONFIG = {**SHAPES["tiny"], "vocab_size": 32000}  # What input preparation reads of a model: its sizes.


def config(model_dir: Path, **kw: Any) -> Any:
    """nano-vllm's own ``Config`` for a model folder holding only ``config.json`` (written if missing)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    if not (model_dir / "config.json").is_file():
        (model_dir / "config.json").write_text(json.dumps(HF_CONFIG))
    blocks = kw.pop("num_kvcache_blocks", 4096)
    c = load().config.Config(str(model_dir), **kw)
    c.num_kvcache_blocks = blocks  # what allocate_kv_cache computes from free memory
    return c


def runner(cfg: Any, model: Any = None) -> Any:
    """A ``ModelRunner`` as its ``__init__`` sets it up for input preparation, less the rest."""
    mr = load().model_runner.ModelRunner
    r = mr.__new__(mr)
    r.config, r.block_size, r.enforce_eager = cfg, cfg.kvcache_block_size, cfg.enforce_eager
    r.world_size, r.rank, r.event, r.dtype = cfg.tensor_parallel_size, 0, [], torch.bfloat16
    if model is not None:
        r.model = model
    return r


@contextlib.contextmanager
def own_path_on_cpu() -> Iterator[None]:
    """nano-vllm's own code without CUDA: ``pin_memory=True`` ignored, ``Tensor.cuda()`` a copy."""
    unpinned = lambda f: lambda *a, pin_memory=False, **k: f(*a, **k)
    free = {n: unpinned(getattr(torch, n)) for n in ("tensor", "zeros")}
    with (
        mock.patch.multiple(torch, **free),
        mock.patch.multiple(torch.Tensor, cuda=lambda t, *a, **k: t.clone()),
    ):
        yield


def own_buffers(r: Any) -> None:
    """nano-vllm's ``_allocate_sample_buffers`` on ``r``: pinned on CUDA, unpinned on a CPU-only machine."""
    with contextlib.nullcontext() if torch.cuda.is_available() else own_path_on_cpu():
        r._allocate_sample_buffers()
