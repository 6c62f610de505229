"""vLLM's own MRV2 input-side modules of one release, loaded unmodified, on vLLM's buffer layer or stagebuf's.

``fetch(release)`` keeps the files the harness needs (:data:`FILES`) from the release's wheel; ``load()`` runs
them as private modules, their ``vllm.*`` imports resolved to vLLM's own code where the input path runs it,
to stand-ins for vLLM's platform layer (``pin``: pinned memory and UVA) and to stubs; ``as_installed`` makes a
release importable as ``vllm`` (the plugin's tests, step mode). ``python -m benchmarks.vllm_mrv2 --check-new``
asks the registry for releases newer than :data:`RELEASES` (exit 1 if any); ``--fetch`` fetches them all.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import collections
import functools
import importlib
import logging
import os
import re
import sys
import types
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import fetch as F
from .fetch import ENV_CACHE, Unavailable, cache_root  # noqa: F401  (this module's names too)


@dataclass(frozen=True)
class Release:
    """What one vLLM release's MRV2 input path needs beyond :data:`FILES`."""

    files: tuple[str, ...] = ()  # More files to fetch.
    gather_masks_sliding_window: bool = True  # gather_block_tables(num_computed_tokens=) (0.33 on)
    array_typecodes: bool = False  # buffer_utils imports TORCH_DTYPE_TO_ARRAY_TYPECODE (0.34 on)
    confidential_compute: bool = False  # buffer_utils asks is_confidential_compute() (0.34 on)
    token_buffer: bool = False  # a new request's prompt is a TokenBuffer (vllm/v1/token_buffer.py; 0.34 on)


RELEASES: dict[str, Release] = {
    "0.32.0": Release(gather_masks_sliding_window=False),
    "0.33.0": Release(),
    "0.34.0": Release(files=("vllm/v1/token_buffer.py", "vllm/utils/collection_utils.py"),
                      array_typecodes=True, confidential_compute=True, token_buffer=True),
}  # fmt: skip
"""The vLLM releases the harness runs, oldest first: adding one is an entry here plus its differences."""
NEWEST = tuple(RELEASES)[-1]
OLDEST_CHECKED = "0.32.0"  # ``newer_releases`` looks at releases from this one on.

FILES = tuple(
    f"vllm/{f}.py"
    for f in ("v1/worker/gpu/buffer_utils", "v1/worker/gpu/block_table", "v1/worker/gpu/states",
              "v1/worker/gpu/input_batch", "v1/worker/gpu/sample/states", "v1/worker/gpu/model_runner",
              "v1/worker/cpu/buffer_utils", "v1/worker/cpu/shm", "utils/torch_utils", "utils/math_utils",
              "v1/attention/backends/utils", "v1/utils", "plugins/__init__")
)  # fmt: skip
"""The files every release needs (``model_runner.py`` only for its source: step mode reads its order)."""
ENV_DIR = "STAGEBUF_VLLM_DIR"  # A folder holding ``vllm-<release>`` folders, in place of the cache.
CONFIDENTIAL_COMPUTE = False  # What the stand-in ``is_confidential_compute()`` answers (tests set it).
INPLACE_H2D_TARGETS: collections.deque[weakref.ref[torch.Tensor]] = collections.deque(maxlen=4096)
"""The tensors vLLM's code passed to the stand-in ``register_inplace_h2d_target``, latest last."""


def release_option(help: str) -> Callable[[Any], Any]:
    """The commands' ``--release`` option: one of :data:`RELEASES`, :data:`NEWEST` by default."""
    import click

    return click.option(
        "--release", type=click.Choice(list(RELEASES)), default=NEWEST, show_default=True, help=help
    )


def spec(release: str = NEWEST) -> Release:
    """``RELEASES[release]``; raises ValueError naming the known releases."""
    try:
        return RELEASES[release]
    except KeyError:
        raise ValueError(f"vLLM {release!r} is not in RELEASES; known: {', '.join(RELEASES)}") from None


def release_suffix(release: str) -> str:
    """The suffix of a target measured against vLLM ``release``: ``_v034`` for 0.34.x."""
    major, minor = release.split(".")[:2]
    return f"_v{int(major)}{int(minor):02d}"


def files(release: str = NEWEST) -> tuple[str, ...]:
    return FILES + spec(release).files


