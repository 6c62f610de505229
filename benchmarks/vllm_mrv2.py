"""vLLM 0.33.0's own MRV2 input-side modules, loaded unmodified, on vLLM's buffer layer or on stagebuf's.

The peer is vLLM's released code, fetched at bench or test time and never
committed: ``fetch()`` takes the few source files it needs from the installed
vLLM when that is 0.33.0, else from the released wheel (``pip download --no-deps
vllm==0.33.0``, about 340 MB, of which a few hundred KB of Python are kept in
``cache_dir()``). A machine without network (the GPU box) gets that folder carried.

``load()`` executes the files as modules of their own, under private names
(``_vllm_mrv2_<n>.block_table``; no ``vllm`` module is created or imported), each
with the imports it names resolved to:

* vLLM's own code where the import is MRV2's: ``buffer_utils`` (UvaBuffer,
  NonUvaBuffer, UvaBufferPool, UvaBackedTensor, StagedWriteTensor,
  FusedStagedWriter and the staged-write Triton kernel), ``block_table``,
  ``states``, ``input_batch``, ``sample/states``; ``async_tensor_h2d`` and
  ``cdiv`` are vLLM's functions, compiled from its files; on the CPU, the CPU
  backend's own ``UvaBuffer`` and ``async_tensor_h2d`` (``vllm/v1/worker/cpu``),
  patched in as vLLM's CPU worker does;
* small stand-ins for what vLLM's platform layer decides or compiles: the
  logger, ``is_uva_available`` / ``PIN_MEMORY`` (the ``pin`` argument: ``False``
  is a machine without pinned memory, where vLLM takes its NonUvaBuffer
  fallback), ``current_platform.device_type``, and the compiled
  ``get_cuda_view_from_cpu_tensor`` op (here: ``cudaHostGetDevicePointer``
  through cuda-bindings, wrapped without a copy);
* stubs (raise if called) for sampler kernels that ``sample/states.py`` imports
  but the input path never calls.

With ``layer="stagebuf"`` the MRV2 modules get stagebuf's classes in place of
``buffer_utils``' (the direct substitution that stagebuf's vLLM plugin makes);
vLLM's Triton helper ``_load_ptr`` stays vLLM's.
"""

from __future__ import annotations

import ast
import builtins
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import types
import uuid
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

VERSION = "0.33.0"
FILES = (
    "vllm/v1/worker/gpu/buffer_utils.py",
    "vllm/v1/worker/gpu/block_table.py",
    "vllm/v1/worker/gpu/states.py",
    "vllm/v1/worker/gpu/input_batch.py",
    "vllm/v1/worker/gpu/sample/states.py",
    "vllm/v1/worker/cpu/buffer_utils.py",
    "vllm/v1/worker/cpu/shm.py",
    "vllm/utils/torch_utils.py",
    "vllm/utils/math_utils.py",
    "vllm/v1/attention/backends/utils.py",
    "vllm/v1/utils.py",
    "vllm/plugins/__init__.py",
)
ENV_DIR = "STAGEBUF_VLLM_DIR"
"""Where the fetched vLLM files are kept (default: ``.cache/vllm-0.33.0`` in the checkout)."""


class Unavailable(RuntimeError):
    """vLLM 0.33.0's files could not be had here (the reason says why)."""


def available() -> str | None:
    """Why vLLM 0.33.0's MRV2 modules cannot be loaded here (None: they can); fetches once."""
    global _why
    if _why is None:
        try:
            fetch()
            import triton  # noqa: F401  (MRV2's buffer_utils defines a Triton kernel at import)

            _why = ""
        except Unavailable as e:
            _why = str(e)
        except ImportError as e:
            _why = f"vLLM's MRV2 modules need Triton ({e})"
    return _why or None


_why: str | None = None


def cache_dir() -> Path:
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given)
    return Path(__file__).resolve().parents[1] / ".cache" / f"vllm-{VERSION}"


def _have(root: Path) -> bool:
    return all((root / f).is_file() for f in FILES)


