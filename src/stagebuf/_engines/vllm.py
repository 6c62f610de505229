"""stagebuf as vLLM's MRV2 buffer layer: an opt-in vLLM general plugin (entry point ``stagebuf``).

``STAGEBUF_VLLM=1`` replaces the names of :data:`API` in ``vllm.v1.worker.gpu.buffer_utils``
(and wherever a ``vllm`` module bound them); ``step`` also defers the step's input staging
into one batch (``_vllm_step``, :data:`STEP_API`); unset or ``0`` leaves vLLM untouched; any
other value raises SettingValueError. Every replacement is computed first and applied together,
only where vLLM's API matches the tested one (else one log line says what differed), and
:func:`register` is idempotent. The one log line per process comes when stagebuf first decides
a tier there (the probe initialises CUDA, which vLLM's API server never needs).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from .._bytes.buffers import UPLOAD_TARGET_HOOKS, NonUvaBuffer, UvaBuffer
from .._common.errors import SettingValueError
from .._common.log import logger
from .._rings.guard import set_default_max_concurrency
from .._rings.pool import UvaBackedTensor, UvaBufferPool
from .._rings.staged_write import FusedStagedWriter, StagedWriteTensor
from .._tiers import probe as _probe
from .._tiers.settings import ENV_VLLM
from . import vllm_step as _vllm_step
from .vllm_check import REPLACED, TESTED, api_differences, params_of, release, window_differences

TARGET = "vllm.v1.worker.gpu.buffer_utils"


MODES = ("0", "1", "step")
"""``STAGEBUF_VLLM``'s values: off, class replacement, class replacement and step staging."""


def mode() -> str:
    """``STAGEBUF_VLLM``: ``"0"`` (unset or empty too), ``"1"`` or ``"step"``; else SettingValueError."""
    raw = os.environ.get(ENV_VLLM)
    v = "0" if raw is None or raw.strip() == "" else raw.strip()
    if v in MODES:
        return v
    raise SettingValueError(
        f"{ENV_VLLM}={raw!r} is not a valid setting",
        setting=ENV_VLLM,
        value=raw,
        allowed=MODES,
        fix=f"set {ENV_VLLM}=1 to make stagebuf vLLM's MRV2 buffer layer, {ENV_VLLM}=step to also stage "
        "each step's inputs in one transfer, or 0 (or unset it) for vLLM's own",
    )


def setting() -> bool:
    """Whether ``STAGEBUF_VLLM`` switches the plugin on (``1`` or ``step``); a bad value raises."""
    return mode() != "0"


def _not_used(version: str | None) -> str | None:
    """Why vLLM ``version`` would not run the plugin's patch in this environment (None: it would).

    As vLLM decides: ``VLLM_PLUGINS`` (when set, the general plugins it names are the only ones
    loaded) and, on releases that still have it (0.33 and older), ``VLLM_USE_V2_MODEL_RUNNER=0``
    (the V1 model runner, which does not use MRV2's buffer layer; from 0.34 vLLM refuses that value).
    """
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "stagebuf" not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} does not name stagebuf: vLLM does not load the plugin"
    v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if v2 is not None and v2.strip() not in ("", "1"):
        if not release(version).v1_runner:
            return (
                f"VLLM_USE_V2_MODEL_RUNNER={v2!r}: vLLM {version or '(version unknown)'} has no V1 model "
                "runner and refuses this setting at start-up; unset it"
            )
        return (
            f"VLLM_USE_V2_MODEL_RUNNER={v2!r}: vLLM runs its V1 model runner, which does not use MRV2's "
            "buffer layer"
        )
    return None


def vllm_version() -> str | None:
    """The installed vLLM's version (from its metadata; vLLM is not imported), or None."""
    try:
        from importlib import metadata

        return metadata.version("vllm")
    except Exception:  # no metadata: an imported vllm's own __version__, if any
        v = getattr(sys.modules.get("vllm"), "__version__", None)
        return v if isinstance(v, str) else None


STEP_TARGET = "vllm.v1.worker.gpu.model_runner"