def available(release: str = NEWEST) -> str | None:
    """Why vLLM ``release``'s MRV2 modules (Triton kernels) cannot be loaded here (None: they can)."""
    need = lambda: (fetch(release), importlib.import_module("triton"))
    return F.why_not(f"vLLM {release}'s MRV2 modules", need)


def cache_dir(release: str = NEWEST) -> Path:
    """``vllm-<release>`` in ``$STAGEBUF_VLLM_DIR``, else in :func:`benchmarks.fetch.cache_root`."""
    spec(release)
    given = os.environ.get(ENV_DIR)
    return (Path(given) if given else cache_root()) / f"vllm-{release}"


def _have(root: Path, release: str) -> bool:
    return all((root / f).is_file() for f in files(release))


def fetch(release: str = NEWEST) -> Path:
    """The folder holding vLLM ``release``'s :func:`files`, fetched if needed; raises Unavailable."""
    return F.kept(cache_dir(release), lambda root: _have(root, release), _filler(release))


def _filler(release: str) -> Callable[[Path], None]:
    """``files(release)`` from the release's wheel (only Python files: any platform's wheel will do)."""
    return F.unpacked(f"vllm=={release}", *F.binary("manylinux_2_28_x86_64", "3.12"), members=files(release))


# --- newer releases on the registry ----------------------------------------------------------


def _version(v: str) -> tuple[int, ...] | None:
    """A final release's number as a tuple (None for a pre-, dev, post- or local release)."""
    return tuple(int(p) for p in v.split(".")) if re.fullmatch(r"\d+(\.\d+)*", v) else None


def registry_listing(timeout: float = 60) -> str:
    """``pip index versions vllm``'s output; raises Unavailable where the registry cannot be asked."""
    listed = lambda out: "Available versions:" in out
    return F.pip("index versions vllm", "--disable-pip-version-check", timeout=timeout, done=listed)


def newer_releases(listing: str | None = None) -> list[str]:
    """Final vLLM releases newer than :data:`NEWEST` in ``listing`` (None: ask the registry)."""
    text = registry_listing() if listing is None else listing
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("Available versions:")), None)
    if line is None:
        raise ValueError("not pip index versions' output: no 'Available versions:' line")
    newest, floor = _version(NEWEST), _version(OLDEST_CHECKED)
    assert newest is not None and floor is not None
    got = {v for v in (s.strip() for s in line.split(":", 1)[1].split(",")) if v}
    keep = [(n, v) for v in got if (n := _version(v)) is not None and n >= floor and n > newest]
    return [v for _, v in sorted(keep)]


# --- executing vLLM's files as private modules ------------------------------------------------

_serial = 0


def _module(name: str, path: Path, imports: Any, real: bool = False) -> Any:
    """The file at ``path`` run as a new module (``real``: named ``name``), ``vllm.*`` from ``imports``."""
    global _serial
    _serial += 1
    if not real:
        name = f"_vllm_mrv2_{_serial}.{name.rpartition('.')[2]}"
    mod = sys.modules[name] = types.ModuleType(name)
    real_import = builtins.__import__

    def _import(n: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level or not (n == "vllm" or n.startswith("vllm.")):
            return real_import(n, globals, locals, fromlist, level)
        if n not in imports:
            raise ImportError(f"vllm_mrv2: no stand-in for {n} (imported by {name})")
        return imports[n] if fromlist else imports["vllm"]  # 'import vllm.envs as envs': the top package

    mod.__dict__["__builtins__"] = {**vars(builtins), "__import__": _import}
    mod.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)  # a real file name: Triton reads it
    return mod


def _named(n: ast.stmt) -> str | None:
    if isinstance(n, ast.Assign):
        return getattr(n.targets[0], "id", None)
    return n.name if isinstance(n, (ast.FunctionDef, ast.ClassDef)) else None


def _defs(path: Path, names: tuple[str, ...], env: dict[str, Any], release: str) -> dict[str, Any]:
    """The named top-level definitions of ``path``, run with ``env`` (no decorators, annotations)."""
    keep: list[Any] = [n for n in ast.parse(path.read_text()).body if _named(n) in names]
    missing = set(names) - {_named(n) for n in keep}
    if missing:
        raise Unavailable(f"{path} has no {sorted(missing)}: not vLLM {release}'s file")
    for n in keep:
        if isinstance(n, ast.FunctionDef):
            n.decorator_list, n.returns = [], None
            a = n.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    arg.annotation = None
    glb = dict(env)
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), glb)
    return {n: glb[n] for n in names}


