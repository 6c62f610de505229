"""nano-vllm-fork 20260210, fetched at test or bench time and imported with stand-ins for what input
preparation never uses.

Nothing of nano-vllm is committed. ``fetch()`` runs ``pip download --no-deps
nano-vllm-fork==20260210`` (a pure-Python wheel) and unpacks it into ``cache_dir()``
(``.cache/nanovllm-20260210`` in the checkout, or ``$STAGEBUF_NANOVLLM_DIR``), with
xxhash wheels for CPython 3.10-3.12 on x86-64 Linux beside it: nano-vllm's
``BlockManager`` hashes with xxhash, and a machine without network (the GPU box) gets
that folder carried. An installed nano-vllm-fork 20260210 is used as it is.

``load()`` imports the real package ``nanovllm`` from there. Its ``Scheduler``,
``BlockManager``, ``Sequence``, ``SamplingParams``, ``utils.context`` and
``ModelRunner`` (``prepare_*``, ``run_model``, ``capture_cudagraph``) run as released.
What the input path never reaches gets a stand-in while the package is imported, and
only where the real module is missing here: ``transformers`` (``AutoConfig`` reads the
model folder's ``config.json``; ``AutoTokenizer`` and ``Qwen3Config`` are unused),
``flash_attn`` (attention kernels), ``safetensors`` (weights), ``tqdm`` (progress bar)
and ``triton`` (a kernel definition). The stand-ins are taken out of ``sys.modules``
again after the import. ``runner()`` builds a ``ModelRunner`` as its ``__init__`` does,
less the process group, the model and its weights, the warm-up and the KV cache.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VERSION = "20260210"
DIST = "nano-vllm-fork"
ENV_DIR = "STAGEBUF_NANOVLLM_DIR"
"""Where the fetched wheel is unpacked (default: ``.cache/nanovllm-20260210`` in the checkout)."""
XXHASH_PYTHONS = ("3.10", "3.11", "3.12")


class Unavailable(RuntimeError):
    """nano-vllm-fork 20260210 could not be had here (the reason says why)."""


def cache_dir() -> Path:
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given)
    return Path(__file__).resolve().parents[1] / ".cache" / f"nanovllm-{VERSION}"


def _pip_download(dest: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest, *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"pip download {args[-1]} failed (is the package registry reachable?): {e}") from e
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(
            f"pip download {args[-1]} failed (is the package registry reachable?): {tail[0][:300]}"
        )


def _unzip(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)


def _installed() -> bool:
    from importlib import metadata

    try:
        return metadata.version(DIST) == VERSION
    except metadata.PackageNotFoundError:
        return False


def fetch(quiet: bool = True) -> Path:
    """The folder holding nano-vllm (``pkg/nanovllm``) and xxhash; fetched once; raises Unavailable."""
    root = cache_dir()
    pkg = root / "pkg"
    if not (pkg / "nanovllm" / "engine" / "model_runner.py").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            _pip_download(tmp, f"{DIST}=={VERSION}")
            wheels = list(Path(tmp).glob("nano_vllm_fork-*.whl"))
            if not wheels:
                raise Unavailable(f"pip download {DIST}=={VERSION} gave no wheel")
            _unzip(wheels[0], pkg)
    for py in XXHASH_PYTHONS:
        dest = root / f"xxhash-py{py}"
        if (dest / "xxhash").is_dir():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                _pip_download(tmp, "--only-binary=:all:", "--python-version", py, "--implementation", "cp",
                              "--platform", "manylinux2014_x86_64", "xxhash")  # fmt: skip
            except Unavailable:
                if importlib.util.find_spec("xxhash") is None and py == _py():
                    raise
                continue
            for w in Path(tmp).glob("xxhash-*.whl"):
                _unzip(w, dest)
    if not quiet:
        print(f"nanovllm_pkg: {DIST} {VERSION} is in {root}", file=sys.stderr)
    return root


def _py() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


_why: str | None = None


def available() -> str | None:
    """Why nano-vllm cannot be loaded here (None: it can); fetches once."""
    global _why
    if _why is None:
        try:
            load()
            _why = ""
        except Unavailable as e:
            _why = str(e)
    return _why or None


# --- importing it ---------------------------------------------------------------------------------


class _HfConfig(types.SimpleNamespace):
    """What ``AutoConfig.from_pretrained`` gives: the model folder's config.json as attributes."""


class AutoConfig:
    """transformers' ``AutoConfig`` as nano-vllm uses it: the folder's config.json, as written, as attributes.

    The stand-in where transformers is missing, and the end-to-end bench's config everywhere: transformers
    5 turns ``rope_scaling`` into a dict that nano-vllm 20260210's ``get_rope`` cannot take."""

    @staticmethod
    def from_pretrained(path: str, **_: Any) -> _HfConfig:
        return _HfConfig(**json.loads((Path(path) / "config.json").read_text()))


