"""stagebuf as vLLM's MRV2 buffer layer: an opt-in vLLM general plugin.

The entry point ``stagebuf`` in the group ``vllm.general_plugins`` is :func:`register`.
vLLM loads general plugins in every engine and worker process before the model runner
is built, and several times in one process; ``register`` is idempotent.

* **Opt-in.** ``STAGEBUF_VLLM=1`` switches it on; unset (or ``0``) leaves vLLM untouched;
  any other value raises :class:`~stagebuf.SetupError` (a ``ValueError``) naming the allowed
  values (vLLM then stops at start-up, which is what a mistyped setting should do).
* **Version safety.** Before anything is replaced, the names and parameters of vLLM's
  ``vllm.v1.worker.gpu.buffer_utils`` are compared with :data:`API`, the API of the
  vLLM versions in :data:`TESTED`. If they differ, vLLM's layer stays whole and one
  log line says what differed. Nothing is ever half-patched: every replacement is
  computed first and applied together.
* **What it replaces.** ``UvaBuffer``, ``NonUvaBuffer``, ``UvaBufferPool``,
  ``UvaBackedTensor``, ``StagedWriteTensor``, ``FusedStagedWriter`` and
  ``set_default_max_concurrency`` in ``buffer_utils``, and the same objects wherever a
  module of ``vllm`` already imported bound them (``from ... import``), so the order in
  which vLLM imported its modules does not matter.
* **One log line per process** when on. The tier needs a probe of the device, which
  initialises CUDA; the plugin does not do that in processes that never build a buffer
  (vLLM's API server), so the line is logged when stagebuf first decides a tier in the
  process, with the tier and why.
"""

from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from ._constants import ENV_VLLM, env_flag
from ._log import logger

TESTED = ("0.33.0",)
"""vLLM versions whose MRV2 modules were run on stagebuf (the engine workload and its tests)."""

TARGET = "vllm.v1.worker.gpu.buffer_utils"

API: dict[str, dict[str, tuple[str, ...]]] = {
    "UvaBuffer": {"__init__": ("size", "dtype"), "uva": ("n",)},
    "NonUvaBuffer": {"__init__": ("size", "dtype"), "uva": ("n",)},
    "UvaBufferPool": {
        "__init__": ("size", "dtype", "max_concurrency"),
        "copy_to_uva": ("x",),
        "copy_to_gpu": ("x", "out"),
    },
    "UvaBackedTensor": {"__init__": ("size", "dtype", "max_concurrency"), "copy_to_uva": ("n",)},
    "StagedWriteTensor": {
        "__init__": ("size", "dtype", "device", "max_concurrency", "uva_instead_of_gpu"),
        "stage_write": ("index", "start", "x"),
        "stage_write_elem": ("index", "x"),
        "apply_write": (),
        "clear_staged_writes": (),
    },
    "FusedStagedWriter": {
        "__init__": ("device", "max_writes", "max_concurrency"),
        "apply": ("tensors", "output_ptrs", "output_strides"),
    },
    "set_default_max_concurrency": {"": ("n",)},
}
"""The parameters (after ``self``) of what the plugin replaces, as in the tested vLLM versions."""

REPLACED = tuple(API)


def setting() -> bool:
    """Whether ``STAGEBUF_VLLM`` switches the plugin on; a value other than 0/1 raises SettingValueError."""
    return env_flag(
        ENV_VLLM,
        f"set {ENV_VLLM}=1 to make stagebuf vLLM's MRV2 buffer layer, or 0 (or unset it) for vLLM's own",
    )


def _params(obj: Any) -> tuple[str, ...]:
    sig = inspect.signature(obj)
    return tuple(p for p in sig.parameters if p != "self")


def api_of(module: Any) -> dict[str, dict[str, tuple[str, ...]]]:
    """The API of a ``buffer_utils`` module in the shape of :data:`API` (only the names in it)."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for name, methods in API.items():
        obj = getattr(module, name, None)
        if obj is None:
            continue
        if not inspect.isclass(obj):
            out[name] = {"": _params(obj)}
            continue
        got = {}
        for m in methods:
            fn = getattr(obj, m, None)
            if fn is not None:
                got[m] = _params(fn)
        out[name] = got
    return out


def api_differences(module: Any) -> list[str]:
    """What differs between ``module``'s API and :data:`API` (empty: the same)."""
    have = api_of(module)
    diffs = []
    for name, methods in API.items():
        if name not in have:
            diffs.append(f"{name} is missing")
            continue
        for m, params in methods.items():
            what = f"{name}.{m}" if m else name
            got = have[name].get(m)
            if got is None:
                diffs.append(f"{what} is missing")
            elif got != params:
                diffs.append(f"{what}({', '.join(got)}) instead of ({', '.join(params)})")
    return diffs


def vllm_version() -> str | None:
    """The installed vLLM's version (from its metadata; vLLM is not imported), or None."""
    try:
        from importlib import metadata

        return metadata.version("vllm")
    except Exception:
        return None