class _Logger:
    """vLLM's ``init_logger``: each line marked as vLLM's; the first in a process also says why it appears."""

    explained = False
    WHY = (
        " [from vLLM's own MRV2 code, which the bench and tests run as their baseline: it is about "
        "vLLM's classes, not stagebuf's]"
    )

    def __init__(self, name: str, release: str = NEWEST):
        self._log, self._once, self.release = logging.getLogger(name), set[str](), release

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._log, attr)

    def warning_once(self, msg: str, *args: Any, **kw: Any) -> None:
        if msg not in self._once:
            self._once.add(msg)
            why = "" if _Logger.explained else self.WHY
            _Logger.explained = True
            self._log.warning(f"vLLM {self.release}: {msg}{why}", *args)

    info_once = debug_once = warning_once


def _cuda_view(cpu: torch.Tensor) -> torch.Tensor:
    """vLLM's compiled ``get_cuda_view_from_cpu_tensor``: the pinned tensor's device alias, no copy."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:  # pragma: no cover - cuda-python < 12.6
        from cuda import cudart as rt
    err, ptr = rt.cudaHostGetDevicePointer(cpu.data_ptr(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer: {err}")
    typestr = {torch.int32: "<i4", torch.int64: "<i8", torch.float32: "<f4", torch.uint64: "<u8"}[cpu.dtype]
    face = dict(data=(int(ptr), False), shape=tuple(cpu.shape), typestr=typestr, strides=None, version=3)
    dev = torch.device("cuda", torch.cuda.current_device())
    view = torch.as_tensor(types.SimpleNamespace(__cuda_array_interface__=face), device=dev)
    view._stagebuf_owner = cpu  # type: ignore[attr-defined]  # keep the host memory alive
    return view


def _stub(what: str) -> Callable[..., Any]:
    def f(*a: Any, **k: Any) -> Any:
        raise NotImplementedError(f"vllm_mrv2: {what} is a stub (the input path never calls it)")

    return f


@dataclass
class Mrv2:
    """One load of MRV2's input-side modules on one buffer layer."""

    buffer_utils: Any
    block_table: Any
    states: Any
    input_batch: Any
    sample_states: Any
    async_tensor_h2d: Callable[..., torch.Tensor]
    CpuGpuBuffer: Any  # vLLM V1's class (vllm/v1/utils.py), still in every release
    release: str = NEWEST
    TokenBuffer: Any = None  # vllm/v1/token_buffer.py's class (one per release), None before 0.34

    @property
    def spec(self) -> Release:
        return spec(self.release)

    @classmethod
    def of(cls, bu: Any, mods: list[Any], imports: Any, release: str) -> Mrv2:
        """One load from its ``buffer_utils``, MRV2's four modules and the stand-ins they imported."""
        h2d = imports["vllm.utils.torch_utils"].async_tensor_h2d
        tb = dict.get(imports, "vllm.v1.token_buffer")
        return cls(bu, *mods, h2d, imports["_CpuGpuBuffer"], release, getattr(tb, "TokenBuffer", None))


def load(
    layer: str = "vllm",
    pin: bool = True,
    device: torch.device | None = None,
    uva: bool | None = None,
    release: str = NEWEST,
) -> Mrv2:
    """MRV2's modules of vLLM ``release`` on ``layer`` ("vllm" or "stagebuf"), loaded once per arguments
    (and per ``TRITON_INTERPRET``). ``pin``: what vLLM's platform reports for pinned memory; ``uva``
    overrides ``is_uva_available()`` (False on a CPU: NonUvaBuffer with the CPU as the device)."""
    if layer not in ("vllm", "stagebuf"):
        raise ValueError(f"layer={layer!r}; allowed: 'vllm', 'stagebuf'")
    spec(release)
    dev = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return _load(layer, pin, dev, uva, release, os.environ.get("TRITON_INTERPRET") == "1")


@functools.cache
def _token_buffer_module(release: str) -> Any:
    """vLLM ``release``'s ``vllm/v1/token_buffer.py``, loaded once (one ``TokenBuffer`` class a release)."""
    if not spec(release).token_buffer:
        return None
    f = fetch(release) / "vllm"
    as_list = _defs(f / "utils/collection_utils.py", ("as_list",), {}, release)["as_list"]
    imports = {"vllm.utils.collection_utils": types.SimpleNamespace(as_list=as_list)}
    return _module("vllm_mrv2.token_buffer", f / "v1/token_buffer.py", imports)