STEP_API: dict[str, dict[str, tuple[str, ...]]] = {
    "GPUModelRunner": {
        "execute_model": (
            "scheduler_output", "intermediate_tensors", "dummy_run", "skip_attn_for_dummy_run",
            "is_profile", "context_len", "valid_dummy_state_slots", "randomize_inputs",
        ),
        "prepare_inputs": ("scheduler_output", "batch_req_state", "batch_desc", "num_active_loras"),
    },
    "async_tensor_h2d": {"": ("data", "device", "dtype", "out")},
}  # fmt: skip
"""What step mode patches in ``model_runner`` (besides :data:`API`), as the tested releases spell it.

Step mode relies on the release's order in ``execute_model``: every call before its
``async_tensor_h2d(query_start_loc_np, out=...)`` is one :data:`~vllm_check.REVIEWED_WINDOW` holds
(read from the release's own source by :func:`~vllm_check.window_differences`), so no kernel
reads a deferred target before the window closes.
"""

OURS: dict[str, Any] = {
    "UvaBuffer": UvaBuffer,
    "NonUvaBuffer": NonUvaBuffer,
    "UvaBufferPool": UvaBufferPool,
    "UvaBackedTensor": UvaBackedTensor,
    "StagedWriteTensor": StagedWriteTensor,
    "FusedStagedWriter": FusedStagedWriter,
    "set_default_max_concurrency": set_default_max_concurrency,
}
"""stagebuf's object for each name of :data:`API` (mode ``1``)."""

STEP_CLASSES = {
    "UvaBackedTensor": _vllm_step.StepBackedTensor,
    "StagedWriteTensor": _vllm_step.StepStagedWriteTensor,
    "FusedStagedWriter": _vllm_step.StepFusedStagedWriter,
}
"""Step mode's classes in place of stagebuf's own (the other names of :data:`API` are as for ``1``)."""


@dataclass
class Plan:
    """What the plugin does (or would do) in this process, and why: the answer of :func:`plan`.

    Attributes
    ----------
    enabled : bool
        Whether ``STAGEBUF_VLLM`` is ``1`` or ``step``.
    action : str
        ``"patch"`` (it would patch vLLM), ``"patched"`` (:func:`register` already did
        in this process), ``"leave"`` (vLLM's layer stays: its API differs from
        :data:`API`, or it cannot be imported) or ``"off"`` (not asked for, or vLLM
        would not run the patch: ``VLLM_PLUGINS``, ``VLLM_USE_V2_MODEL_RUNNER=0``).
    why : str
        One sentence saying why.
    replacements : list of tuple
        For ``"patch"``: ``(module, attribute, vLLM's object, stagebuf's object)`` for
        every binding to replace; empty otherwise.
    mode : str
        The mode carried out: ``"0"``, ``"1"`` or ``"step"`` (``"1"`` where ``step`` was
        asked for and vLLM's model runner differs from :data:`STEP_API`).
    requested : str
        ``STAGEBUF_VLLM``'s mode.
    """

    enabled: bool
    action: str
    why: str
    replacements: list[tuple[Any, str, Any, Any]] = field(default_factory=list)
    mode: str = "0"
    requested: str = "0"

    @property
    def patches(self) -> list[str]:
        """What is (or would be) patched: ``module.attribute`` per binding, deduplicated, in order."""
        seen: dict[str, None] = {}
        for mod, attr, _old, _new in self.replacements:
            name = getattr(mod, "__name__", None) or getattr(mod, "__qualname__", "?")
            seen.setdefault(f"{name}.{attr}", None)
        return list(seen)

    def as_dict(self) -> dict[str, Any]:
        """``enabled``, ``action``, ``why``, ``mode``, ``requested`` and ``patches`` (what doctor reports).

        Returns
        -------
        dict of str to Any
        """
        return {
            "enabled": self.enabled,
            "action": self.action,
            "why": self.why,
            "mode": self.mode,
            "requested": self.requested,
            "patches": self.patches,
        }


_lock = threading.Lock()
_done: dict[str, Any] = {}
"""Per process: the plan that was carried out (register() is idempotent)."""


def _bindings(module: Any, mine: dict[str, Any]) -> list[tuple[Any, str, Any, Any]]:
    """``module``'s names in ``mine``, and every ``vllm.*`` module's binding of the same objects."""
    originals = {n: getattr(module, n) for n in mine}
    reps: list[tuple[Any, str, Any, Any]] = [(module, n, originals[n], mine[n]) for n in mine]
    by_id = {id(v): n for n, v in originals.items()}
    for mod_name, mod in list(sys.modules.items()):  # consumers that bound the names already
        if mod is module or mod is None or not (mod_name == "vllm" or mod_name.startswith("vllm.")):
            continue
        for attr, val in list(vars(mod).items()):
            n = by_id.get(id(val))
            if n is not None and val is originals[n]:
                reps.append((mod, attr, val, mine[n]))
    return reps


