"""vLLM's own MRV2 input-side modules, loaded unmodified, on vLLM's buffer layer or on stagebuf's.

The releases run are :data:`RELEASES` (oldest first; :data:`NEWEST` is the default of every function
here). The peer is vLLM's released code, fetched at bench or test time and never committed:
``fetch(release)`` takes the few source files it needs from the installed vLLM when that is the
release asked for, else from the released wheel (``pip download --no-deps vllm==<release>``, about
340 MB, of which a few hundred KB of Python are kept in ``cache_dir(release)``: per user, outside the
checkout, see :func:`cache_root`). A machine without network (the GPU box) gets those folders carried
(``scripts/gpu.sh`` says how).

``load()`` executes the files as modules of their own, under private names
(``_vllm_mrv2_<n>.block_table``; no ``vllm`` module is created or imported), each
with the imports it names resolved to:

* vLLM's own code where the import is MRV2's: ``buffer_utils`` (UvaBuffer,
  NonUvaBuffer, UvaBufferPool, UvaBackedTensor, StagedWriteTensor,
  FusedStagedWriter and the staged-write Triton kernel), ``block_table``,
  ``states``, ``input_batch``, ``sample/states``; ``async_tensor_h2d``, ``cdiv``,
  ``as_list`` and ``TORCH_DTYPE_TO_ARRAY_TYPECODE`` are vLLM's, compiled from its files;
  ``TokenBuffer`` (0.34 on) is its own file; on the CPU, the CPU backend's own
  ``UvaBuffer`` and ``async_tensor_h2d`` (``vllm/v1/worker/cpu``), patched in as
  vLLM's CPU worker does;
* small stand-ins for what vLLM's platform layer decides or compiles: the
  logger, ``is_uva_available`` / ``is_pin_memory_available`` / ``PIN_MEMORY`` (the ``pin``
  argument: ``False`` is a machine without pinned memory, where vLLM takes its NonUvaBuffer
  fallback), ``current_platform.device_type`` and ``is_confidential_compute()``
  (:data:`CONFIDENTIAL_COMPUTE`), ``register_inplace_h2d_target`` (a recorder: confidential
  computing is never on here), and the compiled ``get_cuda_view_from_cpu_tensor`` op (here:
  ``cudaHostGetDevicePointer`` through cuda-bindings, wrapped without a copy);
* stubs (raise if called) for sampler kernels that ``sample/states.py`` imports
  but the input path never calls.

With ``layer="stagebuf"`` the MRV2 modules get stagebuf's classes in place of
``buffer_utils``' (the direct substitution that stagebuf's vLLM plugin makes);
vLLM's Triton helper ``_load_ptr`` stays vLLM's.

``python -m benchmarks.vllm_mrv2 --check-new`` asks the package registry for vLLM releases newer than
:data:`NEWEST` (exit 1 if there are: add them to :data:`RELEASES`); ``--fetch`` fetches every release.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import collections
import functools
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import uuid
import weakref
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Release:
    """What one vLLM release's MRV2 input path needs beyond :data:`FILES` and the stand-ins every
    release gets (each field says which releases have it)."""

    files: tuple[str, ...] = ()
    """More files to fetch (beyond :data:`FILES`)."""
    gather_masks_sliding_window: bool = True
    """``BlockTables.gather_block_tables(..., num_computed_tokens=...)``, which nulls the block-table
    entries below a sliding window (0.33 on); 0.32's takes no ``num_computed_tokens``."""
    array_typecodes: bool = False
    """``buffer_utils`` imports ``TORCH_DTYPE_TO_ARRAY_TYPECODE`` from ``vllm.utils.torch_utils``
    (taken from the release's own ``torch_utils.py``; 0.34 on)."""
    confidential_compute: bool = False
    """``buffer_utils`` imports ``register_inplace_h2d_target`` from ``vllm.v1.conf_compute_utils`` and
    asks ``current_platform.is_confidential_compute()`` (0.34 on)."""
    token_buffer: bool = False
    """``vllm/v1/token_buffer.py``: the model runner gets each new request's prompt as a ``TokenBuffer``
    (an ``array.array('i')``), which it hands to ``RequestState.add_request`` (0.34 on)."""


RELEASES: dict[str, Release] = {
    "0.32.0": Release(gather_masks_sliding_window=False),
    "0.33.0": Release(),
    "0.34.0": Release(
        files=("vllm/v1/token_buffer.py", "vllm/utils/collection_utils.py"),
        array_typecodes=True,
        confidential_compute=True,
        token_buffer=True,
    ),
}
"""The vLLM releases the harness runs, oldest first: adding one is an entry here plus its differences
(``--check-new`` says when the registry has a newer one)."""