def token_buffer(release: str = NEWEST) -> Any:
    """vLLM ``release``'s ``TokenBuffer`` class (fetching its files), or None where it has none."""
    return getattr(_token_buffer_module(release), "TokenBuffer", None)


def _stand_ins(root: Path, pin: bool, dev: torch.device, uva: bool | None, release: str) -> dict[str, Any]:
    """What MRV2's files import from the rest of vLLM: its own code, stand-ins and stubs."""
    import triton
    import triton.language as tl

    cpu, rel, f, ns = dev.type == "cpu", spec(release), root / "vllm", types.SimpleNamespace
    pinned = pin and not cpu

    def pin_memory_available() -> bool:
        return pinned

    platform = ns(
        device_type=dev.type,
        is_cpu=lambda: cpu,
        is_cuda_alike=lambda: not cpu,
        is_xpu=lambda: False,
        is_pin_memory_available=pin_memory_available,
        is_confidential_compute=lambda: CONFIDENTIAL_COMPUTE,
    )
    # async_tensor_h2d reads PIN_MEMORY (0.33 on) or calls is_pin_memory_available() (0.32); on the CPU the
    # CPU worker patches its own in (vllm/v1/worker/cpu/shm.py)
    env = {"torch": torch, "np": np, "PIN_MEMORY": pinned, "is_pin_memory_available": pin_memory_available}
    h2d_file = f / ("v1/worker/cpu/shm.py" if cpu else "utils/torch_utils.py")
    h2d = _defs(h2d_file, ("async_tensor_h2d",), env, release)["async_tensor_h2d"]
    torch_utils = ns(async_tensor_h2d=h2d, get_accelerator_view_from_cpu_tensor=_cuda_view)
    if rel.array_typecodes:
        codes = ("TORCH_DTYPE_TO_ARRAY_TYPECODE",)
        torch_utils.__dict__.update(_defs(f / "utils/torch_utils.py", codes, {"torch": torch}, release))
    pad = _defs(f / "v1/attention/backends/utils.py", ("PAD_SLOT_ID",), {}, release)["PAD_SLOT_ID"]
    imports: dict[str, Any] = {
        "vllm.logger": ns(init_logger=functools.partial(_Logger, release=release)),
        "vllm.triton_utils": ns(triton=triton, tl=tl, HAS_TRITON=True),
        # vLLM: is_uva_available() = pinned memory available, or the CPU platform
        "vllm.utils.platform_utils": ns(is_uva_available=lambda: (pinned or cpu) if uva is None else uva,
                                        is_pin_memory_available=pin_memory_available),
        "vllm.utils.torch_utils": torch_utils,
        "vllm.utils.math_utils": _module("vllm_mrv2.math_utils", f / "utils/math_utils.py", {}),
        "vllm.utils": ns(random_uuid=lambda: f"{uuid.uuid4().int & (2**64 - 1):016x}"),
        "vllm.platforms": ns(current_platform=platform),
        "vllm.v1.attention.backends.utils": ns(PAD_SLOT_ID=pad),
        "vllm.sampling_params": ns(SamplingParams=object),
        "vllm.v1.sample.ops.topk_topp_sampler": ns(apply_top_k_top_p=_stub("top-k/top-p")),
        "vllm.v1.worker.gpu.sample.gumbel": ns(apply_temperature=_stub("temperature")),
        "vllm.v1.worker.gpu.sample.min_p": ns(apply_min_p=_stub("min-p")),
        "_CpuGpuBuffer": _defs(f / "v1/utils.py", ("CpuGpuBuffer",), env, release)["CpuGpuBuffer"],
    }  # fmt: skip
    if rel.confidential_compute:
        imports["vllm.v1.conf_compute_utils"] = cc = types.ModuleType("vllm.v1.conf_compute_utils")
        # vLLM's confidential-computing copy patch (never installed here): records the tensor, weakly
        cc.register_inplace_h2d_target = lambda t: INPLACE_H2D_TARGETS.append(weakref.ref(t))  # type: ignore
    tb = _token_buffer_module(release)
    if tb is not None:
        imports["vllm.v1.token_buffer"] = tb
    return imports