def _installed_root() -> Path | None:
    """The installed vLLM's site folder, if it is version 0.33.0."""
    try:
        from importlib import metadata

        if metadata.version("vllm") != VERSION:
            return None
        dist = metadata.distribution("vllm")
    except Exception:
        return None
    root = Path(str(dist.locate_file("")))
    return root if _have(root) else None


def fetch(quiet: bool = True) -> Path:
    """The folder holding ``FILES`` (vLLM 0.33.0's), fetched if needed; raises Unavailable."""
    root = cache_dir()
    if _have(root):
        return root
    src = _installed_root()
    if src is not None:
        for f in FILES:
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f, root / f)
        return root
    with tempfile.TemporaryDirectory() as tmp:
        # Only Python files are taken from the wheel, so any platform's wheel will do.
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12",
            "--implementation", "cp", "-d", tmp, f"vllm=={VERSION}",
        ]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"pip download vllm=={VERSION} failed: {e}") from e
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise Unavailable(f"pip download vllm=={VERSION} failed: {tail[0][:300]}")
        with zipfile.ZipFile(wheels[0]) as z:
            for f in FILES:
                (root / f).parent.mkdir(parents=True, exist_ok=True)
                (root / f).write_bytes(z.read(f))
    if not quiet:
        print(f"vllm_mrv2: vLLM {VERSION}'s files are in {root}", file=sys.stderr)
    return root


# --- executing vLLM's files as private modules ------------------------------------------------


_serial = 0


def _module(name: str, path: Path | None, imports: Any, real: bool = False) -> Any:
    """Execute the file at ``path`` as a new module; ``vllm.*`` imports resolve in ``imports``.

    The module is named ``_vllm_mrv2_<n>.<last part of name>`` (every load its own), or ``name``
    itself with ``real`` (``as_installed``); either way it is put in ``sys.modules``, where
    dataclasses look their module up.
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
        code = compile(path.read_text(), str(path), "exec")  # a real file name: Triton reads the source
        exec(code, mod.__dict__)
    return mod


def _functions(path: Path, names: tuple[str, ...], env: dict[str, Any]) -> dict[str, Any]:
    """The named top-level functions (or classes) of ``path``, compiled from its source with ``env``."""
    tree = ast.parse(path.read_text(), str(path))
    defs = (ast.FunctionDef, ast.ClassDef)
    keep: list[ast.stmt] = [n for n in tree.body if isinstance(n, defs) and n.name in names]
    missing = set(names) - {n.name for n in keep if isinstance(n, defs)}
    if missing:
        raise Unavailable(f"{path} has no {sorted(missing)}: not vLLM {VERSION}'s file")
    for n in keep:
        if isinstance(n, ast.FunctionDef):
            n.decorator_list = []
    glb = dict(env)
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), glb)
    return {n: glb[n] for n in names}


def _constant(path: Path, name: str) -> Any:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise Unavailable(f"{path} defines no {name}")


class _Logger:
    """vLLM's ``init_logger``: its own MRV2 code logs through it, each line marked as vLLM's.

    The first line in a process also says why a vLLM line appears at all: the bench and the tests
    run vLLM's own classes as the baseline they compare with (vLLM's NonUvaBuffer, say, logs its
    "falling back to device memory" where that baseline runs without pinned memory or on a CPU).
    """

    explained = False
    WHY = (
        " [from vLLM's own MRV2 code, which the bench and tests run as their baseline: it is about "
        "vLLM's classes, not stagebuf's]"
    )

    def __init__(self, name: str):
        self._log = logging.getLogger(name)
        self._once: set[str] = set()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._log, attr)

    def warning_once(self, msg: str, *args: Any, **kw: Any) -> None:
        if msg not in self._once:
            self._once.add(msg)
            why = "" if _Logger.explained else self.WHY
            _Logger.explained = True
            self._log.warning(f"vLLM {VERSION}: {msg}{why}", *args)

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
        """vLLM V1's ``CpuGpuBuffer`` (``vllm/v1/utils.py``), still in 0.33.0."""
        self.layer: str = mods["layer"]
        self.pin: bool = mods["pin"]


_LOADS: dict[tuple[Any, ...], Mrv2] = {}