def _stand_ins() -> dict[str, types.ModuleType]:
    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__dict__.update(attrs)
        m.__stagebuf_stand_in__ = True  # type: ignore[attr-defined]
        return m

    def unused(what: str) -> Any:
        def f(*a: Any, **k: Any) -> Any:
            raise NotImplementedError(
                f"nanovllm_pkg: {what} is a stand-in (input preparation never calls it)"
            )

        return f

    class Unused:
        from_pretrained = staticmethod(unused("transformers.AutoTokenizer"))

        def __init__(self, *a: Any, **k: Any):
            raise NotImplementedError("nanovllm_pkg: a transformers stand-in")

    def jit(fn: Any = None, **_: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    out = {
        "transformers": module(
            "transformers", AutoConfig=AutoConfig, AutoTokenizer=Unused, Qwen3Config=Unused
        ),
        "flash_attn": module(
            "flash_attn",
            flash_attn_varlen_func=unused("flash_attn_varlen_func"),
            flash_attn_with_kvcache=unused("flash_attn_with_kvcache"),
        ),
        "safetensors": module("safetensors", safe_open=unused("safetensors.safe_open")),
        "tqdm": module("tqdm"),
        "tqdm.auto": module("tqdm.auto", tqdm=unused("tqdm")),
        "triton": module("triton", jit=jit),
        "triton.language": module("triton.language", constexpr=int),
    }
    out["triton"].language = out["triton.language"]  # type: ignore[attr-defined]
    out["tqdm"].auto = out["tqdm.auto"]  # type: ignore[attr-defined]
    return out


@dataclass
class Nano:
    """nano-vllm's modules, as imported."""

    root: Path
    nanovllm: Any
    config: Any
    sequence: Any
    sampling_params: Any
    block_manager: Any
    scheduler: Any
    model_runner: Any
    context: Any
    llm_engine: Any


_loaded: Nano | None = None


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def load() -> Nano:
    """nano-vllm's real modules (fetched if needed; imported once per process); raises Unavailable."""
    global _loaded
    if _loaded is not None:
        return _loaded
    root = Path(".")
    added: list[str] = []
    if not _installed():
        root = fetch()
        added.append(str(root / "pkg"))
    if _missing("xxhash"):
        added.append(str(cache_dir() / f"xxhash-py{_py()}"))
    stand = {k: v for k, v in _stand_ins().items() if _missing(k.split(".")[0])}
    import torch._dynamo  # noqa: F401  (nano-vllm's torch.compile imports it; it must not see stand-ins)

    sys.path[:0] = added
    sys.modules.update(stand)
    try:
        names = ("config", "engine.sequence", "sampling_params", "engine.block_manager", "engine.scheduler",
                 "engine.model_runner", "utils.context", "engine.llm_engine")  # fmt: skip
        mods = [importlib.import_module(f"nanovllm.{n}") for n in names]
        top = importlib.import_module("nanovllm")
    except ImportError as e:
        raise Unavailable(f"{DIST} {VERSION} could not be imported: {e}") from e
    finally:
        for k in stand:
            sys.modules.pop(k, None)
        for p in added:
            if p in sys.path and p.endswith("pkg"):
                sys.path.remove(p)
    _loaded = Nano(Path(top.__file__).parents[1], top, *mods)
    return _loaded


# --- a runner without a model ---------------------------------------------------------------------


HF_CONFIG = {
    "model_type": "qwen3",
    "max_position_embeddings": 40960,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}
"""A small Qwen3-shaped config.json: what Config reads (input preparation reads none of it but sizes)."""


def config(model_dir: Path, **kw: Any) -> Any:
    """nano-vllm's own ``Config`` for a model folder holding only ``config.json`` (written if missing)."""
    nano = load()
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        cfg_file.write_text(json.dumps(HF_CONFIG))
    kw.setdefault("num_kvcache_blocks", 4096)
    blocks = kw.pop("num_kvcache_blocks")
    c = nano.config.Config(str(model_dir), **kw)
    c.num_kvcache_blocks = blocks  # what allocate_kv_cache computes from free memory
    return c


def runner(cfg: Any, model: Any = None) -> Any:
    """A ``ModelRunner`` with the attributes its ``__init__`` sets for input preparation.

    No process group, no ``torch.cuda.set_device``, no weights, warm-up, KV cache or graph
    capture; ``_allocate_sample_buffers`` (nano-vllm's, pinned) is not called here: see
    ``own_buffers``.
    """
    mr = load().model_runner.ModelRunner
    r = mr.__new__(mr)
    r.config = cfg
    r.block_size = cfg.kvcache_block_size
    r.enforce_eager = cfg.enforce_eager
    r.world_size = cfg.tensor_parallel_size
    r.rank = 0
    r.event = []
    r.dtype = torch.bfloat16
    if model is not None:
        r.model = model
    return r


@contextlib.contextmanager
def own_path_on_cpu() -> Iterator[None]:
    """nano-vllm's own code run on a machine without CUDA: the reference of the CPU tests and bench.

    Its own path cannot run there at all (``pin_memory=True`` raises, ``.cuda()`` asserts). In
    this block ``torch.tensor`` and ``torch.zeros`` ignore ``pin_memory=True`` and
    ``Tensor.cuda()`` returns a CPU copy (``clone``): every value is still computed by
    nano-vllm's code; only the transfer is replaced. Tests only: it patches torch for the block.
    """
    real_tensor, real_zeros, real_cuda = torch.tensor, torch.zeros, torch.Tensor.cuda

    def tensor(*a: Any, pin_memory: bool = False, **k: Any) -> torch.Tensor:
        return real_tensor(*a, **k)

    def zeros(*a: Any, pin_memory: bool = False, **k: Any) -> torch.Tensor:
        return real_zeros(*a, **k)

    def cuda(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        return self.clone()

    torch.tensor, torch.zeros, torch.Tensor.cuda = tensor, zeros, cuda  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.tensor, torch.zeros, torch.Tensor.cuda = real_tensor, real_zeros, real_cuda  # type: ignore[assignment]


def own_buffers(r: Any) -> None:
    """nano-vllm's ``_allocate_sample_buffers`` on ``r``: pinned on CUDA, unpinned on a CPU-only machine."""
    if torch.cuda.is_available():
        r._allocate_sample_buffers()
    else:
        with own_path_on_cpu():
            r._allocate_sample_buffers()