GPU, CPU_BU = "vllm/v1/worker/gpu", "vllm/v1/worker/cpu/buffer_utils.py"
_MRV2 = ("block_table", "states", "input_batch", "sample.states")  # the modules a load runs on buffer_utils


@functools.cache
def _load(
    layer: str, pin: bool, dev: torch.device, uva: bool | None, release: str, interpreted: bool
) -> Mrv2:
    root = fetch(release)
    imports = _stand_ins(root, pin, dev, uva, release)
    bu = _module("vllm_mrv2.buffer_utils", root / GPU / "buffer_utils.py", imports)
    if dev.type == "cpu" and uva is not False:  # as vLLM's CPU worker does: gpu's UvaBuffer = cpu's
        bu.UvaBuffer = _cpu_uva_buffer(root, imports)
    if layer == "stagebuf":
        bu = stagebuf_buffer_utils(bu, release)
    imports["vllm.v1.worker.gpu.buffer_utils"] = bu
    mods = [
        _module(f"vllm_mrv2.{n.replace('.', '_')}", root / GPU / (n.replace(".", "/") + ".py"), imports)
        for n in _MRV2
    ]
    return Mrv2.of(bu, mods, imports, release)


SUBSTITUTED = ("UvaBuffer", "NonUvaBuffer", "UvaBufferPool", "UvaBackedTensor", "StagedWriteTensor")
SUBSTITUTED += ("FusedStagedWriter", "set_default_max_concurrency")
"""The names the plugin substitutes (its ``OURS``), read from the public package: the bench also runs
older stagebuf packages, whose private modules differ."""


def stagebuf_buffer_utils(vllm_bu: Any, release: str = NEWEST) -> Any:
    """vLLM ``release``'s ``buffer_utils`` with stagebuf's classes where its plugin puts them."""
    import stagebuf

    spec(release)
    mod = types.ModuleType(f"vllm_mrv2.buffer_utils[{release}, stagebuf]")
    mod.__dict__.update({k: v for k, v in vars(vllm_bu).items() if not k.startswith("__")})
    mod.__dict__.update({n: getattr(stagebuf, n) for n in SUBSTITUTED})
    return mod


# --- vLLM importable under its own names (the plugin's tests) -----------------------------------

_PACKAGES = ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.sample")
_INSTALLED = (*_PACKAGES, "vllm.envs", "vllm.plugins", "vllm.v1.conf_compute_utils", "vllm.v1.token_buffer")
_INSTALLED += tuple(f"vllm.v1.worker.gpu.{n}" for n in ("buffer_utils", *_MRV2, "model_runner"))


def _runner_stand_in(h2d: Callable[..., torch.Tensor], root: Path) -> types.ModuleType:
    """``vllm.v1.worker.gpu.model_runner`` whose ``execute_model`` runs the harness's step."""
    mod = types.ModuleType("vllm.v1.worker.gpu.model_runner")
    mod.__file__ = str(root / GPU / "model_runner.py")

    class GPUModelRunner:
        def __init__(self, vllm_config: Any, device: torch.device):
            self.device = device

        def execute_model(
            self, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False,
            skip_attn_for_dummy_run: bool = False, is_profile: bool = False, context_len: int = 0,
            valid_dummy_state_slots: bool = False, randomize_inputs: bool = False,
        ) -> Any:  # fmt: skip
            return scheduler_output()

        def prepare_inputs(
            self, scheduler_output: Any, batch_req_state: Any, batch_desc: Any, num_active_loras: int
        ) -> Any:
            raise NotImplementedError("vllm_mrv2: the harness prepares inputs in engine.Engine.prepare")

    GPUModelRunner.__module__ = mod.__name__
    mod.GPUModelRunner, mod.async_tensor_h2d = GPUModelRunner, h2d  # type: ignore[attr-defined]
    return mod


class _Imports(dict):  # type: ignore[type-arg]
    """Stand-ins, except for vLLM's own modules that ``as_installed`` put in ``sys.modules``."""

    def __contains__(self, key: object) -> bool:
        return key in sys.modules and key in _INSTALLED or dict.__contains__(self, key)

    def __getitem__(self, key: str) -> Any:
        return sys.modules[key] if key in _INSTALLED and key in sys.modules else dict.__getitem__(self, key)