@dataclass
class Plan:
    """What the plugin does (or would do) in this process, and why: the answer of :func:`plan`.

    Attributes
    ----------
    enabled : bool
        Whether ``STAGEBUF_VLLM=1``.
    action : str
        ``"patch"`` (it would replace vLLM's layer), ``"patched"`` (:func:`register`
        already did in this process), ``"leave"`` (vLLM's layer stays: its API differs
        from :data:`API`, or it cannot be imported) or ``"off"``.
    why : str
        One sentence saying why.
    replacements : list of tuple
        For ``"patch"``: ``(module, attribute, vLLM's object, stagebuf's object)`` for
        every binding to replace; empty otherwise.
    """

    enabled: bool
    action: str
    why: str
    replacements: list[tuple[Any, str, Any, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """``enabled``, ``action`` and ``why`` as a dict (what ``stagebuf doctor`` reports).

        Returns
        -------
        dict of str to Any
        """
        return {"enabled": self.enabled, "action": self.action, "why": self.why}


_lock = threading.Lock()
_done: dict[str, Any] = {}
"""Per process: the plan that was carried out (register() is idempotent)."""


def plan(module: Any | None = None) -> Plan:
    """What :func:`register` would do now, and why; changes nothing.

    vLLM's ``buffer_utils`` is imported only when ``STAGEBUF_VLLM=1``. After
    :func:`register` ran in this process, the answer is what it did.

    Parameters
    ----------
    module : module, optional
        The ``buffer_utils`` module to compare with :data:`API` instead of importing
        vLLM's (tests pass a stand-in).

    Returns
    -------
    Plan
        ``action`` ``"off"``, ``"leave"``, ``"patch"`` or ``"patched"``, with the reason.

    Raises
    ------
    SetupError
        (a ``ValueError`` too) If ``STAGEBUF_VLLM`` is set to anything but ``0``,
        ``1`` or the empty string; the message names the allowed values.
    """
    if not setting():
        return Plan(False, "off", f"{ENV_VLLM} is not set to 1: vLLM uses its own buffer layer")
    done = _done.get("plan")
    if done is not None:  # register() ran in this process: what it did
        return Plan(True, "patched", done.why) if done.action == "patch" else done
    if module is None:
        try:
            import importlib

            module = importlib.import_module(TARGET)
        except Exception as e:
            return Plan(True, "leave", f"{TARGET} cannot be imported ({type(e).__name__}: {e})"[:300])
    diffs = api_differences(module)
    version = vllm_version()
    if diffs:
        return Plan(
            True,
            "leave",
            f"vLLM {version or '?'}'s {TARGET} differs from the API stagebuf was tested with "
            f"(vLLM {', '.join(TESTED)}): {'; '.join(diffs)}; vLLM's own layer stays in place",
        )
    import stagebuf

    originals = {n: getattr(module, n) for n in REPLACED}
    mine = {n: getattr(stagebuf, n) for n in REPLACED}
    reps: list[tuple[Any, str, Any, Any]] = [(module, n, originals[n], mine[n]) for n in REPLACED]
    by_id = {id(v): n for n, v in originals.items()}
    for mod_name, mod in list(sys.modules.items()):  # consumers that bound the names already
        if mod is module or mod is None or not (mod_name == "vllm" or mod_name.startswith("vllm.")):
            continue
        for attr, val in list(vars(mod).items()):
            n = by_id.get(id(val))
            if n is not None and val is originals[n]:
                reps.append((mod, attr, val, mine[n]))
    why = (
        f"vLLM {version or '?'}'s MRV2 buffer layer ({TARGET}) matches the API stagebuf was tested "
        f"with (vLLM {', '.join(TESTED)})"
    )
    return Plan(True, "patch", why, reps)


def _apply(p: Plan) -> None:
    done: list[tuple[Any, str, Any]] = []
    try:
        for mod, attr, old, new in p.replacements:
            setattr(mod, attr, new)
            done.append((mod, attr, old))
    except Exception:
        for mod, attr, old in reversed(done):  # never half-patched
            setattr(mod, attr, old)
        raise


def _announce(caps: Any) -> None:
    """The plugin's one log line of this process, with the tier stagebuf chose and why."""
    if _done.pop("announce", None) is None:
        return
    reason = next((r for r in reversed(caps.reasons) if r.startswith("Tier ")), "")
    logger.warning(
        "vLLM plugin on (%s=1): MRV2's buffer layer is stagebuf's, tier %s on %s. %s",
        ENV_VLLM,
        caps.tier.name,
        caps.device,
        reason,
    )


def register() -> None:
    """vLLM's general-plugin entry point: make stagebuf MRV2's buffer layer if ``STAGEBUF_VLLM=1``.

    Idempotent: vLLM calls it several times per process, and only the first call
    acts. If vLLM's API differs from :data:`API`, or vLLM cannot be imported, it
    logs one line saying why and leaves vLLM's layer whole. Otherwise it replaces
    every binding of the names in :data:`API` at once (nothing is ever half-patched) and
    logs one line with the tier when stagebuf first decides one in the process.

    Raises
    ------
    SetupError
        (a ``ValueError`` too) If ``STAGEBUF_VLLM`` is set to anything but ``0``,
        ``1`` or the empty string; the message names the allowed values. vLLM then
        stops at start-up, before anything is replaced.
    """
    on = setting()  # a bad value raises before anything is looked at
    if not on:
        return
    with _lock:
        if "plan" in _done:
            return
        p = plan()
        _done["plan"] = p
        if p.action != "patch":
            logger.warning("vLLM plugin: %s", p.why)
            return
        _apply(p)
        from . import _probe

        _done["announce"] = True
        _probe.on_decision.append(_announce)
        for caps in list(_probe._cache.values())[:1]:  # a tier already decided in this process
            _announce(caps)


def unregister() -> None:
    """Undo :func:`register`: put vLLM's own objects back (tests; an engine never needs it).

    Does nothing if :func:`register` replaced nothing in this process. A later
    :func:`register` call acts again.
    """
    with _lock:
        p = _done.pop("plan", None)
        _done.pop("announce", None)
        if p is None or p.action != "patch":
            return
        for mod, attr, old, _new in reversed(p.replacements):
            setattr(mod, attr, old)
        from . import _probe

        if _announce in _probe.on_decision:
            _probe.on_decision.remove(_announce)