NEWEST = tuple(RELEASES)[-1]
"""The newest release in :data:`RELEASES`: every function's default."""

OLDEST_CHECKED = "0.32.0"
"""``newer_releases`` looks at releases from this one on."""

FILES = (
    "vllm/v1/worker/gpu/buffer_utils.py",
    "vllm/v1/worker/gpu/block_table.py",
    "vllm/v1/worker/gpu/states.py",
    "vllm/v1/worker/gpu/input_batch.py",
    "vllm/v1/worker/gpu/sample/states.py",
    "vllm/v1/worker/gpu/model_runner.py",
    "vllm/v1/worker/cpu/buffer_utils.py",
    "vllm/v1/worker/cpu/shm.py",
    "vllm/utils/torch_utils.py",
    "vllm/utils/math_utils.py",
    "vllm/v1/attention/backends/utils.py",
    "vllm/v1/utils.py",
    "vllm/plugins/__init__.py",
)
"""The files every release needs (``model_runner.py`` only for its source: step mode reads its order)."""

ENV_CACHE = "STAGEBUF_CACHE_DIR"
"""Where stagebuf's fetched files are kept (else ``$XDG_CACHE_HOME/stagebuf``, else ``~/.cache/stagebuf``)."""
ENV_DIR = "STAGEBUF_VLLM_DIR"
"""A folder holding ``vllm-<release>`` folders, in place of :func:`cache_root`."""

CONFIDENTIAL_COMPUTE = False
"""What the stand-in ``current_platform.is_confidential_compute()`` answers (tests may set it)."""

INPLACE_H2D_TARGETS: collections.deque[weakref.ref[torch.Tensor]] = collections.deque(maxlen=4096)
"""The tensors vLLM's code passed to the stand-in ``register_inplace_h2d_target`` (weakly, latest last)."""


def release_option(help: str) -> Callable[[Any], Any]:
    """The bench commands' ``--release`` option: one of :data:`RELEASES`, :data:`NEWEST` by default."""
    import click

    choice = click.Choice(list(RELEASES))
    return click.option("--release", type=choice, default=NEWEST, show_default=True, help=help)


class Unavailable(RuntimeError):
    """A vLLM release's files could not be had here (the reason says why)."""


def spec(release: str = NEWEST) -> Release:
    """``RELEASES[release]``; raises ValueError naming the known releases."""
    try:
        return RELEASES[release]
    except KeyError:
        raise ValueError(f"vLLM {release!r} is not in RELEASES; known: {', '.join(RELEASES)}") from None


def files(release: str = NEWEST) -> tuple[str, ...]:
    """The files of ``release`` that :func:`fetch` keeps."""
    return FILES + spec(release).files


def available(release: str = NEWEST) -> str | None:
    """Why vLLM ``release``'s MRV2 modules cannot be loaded here (None: they can); fetches once."""
    why = _why.get(release)
    if why is None:
        try:
            fetch(release)
            import triton  # noqa: F401  (MRV2's buffer_utils defines a Triton kernel at import)

            why = ""
        except Unavailable as e:
            why = str(e)
        except ImportError as e:
            why = f"vLLM {release}'s MRV2 modules need Triton ({e})"
        _why[release] = why
    return why or None


_why: dict[str, str] = {}


def cache_root() -> Path:
    """``$STAGEBUF_CACHE_DIR``, else ``$XDG_CACHE_HOME/stagebuf``, else ``~/.cache/stagebuf``."""
    given = os.environ.get(ENV_CACHE)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "stagebuf"


def cache_dir(release: str = NEWEST) -> Path:
    """The folder of ``release``'s files: ``vllm-<release>`` in ``$STAGEBUF_VLLM_DIR``, else in
    :func:`cache_root`."""
    spec(release)
    given = os.environ.get(ENV_DIR)
    return (Path(given) if given else cache_root()) / f"vllm-{release}"


def _have(root: Path, release: str) -> bool:
    return all((root / f).is_file() for f in files(release))


def _installed_root(release: str) -> Path | None:
    """The installed vLLM's site folder, if it is version ``release``."""
    try:
        from importlib import metadata

        if metadata.version("vllm") != release:
            return None
        dist = metadata.distribution("vllm")
    except Exception:
        return None
    root = Path(str(dist.locate_file("")))
    return root if _have(root, release) else None