class Installed:
    """vLLM ``release``'s modules importable under their own names (see :func:`as_installed`)."""

    def __init__(self, root: Path, imports: _Imports, release: str = NEWEST):
        self._root, self._imports, self.release = root, imports, release

    def load(self, name: str) -> Any:
        """MRV2's ``vllm/v1/worker/gpu/<name>.py`` executed as ``vllm.v1.worker.gpu.<name>`` now (its ``from
        vllm... import`` binds what ``sys.modules`` holds)."""
        full = f"vllm.v1.worker.gpu.{name}"
        mod = _module(full, self._root / GPU / (name.replace(".", "/") + ".py"), self._imports, real=True)
        parent, _, child = full.rpartition(".")
        setattr(sys.modules[parent], child, mod)
        return mod

    def mrv2(self) -> Mrv2:
        """MRV2's four modules loaded now (:meth:`load`), on the ``buffer_utils`` installed."""
        mods = [self.load(n) for n in _MRV2]
        return Mrv2.of(sys.modules["vllm.v1.worker.gpu.buffer_utils"], mods, self._imports, self.release)


def _cpu_uva_buffer(root: Path, imports: Any) -> Any:
    return _module("vllm_mrv2.cpu_buffer_utils", root / CPU_BU, imports).UvaBuffer


@contextmanager
def as_installed(device: torch.device | None = None, release: str = NEWEST) -> Iterator[Installed]:
    """vLLM ``release`` importable as ``vllm`` for the block (raises if a ``vllm`` is imported)."""
    if any(n in sys.modules for n in _INSTALLED):
        raise RuntimeError("a module named vllm is already imported; as_installed would shadow it")
    root = fetch(release)
    dev = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    imports = _Imports(_stand_ins(root, True, dev, None, release))

    class _Envs(types.ModuleType):
        @property
        def VLLM_PLUGINS(self) -> list[str] | None:  # noqa: N802  (vLLM's name)
            v = os.environ.get("VLLM_PLUGINS")
            return None if v is None else v.split(",")

    def add(name: str, mod: Any) -> None:
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)

    try:
        for n in _PACKAGES:
            add(n, types.ModuleType(n))
            sys.modules[n].__path__ = []  # type: ignore[attr-defined]
        sys.modules["vllm"].__version__ = release  # type: ignore[attr-defined]  # as vllm/__init__ sets it
        add("vllm.envs", _Envs("vllm.envs"))
        add("vllm.plugins", _module("vllm.plugins", root / "vllm/plugins/__init__.py", imports, real=True))
        for n in ("vllm.v1.token_buffer", "vllm.v1.conf_compute_utils"):  # where the release has them
            if dict.get(imports, n) is not None:
                add(n, dict.get(imports, n))
        h2d = imports["vllm.utils.torch_utils"].async_tensor_h2d
        add("vllm.v1.worker.gpu.model_runner", _runner_stand_in(h2d, root))
        inst = Installed(root, imports, release)
        bu = inst.load("buffer_utils")
        if dev.type == "cpu":  # as vLLM's CPU worker does
            bu.UvaBuffer = _cpu_uva_buffer(root, imports)
        yield inst
    finally:
        for n in _INSTALLED:
            sys.modules.pop(n, None)


def main(argv: list[str] | None = None) -> int:
    what = "vLLM's MRV2 files: fetch them, or ask the registry for a newer release."
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_mrv2", description=what)
    g = p.add_mutually_exclusive_group(required=True)
    new_help = "list vLLM releases newer than RELEASES': exit 1 if any, 0 if none, 2 without the registry"
    g.add_argument("--check-new", action="store_true", help=new_help)
    g.add_argument("--fetch", nargs="*", metavar="RELEASE", help="fetch these releases' files (default: all)")
    a = p.parse_args(argv)
    if a.check_new:
        try:
            new = newer_releases()
        except Unavailable as e:
            print(f"cannot check for newer vLLM releases: {e}", file=sys.stderr)
            return 2
        if not new:
            print(f"no vLLM release newer than {NEWEST}")
            return 0
        print(f"vLLM releases newer than {NEWEST}: {', '.join(new)} (add them to RELEASES in {__file__})")
        return 1
    bad = 0
    for r in a.fetch or list(RELEASES):
        try:
            print(fetch(r))
        except (Unavailable, ValueError) as e:
            print(f"vLLM {r}: {e}", file=sys.stderr)
            bad = 1
    return bad


if __name__ == "__main__":
    sys.exit(main())