def _step_replacements(runner: Any | None) -> tuple[list[tuple[Any, str, Any, Any]], str]:
    """Step mode's model-runner patches, or none and why not: the runner's signatures must be
    :data:`STEP_API`'s, and every call of its step window one that was reviewed."""
    if runner is None:
        try:
            runner = importlib.import_module(STEP_TARGET)
        except Exception as e:
            return [], f"{STEP_TARGET} cannot be imported ({type(e).__name__}: {e})"[:300]
    diffs = []
    for name, methods in STEP_API.items():
        obj = getattr(runner, name, None)
        for m, params in methods.items():
            fn = getattr(obj, m, None) if m else obj
            got = None if fn is None else params_of(fn)
            if got != params:
                what = f"{name}.{m}" if m else name
                shape = f"({', '.join(got)}) instead of ({', '.join(params)})" if got is not None else ""
                diffs.append(f"{what}{shape}" if shape else f"{what} is missing")
    if diffs:
        return [], f"{STEP_TARGET} differs from the tested one: {'; '.join(diffs)}"
    order = window_differences(runner)
    if order:
        return [], f"step mode's window differs from the reviewed one: {'; '.join(order)}"
    cls = runner.GPUModelRunner
    return [
        (runner, "async_tensor_h2d", runner.async_tensor_h2d, _vllm_step.wrap_h2d(runner.async_tensor_h2d)),
        (cls, "execute_model", cls.execute_model, _vllm_step.wrap_execute_model(cls.execute_model)),
    ], ""


def plan(module: Any | None = None, runner: Any | None = None, version: str | None = None) -> Plan:
    """What :func:`register` would do now, and why; changes nothing (after it ran: what it did).

    ``module``, ``runner`` and ``version`` stand in for vLLM's ``buffer_utils``, ``model_runner``
    and version (tests). The version is only reported: what decides is vLLM's API, compared both
    ways (:func:`~vllm_check.api_differences`), and for step mode its window's calls
    (:func:`~vllm_check.window_differences`), so a release that changed neither works the day it
    ships. Raises SettingValueError for a bad ``STAGEBUF_VLLM``.
    """
    requested = mode()
    if requested == "0":
        return Plan(False, "off", f"{ENV_VLLM} is not set to 1 or step: vLLM uses its own buffer layer")
    done = _done.get("plan")
    if done is not None:  # register() ran in this process: what it did
        if done.action == "patch":
            return Plan(True, "patched", done.why, done.replacements, done.mode, done.requested)
        return done  # type: ignore[no-any-return]
    version = version or vllm_version()
    unused = _not_used(version)
    if unused:
        return Plan(True, "off", unused, requested=requested)
    if module is None:
        try:
            module = importlib.import_module(TARGET)
        except Exception as e:
            why = f"{TARGET} cannot be imported ({type(e).__name__}: {e})"[:300]
            return Plan(True, "leave", why, requested=requested)
    mine = {n: OURS[n] for n in REPLACED}
    diffs = api_differences(module, mine)
    if diffs:
        return Plan(
            True,
            "leave",
            f"vLLM {version or '?'}'s {TARGET} differs from the API stagebuf was tested with "
            f"(vLLM {', '.join(TESTED)}): {'; '.join(diffs)}; vLLM's own layer stays in place",
            requested=requested,
        )
    why = (
        f"vLLM {version or '?'}'s MRV2 buffer layer ({TARGET}) matches the API stagebuf was tested "
        f"with (vLLM {', '.join(TESTED)})"
    )
    carried = "1"
    step: list[tuple[Any, str, Any, Any]] = []
    if requested == "step":
        step, why_not = _step_replacements(runner)
        if step:
            carried = "step"
            mine.update(STEP_CLASSES)
            why += "; step mode: the step's staged writes, sampler publishes and per-step copies in one batch"
        else:
            why += f"; {why_not}: class replacement only ({ENV_VLLM}=1's behaviour)"
    return Plan(True, "patch", why, _bindings(module, mine) + step, carried, requested)