def fetch(release: str = NEWEST, quiet: bool = True) -> Path:
    """The folder holding vLLM ``release``'s :func:`files`, fetched if needed; raises Unavailable.

    The files are written into a new folder beside it, then renamed into place: an interrupted
    fetch never leaves part of a release where :func:`fetch` would take it as whole."""
    root = cache_dir(release)
    if _have(root, release):
        return root
    src = _installed_root(release)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
        tmp.chmod(0o755)  # (mkdtemp's 0700) as a folder made by mkdir would be
    except OSError as e:
        raise Unavailable(f"vLLM {release}'s files cannot be kept in {root.parent}: {e}") from e
    try:
        if src is not None:
            for f in files(release):
                (tmp / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / f, tmp / f)
        else:
            _from_wheel(release, tmp)
        _put(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _have(root, release):
        raise Unavailable(f"vLLM {release}'s files are not all in {root} after fetching them")
    if not quiet:
        print(f"vllm_mrv2: vLLM {release}'s files are in {root}", file=sys.stderr)
    return root


def _from_wheel(release: str, dest: Path) -> None:
    """``files(release)`` from the release's wheel (``pip download --no-deps``) into ``dest``."""
    with tempfile.TemporaryDirectory() as tmp:
        # Only Python files are taken from the wheel, so any platform's wheel will do.
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12",
            "--implementation", "cp", "-d", tmp, f"vllm=={release}",
        ]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"pip download vllm=={release} failed: {e}") from e
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise Unavailable(f"pip download vllm=={release} failed: {tail[0][:300]}")
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                for f in files(release):
                    (dest / f).parent.mkdir(parents=True, exist_ok=True)
                    (dest / f).write_bytes(z.read(f))
        except (KeyError, zipfile.BadZipFile) as e:
            raise Unavailable(f"vLLM {release}'s wheel lacks a file the harness needs: {e}") from e


def _put(tmp: Path, root: Path) -> None:
    """Rename the complete folder ``tmp`` to ``root``; an incomplete ``root`` (an older harness's, or an
    interrupted copy by hand) is moved aside first. Another process's complete ``root`` wins."""
    old: Path | None = None
    if root.exists():
        old = root.with_name(f".{root.name}.old.{uuid.uuid4().hex[:8]}")
        try:
            root.rename(old)
        except OSError:
            old = None
    try:
        tmp.rename(root)
    except OSError:
        if not root.is_dir():
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- newer releases on the registry ----------------------------------------------------------


def _version(v: str) -> tuple[int, ...] | None:
    """A final release's number as a tuple (None for a pre-, dev or post-release, or a local one)."""
    return tuple(int(p) for p in v.split(".")) if re.fullmatch(r"\d+(\.\d+)*", v) else None


def registry_listing(timeout: float = 60) -> str:
    """``pip index versions vllm``'s output; raises Unavailable where the registry cannot be asked."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "vllm", "--disable-pip-version-check"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"pip index versions vllm failed: {e}") from e
    if done.returncode != 0 or "Available versions:" not in done.stdout:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(
            f"pip index versions vllm failed (is the package registry reachable?): {tail[0][:300]}"
        )
    return done.stdout


def newer_releases(listing: str | None = None) -> list[str]:
    """Released vLLM versions (from :data:`OLDEST_CHECKED` on) newer than :data:`NEWEST`, oldest first.

    ``listing`` is ``pip index versions vllm``'s output (None: ask the registry now, which raises
    Unavailable where it cannot be reached). Pre-releases are left out."""
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


def _module(name: str, path: Path | None, imports: Any, real: bool = False) -> Any:
    """Execute the file at ``path`` as a new module; ``vllm.*`` imports resolve in ``imports``.

    The module is named ``_vllm_mrv2_<n>.<last part of name>`` (every load its own), or ``name``
    itself with ``real`` (``as_installed``); either way it is put in ``sys.modules``, where
    dataclasses look their module up, with ``__file__`` the file's path.
    """
    global _serial
    _serial += 1
    if not real:
        name = f"_vllm_mrv2_{_serial}.{name.rpartition('.')[2]}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    real_import = builtins.__import__

    def _import(n: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and (n == "vllm" or n.startswith("vllm.")):
            if n not in imports:
                raise ImportError(f"vllm_mrv2: no stand-in for {n} (imported by {name})")
            if not fromlist:  # 'import vllm.envs as envs': the top package, then its attributes
                return imports["vllm"]
            return imports[n]
        return real_import(n, globals, locals, fromlist, level)

    b = dict(vars(builtins))
    b["__import__"] = _import
    mod.__dict__["__builtins__"] = b
    if path is not None:
        mod.__file__ = str(path)
        code = compile(path.read_text(), str(path), "exec")  # a real file name: Triton reads the source
        exec(code, mod.__dict__)
    return mod


def _functions(path: Path, names: tuple[str, ...], env: dict[str, Any], release: str) -> dict[str, Any]:
    """The named top-level functions (or classes) of ``path``, compiled from its source with ``env``
    (a function's decorators and annotations left out)."""
    tree = ast.parse(path.read_text(), str(path))
    defs = (ast.FunctionDef, ast.ClassDef)
    keep: list[ast.stmt] = [n for n in tree.body if isinstance(n, defs) and n.name in names]
    missing = set(names) - {n.name for n in keep if isinstance(n, defs)}
    if missing:
        raise Unavailable(f"{path} has no {sorted(missing)}: not vLLM {release}'s file")
    for n in keep:
        if isinstance(n, ast.FunctionDef):
            n.decorator_list = []
            n.returns = None
            a = n.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    arg.annotation = None
    glb = dict(env)
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), glb)
    return {n: glb[n] for n in names}