def load(
    layer: str = "vllm", pin: bool = True, device: torch.device | None = None, uva: bool | None = None
) -> Mrv2:
    """MRV2's modules on ``layer`` (``"vllm"`` or ``"stagebuf"``), loaded once per arguments.

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
    dev = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    key = (layer, pin, str(dev), uva, os.environ.get("TRITON_INTERPRET") == "1")
    got = _LOADS.get(key)
    if got is None:
        got = _LOADS[key] = _load(layer, pin, dev, uva)
    return got


def _stand_ins(root: Path, pin: bool, dev: torch.device, uva: bool | None) -> dict[str, Any]:
    """What MRV2's files import from the rest of vLLM: its own functions where the input path
    calls them, stand-ins for the platform layer, stubs for sampler kernels never called."""
    cpu = dev.type == "cpu"
    import triton
    import triton.language as tl

    f = root / "vllm"
    triton_utils = types.SimpleNamespace(triton=triton, tl=tl, HAS_TRITON=True)
    is_pinned_ok = pin and not cpu
    platform = types.SimpleNamespace(
        device_type=dev.type,
        is_cpu=lambda: cpu,
        is_cuda_alike=lambda: not cpu,
        is_xpu=lambda: False,
        is_pin_memory_available=lambda: is_pinned_ok,
    )
    if cpu:  # vLLM's CPU worker patches its own async_tensor_h2d in (vllm/v1/worker/cpu/shm.py)
        h2d = _functions(f / "v1/worker/cpu/shm.py", ("async_tensor_h2d",), {"torch": torch, "np": np})
    else:
        h2d = _functions(
            f / "utils/torch_utils.py",
            ("async_tensor_h2d",),
            {"torch": torch, "np": np, "PIN_MEMORY": is_pinned_ok},
        )
    torch_utils = types.SimpleNamespace(
        async_tensor_h2d=h2d["async_tensor_h2d"], get_accelerator_view_from_cpu_tensor=_cuda_view
    )
    math_utils = _module("vllm_mrv2.math_utils", f / "utils/math_utils.py", {})
    imports: dict[str, Any] = {
        "vllm.logger": types.SimpleNamespace(init_logger=_Logger),
        "vllm.triton_utils": triton_utils,
        # vLLM: is_uva_available() = pinned memory available, or the CPU platform
        "vllm.utils.platform_utils": types.SimpleNamespace(
            is_uva_available=lambda: (is_pinned_ok or cpu) if uva is None else uva,
            is_pin_memory_available=lambda: is_pinned_ok,
        ),
        "vllm.utils.torch_utils": torch_utils,
        "vllm.utils.math_utils": math_utils,
        "vllm.utils": types.SimpleNamespace(random_uuid=lambda: f"{uuid.uuid4().int & (2**64 - 1):016x}"),
        "vllm.platforms": types.SimpleNamespace(current_platform=platform),
        "vllm.v1.attention.backends.utils": types.SimpleNamespace(
            PAD_SLOT_ID=_constant(f / "v1/attention/backends/utils.py", "PAD_SLOT_ID")
        ),
        "vllm.sampling_params": types.SimpleNamespace(SamplingParams=object),
        "vllm.v1.sample.ops.topk_topp_sampler": types.SimpleNamespace(apply_top_k_top_p=_stub("top-k/top-p")),
        "vllm.v1.worker.gpu.sample.gumbel": types.SimpleNamespace(apply_temperature=_stub("temperature")),
        "vllm.v1.worker.gpu.sample.min_p": types.SimpleNamespace(apply_min_p=_stub("min-p")),
        "_CpuGpuBuffer": _functions(
            f / "v1/utils.py", ("CpuGpuBuffer",), {"torch": torch, "np": np, "PIN_MEMORY": is_pinned_ok}
        )["CpuGpuBuffer"],
    }
    return imports


def _load(layer: str, pin: bool, dev: torch.device, uva: bool | None) -> Mrv2:
    root = fetch()
    f = root / "vllm"
    cpu = dev.type == "cpu"
    imports = _stand_ins(root, pin, dev, uva)
    vbu = _module("vllm_mrv2.buffer_utils", f / "v1/worker/gpu/buffer_utils.py", imports)
    if cpu and uva is not False:  # as vLLM's CPU worker does: gpu_buffer_utils.UvaBuffer = cpu's
        cbu = _module("vllm_mrv2.cpu_buffer_utils", f / "v1/worker/cpu/buffer_utils.py", imports)
        vbu.UvaBuffer = cbu.UvaBuffer
    if layer == "stagebuf":
        bu: Any = stagebuf_buffer_utils(vbu)
    else:
        bu = vbu
    imports["vllm.v1.worker.gpu.buffer_utils"] = bu
    bt = _module("vllm_mrv2.block_table", f / "v1/worker/gpu/block_table.py", imports)
    st = _module("vllm_mrv2.states", f / "v1/worker/gpu/states.py", imports)
    ib = _module("vllm_mrv2.input_batch", f / "v1/worker/gpu/input_batch.py", imports)
    ss = _module("vllm_mrv2.sample_states", f / "v1/worker/gpu/sample/states.py", imports)
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


def stagebuf_buffer_utils(vllm_bu: Any) -> Any:
    """A ``buffer_utils`` with stagebuf's classes in place of MRV2's (vLLM's ``_load_ptr`` kept)."""
    import stagebuf

    mod = types.ModuleType("vllm_mrv2.buffer_utils[stagebuf]")
    mod.__dict__.update({k: v for k, v in vars(vllm_bu).items() if not k.startswith("__")})
    for name in SUBSTITUTED:
        setattr(mod, name, getattr(stagebuf, name))
    return mod


_INSTALLED = (
    "vllm",
    "vllm.envs",
    "vllm.plugins",
    "vllm.v1",
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


def _runner_stand_in(h2d: Callable[..., torch.Tensor]) -> types.ModuleType:
    """``vllm.v1.worker.gpu.model_runner`` for the harness: vLLM's own ``async_tensor_h2d`` bound as the
    model runner binds it, and a ``GPUModelRunner`` with vLLM 0.33's ``execute_model`` and
    ``prepare_inputs`` signatures (the real module needs the whole of vLLM). Its ``execute_model``
    runs ``scheduler_output()``: the harness passes its step (``engine.Engine.prepare``) as a callable,
    so stagebuf's step-mode wrapper runs around the harness's step as around vLLM's."""
    mod = types.ModuleType("vllm.v1.worker.gpu.model_runner")

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
    """vLLM 0.33.0's modules importable under their own names (see :func:`as_installed`)."""

    def __init__(self, root: Path, imports: _Imports):
        self._root, self._imports = root, imports

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
def as_installed(device: torch.device | None = None, pin: bool = True) -> Iterator[Installed]:
    """vLLM 0.33.0 importable as ``vllm``, for the tests of stagebuf's vLLM plugin.

    Its real ``vllm/plugins/__init__.py`` (vLLM's own plugin loader) and MRV2's ``buffer_utils``
    are put in ``sys.modules`` under their own names; ``Installed.load`` adds the MRV2 modules
    that use them, in the order a test chooses. ``vllm.envs`` is a stand-in that reads
    ``VLLM_PLUGINS`` as vLLM does. Everything is removed on exit; raises if a module named
    ``vllm`` is already imported (an installed vLLM).
    """
    if any(n in sys.modules for n in _INSTALLED):
        raise RuntimeError("a module named vllm is already imported; as_installed would shadow it")
    root = fetch()
    dev = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    imports = _Imports(_stand_ins(root, pin, dev, None))

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
        sys.modules["vllm"].__version__ = VERSION  # type: ignore[attr-defined]  # as vllm/__init__ sets it
        envs = sys.modules["vllm.envs"] = _Envs("vllm.envs")
        sys.modules["vllm"].envs = envs  # type: ignore[attr-defined]
        sys.modules["vllm"].plugins = _module(  # type: ignore[attr-defined]
            "vllm.plugins", root / "vllm/plugins/__init__.py", imports, real=True
        )
        inst = Installed(root, imports)
        mr = sys.modules["vllm.v1.worker.gpu.model_runner"] = _runner_stand_in(
            imports["vllm.utils.torch_utils"].async_tensor_h2d
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