_ACTIONS = {
    "patch": "would replace MRV2's buffer layer",
    "patched": "replaced MRV2's buffer layer",
    "leave": "would leave vLLM as it is",
    "off": "vLLM uses its own buffer layer",
}


def _plain(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_plain(x)}" for k, x in v.items()) or "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(_plain(x) for x in v) or "-"
    return str(v)


def rows() -> list[tuple[str, str]]:
    """doctor's rows: vLLM's version, and every item of :func:`plan`'s ``as_dict()``, as text."""
    version = vllm_version()
    out = [("vLLM", f"{version} (tested: {', '.join(TESTED)})" if version else "not installed")]
    for key, value in plan().as_dict().items():
        text = _plain(value)
        if key == "action" and value in _ACTIONS:
            text += f" ({_ACTIONS[value]})"
        out.append((f"vLLM plugin {key}", text))
    return out


def report() -> dict[str, Any]:
    """doctor's ``--json`` part: vLLM's version, the setting, and every item of ``plan().as_dict()``."""
    version = vllm_version()
    out: dict[str, Any] = {"installed": version is not None, "version": version, "tested": list(TESTED)}
    return {**out, "setting": os.environ.get(ENV_VLLM), **plan().as_dict()}


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
    p = _done.pop("announce", None)
    if p is None:
        return
    reason = next((r for r in reversed(caps.reasons) if r.startswith("Tier ")), "")
    what = (
        "MRV2's buffer layer is stagebuf's, and each step's inputs are staged in one batch"
        if p.mode == "step"
        else "MRV2's buffer layer is stagebuf's"
    )
    fallback = "" if p.mode == p.requested else f" (step mode asked for, not carried out: {p.why})"
    logger.warning(
        "vLLM plugin on (%s=%s): %s, tier %s on %s.%s %s",
        ENV_VLLM,
        p.mode,
        what,
        caps.tier.name,
        caps.device,
        fallback,
        reason,
    )


CONF_COMPUTE = "vllm.v1.conf_compute_utils"


def _inplace_target_hook() -> Any | None:
    """vLLM's ``register_inplace_h2d_target`` (0.34 on), which its confidential-computing copy path asks
    of every upload target that may be written in place; None where the release has none."""
    try:
        mod = importlib.import_module(CONF_COMPUTE)
    except Exception:
        return None
    return getattr(mod, "register_inplace_h2d_target", None)


def register() -> None:
    """vLLM's general-plugin entry point: make stagebuf MRV2's buffer layer if ``STAGEBUF_VLLM`` asks.

    Idempotent: vLLM calls it several times per process, and only the first call
    acts. If vLLM's API differs from :data:`API`, or vLLM cannot be imported, it
    logs one line saying why and leaves vLLM's layer whole. Otherwise it replaces
    every binding of the names in :data:`API` at once (nothing is ever half-patched),
    with ``step`` also the model runner's :data:`STEP_API` (or, where that differs, only
    what ``1`` patches, said in the log line), and logs one line with the tier when
    stagebuf first decides one in the process.

    Raises
    ------
    SettingValueError
        (a ``ValueError`` too) If ``STAGEBUF_VLLM`` is not ``0``, ``1``, ``step`` or
        empty; the message names the allowed values. vLLM then stops at start-up,
        before anything is replaced.
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
        hook = _inplace_target_hook()
        if hook is not None:
            UPLOAD_TARGET_HOOKS.append(hook)
            _done["hook"] = hook
        _done["announce"] = p
        _probe.on_decision.append(_announce)
        for caps in _probe.decided()[:1]:  # a tier already decided in this process
            _announce(caps)


def unregister() -> None:
    """Undo :func:`register`: put vLLM's own objects back (tests; an engine never needs it).

    Does nothing if :func:`register` replaced nothing in this process. A later
    :func:`register` call acts again.
    """
    with _lock:
        p = _done.pop("plan", None)
        _done.pop("announce", None)
        hook = _done.pop("hook", None)
        if hook in UPLOAD_TARGET_HOOKS:
            UPLOAD_TARGET_HOOKS.remove(hook)
        if p is None or p.action != "patch":
            return
        _vllm_step.reset()
        for mod, attr, old, _new in reversed(p.replacements):
            setattr(mod, attr, old)
        if _announce in _probe.on_decision:
            _probe.on_decision.remove(_announce)