def _assigned(path: Path, name: str, env: dict[str, Any]) -> Any:
    """The value of the top-level assignment ``name = ...`` in ``path``, evaluated with ``env``."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            glb = dict(env)
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), glb)
            return glb[name]
    raise Unavailable(f"{path} defines no {name}")


class _Logger:
    """vLLM's ``init_logger``: its own MRV2 code logs through it, each line marked as vLLM's (and which
    release's).

    The first line in a process also says why a vLLM line appears at all: the bench and the tests
    run vLLM's own classes as the baseline they compare with (vLLM's NonUvaBuffer, say, logs its
    "falling back to device memory" where that baseline runs without pinned memory or on a CPU).
    """

    explained = False
    WHY = (
        " [from vLLM's own MRV2 code, which the bench and tests run as their baseline: it is about "
        "vLLM's classes, not stagebuf's]"
    )

    def __init__(self, name: str, release: str = NEWEST):
        self._log = logging.getLogger(name)
        self._once: set[str] = set()
        self.release = release

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
    """Stand-in for vLLM's compiled ``get_cuda_view_from_cpu_tensor``: the pinned tensor's device alias."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:  # pragma: no cover - cuda-python < 12.6
        from cuda import cudart as rt
    err, ptr = rt.cudaHostGetDevicePointer(cpu.data_ptr(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer: {err}")
    typestr = {torch.int32: "<i4", torch.int64: "<i8", torch.float32: "<f4", torch.uint64: "<u8"}[cpu.dtype]

    class _Iface:
        __cuda_array_interface__ = {
            "data": (int(ptr), False), "shape": tuple(cpu.shape), "typestr": typestr,
            "strides": None, "version": 3,
        }  # fmt: skip

    view = torch.as_tensor(_Iface(), device=torch.device("cuda", torch.cuda.current_device()))
    view._stagebuf_owner = cpu  # type: ignore[attr-defined]  # keep the host memory alive
    return view


def _stub(what: str) -> Callable[..., Any]:
    def f(*a: Any, **k: Any) -> Any:
        raise NotImplementedError(f"vllm_mrv2: {what} is a stub (the input path never calls it)")

    return f


def _register_inplace_h2d_target(t: torch.Tensor) -> None:
    """Stand-in for vLLM's ``register_inplace_h2d_target`` (its confidential-computing copy patch, never
    installed here): records the tensor, weakly."""
    INPLACE_H2D_TARGETS.append(weakref.ref(t))


class Mrv2:
    """One load of MRV2's input-side modules on one buffer layer."""

    def __init__(self, **mods: Any):
        self.buffer_utils = mods["buffer_utils"]
        self.block_table = mods["block_table"]
        self.states = mods["states"]
        self.input_batch = mods["input_batch"]
        self.sample_states = mods["sample_states"]
        self.async_tensor_h2d: Callable[..., torch.Tensor] = mods["async_tensor_h2d"]
        self.CpuGpuBuffer: Any = mods["CpuGpuBuffer"]
        """vLLM V1's ``CpuGpuBuffer`` (``vllm/v1/utils.py``), still in every release of RELEASES."""
        self.layer: str = mods["layer"]
        self.pin: bool = mods["pin"]
        self.release: str = mods.get("release", NEWEST)
        self.spec: Release = spec(self.release)
        self.TokenBuffer: Any = mods.get("TokenBuffer")
        """vLLM's ``TokenBuffer`` (``vllm/v1/token_buffer.py``, one class per release), None before 0.34."""


_LOADS: dict[tuple[Any, ...], Mrv2] = {}


def load(
    layer: str = "vllm",
    pin: bool = True,
    device: torch.device | None = None,
    uva: bool | None = None,
    release: str = NEWEST,
) -> Mrv2:
    """MRV2's modules of vLLM ``release`` on ``layer`` (``"vllm"`` or ``"stagebuf"``), loaded once per
    arguments.

    ``pin`` is what vLLM's platform reports for pinned memory (``False``: its
    NonUvaBuffer fallback and pageable ``async_tensor_h2d``); stagebuf's classes
    ask stagebuf's probe instead (force a tier with ``STAGEBUF_TIER``). ``uva``
    overrides ``is_uva_available()`` (``False`` on a CPU: vLLM's NonUvaBuffer with the
    CPU standing in for the device, as the CPU tests of the fallback need).
    Triton reads ``TRITON_INTERPRET`` when the kernels are defined, so a load made
    without it stays compiled and one made with it stays interpreted.
    """
    if layer not in ("vllm", "stagebuf"):
        raise ValueError(f"layer={layer!r}; allowed: 'vllm', 'stagebuf'")
    spec(release)
    dev = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    key = (release, layer, pin, str(dev), uva, os.environ.get("TRITON_INTERPRET") == "1")
    got = _LOADS.get(key)
    if got is None:
        got = _LOADS[key] = _load(layer, pin, dev, uva, release)
    return got


_TOKEN_BUFFERS: dict[str, Any] = {}


def _token_buffer_module(root: Path, release: str) -> Any:
    """vLLM ``release``'s ``vllm/v1/token_buffer.py``, loaded once per release (its ``as_list`` vLLM's),
    so that every load of the release shares one ``TokenBuffer`` class; None before 0.34."""
    if not spec(release).token_buffer:
        return None
    got = _TOKEN_BUFFERS.get(release)
    if got is None:
        f = root / "vllm"
        as_list = _functions(f / "utils/collection_utils.py", ("as_list",), {}, release)["as_list"]
        imports = {"vllm.utils.collection_utils": types.SimpleNamespace(as_list=as_list)}
        got = _TOKEN_BUFFERS[release] = _module("vllm_mrv2.token_buffer", f / "v1/token_buffer.py", imports)
    return got


def token_buffer(release: str = NEWEST) -> Any:
    """vLLM ``release``'s ``TokenBuffer`` class (fetching its files), or None where it has none."""
    mod = _token_buffer_module(fetch(release), release) if spec(release).token_buffer else None
    return None if mod is None else mod.TokenBuffer


def _stand_ins(root: Path, pin: bool, dev: torch.device, uva: bool | None, release: str) -> dict[str, Any]:
    """What MRV2's files import from the rest of vLLM: its own functions where the input path
    calls them, stand-ins for the platform layer, stubs for sampler kernels never called."""
    cpu = dev.type == "cpu"
    rel = spec(release)
    import triton
    import triton.language as tl

    f = root / "vllm"
    triton_utils = types.SimpleNamespace(triton=triton, tl=tl, HAS_TRITON=True)
    is_pinned_ok = pin and not cpu

    def pin_memory_available() -> bool:
        return is_pinned_ok

    platform = types.SimpleNamespace(
        device_type=dev.type,
        is_cpu=lambda: cpu,
        is_cuda_alike=lambda: not cpu,
        is_xpu=lambda: False,
        is_pin_memory_available=pin_memory_available,
        is_confidential_compute=lambda: CONFIDENTIAL_COMPUTE,
    )
    # torch_utils' async_tensor_h2d reads PIN_MEMORY (0.33, 0.34) or calls is_pin_memory_available() (0.32)
    h2d_env = {
        "torch": torch,
        "np": np,
        "PIN_MEMORY": is_pinned_ok,
        "is_pin_memory_available": pin_memory_available,
    }
    if cpu:  # vLLM's CPU worker patches its own async_tensor_h2d in (vllm/v1/worker/cpu/shm.py)
        h2d = _functions(f / "v1/worker/cpu/shm.py", ("async_tensor_h2d",), h2d_env, release)
    else:
        h2d = _functions(f / "utils/torch_utils.py", ("async_tensor_h2d",), h2d_env, release)
    torch_utils = types.SimpleNamespace(
        async_tensor_h2d=h2d["async_tensor_h2d"], get_accelerator_view_from_cpu_tensor=_cuda_view
    )
    if rel.array_typecodes:
        torch_utils.TORCH_DTYPE_TO_ARRAY_TYPECODE = _assigned(
            f / "utils/torch_utils.py", "TORCH_DTYPE_TO_ARRAY_TYPECODE", {"torch": torch}
        )
    math_utils = _module("vllm_mrv2.math_utils", f / "utils/math_utils.py", {})
    imports: dict[str, Any] = {
        "vllm.logger": types.SimpleNamespace(init_logger=functools.partial(_Logger, release=release)),
        "vllm.triton_utils": triton_utils,
        # vLLM: is_uva_available() = pinned memory available, or the CPU platform
        "vllm.utils.platform_utils": types.SimpleNamespace(
            is_uva_available=lambda: (is_pinned_ok or cpu) if uva is None else uva,
            is_pin_memory_available=pin_memory_available,
        ),
        "vllm.utils.torch_utils": torch_utils,
        "vllm.utils.math_utils": math_utils,
        "vllm.utils": types.SimpleNamespace(random_uuid=lambda: f"{uuid.uuid4().int & (2**64 - 1):016x}"),
        "vllm.platforms": types.SimpleNamespace(current_platform=platform),
        "vllm.v1.attention.backends.utils": types.SimpleNamespace(
            PAD_SLOT_ID=_assigned(f / "v1/attention/backends/utils.py", "PAD_SLOT_ID", {})
        ),
        "vllm.sampling_params": types.SimpleNamespace(SamplingParams=object),
        "vllm.v1.sample.ops.topk_topp_sampler": types.SimpleNamespace(apply_top_k_top_p=_stub("top-k/top-p")),
        "vllm.v1.worker.gpu.sample.gumbel": types.SimpleNamespace(apply_temperature=_stub("temperature")),
        "vllm.v1.worker.gpu.sample.min_p": types.SimpleNamespace(apply_min_p=_stub("min-p")),
        "_CpuGpuBuffer": _functions(
            f / "v1/utils.py",
            ("CpuGpuBuffer",),
            {"torch": torch, "np": np, "PIN_MEMORY": is_pinned_ok},
            release,
        )["CpuGpuBuffer"],
    }
    if rel.confidential_compute:
        cc = types.ModuleType("vllm.v1.conf_compute_utils")
        cc.register_inplace_h2d_target = _register_inplace_h2d_target  # type: ignore[attr-defined]
        imports["vllm.v1.conf_compute_utils"] = cc
    tb = _token_buffer_module(root, release)
    if tb is not None:
        imports["vllm.v1.token_buffer"] = tb
    return imports


def _load(layer: str, pin: bool, dev: torch.device, uva: bool | None, release: str) -> Mrv2:
    root = fetch(release)
    f = root / "vllm"
    cpu = dev.type == "cpu"
    imports = _stand_ins(root, pin, dev, uva, release)
    vbu = _module("vllm_mrv2.buffer_utils", f / "v1/worker/gpu/buffer_utils.py", imports)
    if cpu and uva is not False:  # as vLLM's CPU worker does: gpu_buffer_utils.UvaBuffer = cpu's
        cbu = _module("vllm_mrv2.cpu_buffer_utils", f / "v1/worker/cpu/buffer_utils.py", imports)
        vbu.UvaBuffer = cbu.UvaBuffer
    if layer == "stagebuf":
        bu: Any = stagebuf_buffer_utils(vbu, release)
    else:
        bu = vbu
    imports["vllm.v1.worker.gpu.buffer_utils"] = bu
    bt = _module("vllm_mrv2.block_table", f / "v1/worker/gpu/block_table.py", imports)
    st = _module("vllm_mrv2.states", f / "v1/worker/gpu/states.py", imports)
    ib = _module("vllm_mrv2.input_batch", f / "v1/worker/gpu/input_batch.py", imports)
    ss = _module("vllm_mrv2.sample_states", f / "v1/worker/gpu/sample/states.py", imports)
    tb = imports.get("vllm.v1.token_buffer")
    return Mrv2(
        buffer_utils=bu,
        block_table=bt,
        states=st,
        input_batch=ib,
        sample_states=ss,
        async_tensor_h2d=imports["vllm.utils.torch_utils"].async_tensor_h2d,
        CpuGpuBuffer=imports["_CpuGpuBuffer"],
        layer=layer,
        pin=pin,
        release=release,
        TokenBuffer=None if tb is None else tb.TokenBuffer,
    )


SUBSTITUTED = (
    "UvaBuffer",
    "NonUvaBuffer",
    "UvaBufferPool",
    "UvaBackedTensor",
    "StagedWriteTensor",
    "FusedStagedWriter",
    "set_default_max_concurrency",
)


def stagebuf_buffer_utils(vllm_bu: Any, release: str = NEWEST) -> Any:
    """A ``buffer_utils`` (vLLM ``release``'s) with stagebuf's classes in place of MRV2's (vLLM's
    ``_load_ptr`` kept)."""
    import stagebuf

    spec(release)
    mod = types.ModuleType(f"vllm_mrv2.buffer_utils[{release}, stagebuf]")
    mod.__dict__.update({k: v for k, v in vars(vllm_bu).items() if not k.startswith("__")})
    for name in SUBSTITUTED:
        setattr(mod, name, getattr(stagebuf, name))
    return mod


_INSTALLED = (
    "vllm",
    "vllm.envs",
    "vllm.plugins",
    "vllm.v1",
    "vllm.v1.conf_compute_utils",
    "vllm.v1.token_buffer",
    "vllm.v1.worker",
    "vllm.v1.worker.gpu",
    "vllm.v1.worker.gpu.sample",
    "vllm.v1.worker.gpu.buffer_utils",
    "vllm.v1.worker.gpu.block_table",
    "vllm.v1.worker.gpu.states",
    "vllm.v1.worker.gpu.input_batch",
    "vllm.v1.worker.gpu.sample.states",
    "vllm.v1.worker.gpu.model_runner",
)


def _runner_stand_in(h2d: Callable[..., torch.Tensor], root: Path) -> types.ModuleType:
    """``vllm.v1.worker.gpu.model_runner`` for the harness: vLLM's own ``async_tensor_h2d`` bound as the
    model runner binds it, and a ``GPUModelRunner`` with vLLM's ``execute_model`` and ``prepare_inputs``
    signatures (the real module needs the whole of vLLM). Its ``execute_model`` runs
    ``scheduler_output()``: the harness passes its step (``engine.Engine.prepare``) as a callable,
    so stagebuf's step-mode wrapper runs around the harness's step as around vLLM's.

    The module's ``__file__`` is the release's real ``model_runner.py`` (under ``root``), and
    ``GPUModelRunner.__module__`` names the module: what reads the runner's source through its module
    (``inspect``, an ast reader of ``__file__``) reads vLLM's own."""
    mod = types.ModuleType("vllm.v1.worker.gpu.model_runner")
    mod.__file__ = str(root / "vllm/v1/worker/gpu/model_runner.py")

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
    GPUModelRunner.__qualname__ = "GPUModelRunner"
    mod.GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
    mod.async_tensor_h2d = h2d  # type: ignore[attr-defined]
    return mod


class _Imports(dict):  # type: ignore[type-arg]
    """Stand-ins, except for vLLM's own modules that ``as_installed`` put in ``sys.modules``."""

    def __contains__(self, key: object) -> bool:
        return key in sys.modules and key in _INSTALLED or dict.__contains__(self, key)

    def __getitem__(self, key: str) -> Any:
        if key in _INSTALLED and key in sys.modules:
            return sys.modules[key]
        return dict.__getitem__(self, key)


class Installed:
    """vLLM ``release``'s modules importable under their own names (see :func:`as_installed`)."""

    def __init__(self, root: Path, imports: _Imports, release: str = NEWEST):
        self._root, self._imports, self.release = root, imports, release

    @property
    def TokenBuffer(self) -> Any:  # noqa: N802  (vLLM's name)
        """The release's ``TokenBuffer`` (``vllm.v1.token_buffer``), None before 0.34."""
        mod = sys.modules.get("vllm.v1.token_buffer")
        return None if mod is None else mod.TokenBuffer

    def load(self, name: str) -> Any:
        """Execute MRV2's ``vllm/v1/worker/gpu/<name>.py`` as ``vllm.v1.worker.gpu.<name>`` now
        (``sample.states`` too): its ``from vllm... import`` binds what ``sys.modules`` holds."""
        full = f"vllm.v1.worker.gpu.{name}"
        path = self._root / "vllm/v1/worker/gpu" / (name.replace(".", "/") + ".py")
        mod = _module(full, path, self._imports, real=True)
        parent, _, child = full.rpartition(".")
        setattr(sys.modules[parent], child, mod)
        return mod


@contextmanager
def as_installed(
    device: torch.device | None = None, pin: bool = True, release: str = NEWEST
) -> Iterator[Installed]:
    """vLLM ``release`` importable as ``vllm``, for the tests of stagebuf's vLLM plugin.

    Its real ``vllm/plugins/__init__.py`` (vLLM's own plugin loader) and MRV2's ``buffer_utils``
    are put in ``sys.modules`` under their own names (and, where the release has them,
    ``vllm.v1.token_buffer`` and the stand-in ``vllm.v1.conf_compute_utils``); ``Installed.load`` adds
    the MRV2 modules that use them, in the order a test chooses. ``vllm.__version__`` is ``release``;
    ``vllm.envs`` is a stand-in that reads ``VLLM_PLUGINS`` as vLLM does;
    ``vllm.v1.worker.gpu.model_runner`` is :func:`_runner_stand_in`'s, its ``__file__`` the release's
    real ``model_runner.py``. Everything is removed on exit; raises if a module named ``vllm`` is
    already imported (an installed vLLM).
    """
    if any(n in sys.modules for n in _INSTALLED):
        raise RuntimeError("a module named vllm is already imported; as_installed would shadow it")
    root = fetch(release)
    dev = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    imports = _Imports(_stand_ins(root, pin, dev, None, release))

    class _Envs(types.ModuleType):
        @property
        def VLLM_PLUGINS(self) -> list[str] | None:  # noqa: N802  (vLLM's name)
            v = os.environ.get("VLLM_PLUGINS")
            return None if v is None else v.split(",")

    try:
        for n in ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.sample"):
            pkg = types.ModuleType(n)
            pkg.__path__ = []
            sys.modules[n] = pkg
            parent, _, child = n.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, pkg)
        sys.modules["vllm"].__version__ = release  # type: ignore[attr-defined]  # as vllm/__init__ sets it
        envs = sys.modules["vllm.envs"] = _Envs("vllm.envs")
        sys.modules["vllm"].envs = envs  # type: ignore[attr-defined]
        sys.modules["vllm"].plugins = _module(  # type: ignore[attr-defined]
            "vllm.plugins", root / "vllm/plugins/__init__.py", imports, real=True
        )
        for n in ("vllm.v1.token_buffer", "vllm.v1.conf_compute_utils"):  # where the release has them
            mod = dict.get(imports, n)
            if mod is not None:  # (the release's one TokenBuffer class, under vLLM's name)
                sys.modules[n] = mod
                setattr(sys.modules["vllm.v1"], n.rpartition(".")[2], mod)
        inst = Installed(root, imports, release)
        mr = sys.modules["vllm.v1.worker.gpu.model_runner"] = _runner_stand_in(
            imports["vllm.utils.torch_utils"].async_tensor_h2d, root
        )
        sys.modules["vllm.v1.worker.gpu"].model_runner = mr  # type: ignore[attr-defined]
        bu = inst.load("buffer_utils")
        if dev.type == "cpu":  # as vLLM's CPU worker does
            bu.UvaBuffer = _module(
                "cpu_buffer_utils", root / "vllm/v1/worker/cpu/buffer_utils.py", imports
            ).UvaBuffer
        yield inst
    finally:
        for n in _INSTALLED:
            sys.modules.pop(n, None)


# --- the command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_mrv2",
        description="vLLM's MRV2 files for the harness: fetch them, or ask the registry for a newer release.",
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--check-new",
        action="store_true",
        help="list vLLM releases newer than the newest in RELEASES: exit 1 if any, 0 if none, 2 if the "
        "package registry cannot be asked",
    )
    g.add_argument(
        "--fetch",
        nargs="*",
        metavar="RELEASE",
        help=f"fetch these releases' files (default: all of {', '.join(RELEASES)}) and print their folders",
    )
    a = p.parse_args(argv)
    if a.check_new:
        try:
            new = newer_releases()
        except Unavailable as e:
            print(f"cannot check for newer vLLM releases: {e}", file=sys.stderr)
            return 2
        if new:
            print(
                f"vLLM releases newer than {NEWEST}: {', '.join(new)} "
                "(add them to RELEASES in benchmarks/vllm_mrv2.py)"
            )
            return 1
        print(f"no vLLM release newer than {NEWEST}")
        return 0
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
