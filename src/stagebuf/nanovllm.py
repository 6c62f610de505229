"""stagebuf under nano-vllm's input preparation: ``attach(runner)``, ``detach(runner)``.

nano-vllm (the ``nano-vllm-fork`` distribution, package ``nanovllm``) prepares each
step's inputs in its ``ModelRunner``: ``prepare_prefill``, ``prepare_decode``,
``prepare_block_tables`` and ``prepare_sample``, each from Python lists copied with
``pin_memory=True`` and one copy per array. :func:`attach` puts stagebuf under those
four methods and ``run_model``; they then return the same tensors, with the same
attention context (``nanovllm.utils.context``):

* the arrays of a ``prepare_prefill`` or ``prepare_decode`` call, and the sampling
  arrays of the ``prepare_sample`` that nano-vllm's ``run`` calls next for the same
  batch, go in one :class:`~stagebuf.StepStager` step: one transfer per engine step (none
  on HOST; on UVA too, as the forward reads them in every layer); built in bulk with numpy;
* a ``prepare_sample`` called otherwise (another batch, another ``is_cfg_batch``, after
  a graph-replayed decode) stages its arrays in one step of a second stager;
* a decode that ``run_model`` would replay as a captured CUDA graph is written from a
  guarded host slot straight into the graph's static inputs, and ``run_model`` replays
  without its device-to-device copies;
* on every tier, PAGEABLE and HOST included: nano-vllm's own path needs pinned memory.

The tensors keep nano-vllm's values, dtypes and shapes, and its rules, including
``prepare_sample``'s: top-k is handed on when a sequence has one > 0, top-p and the
repetition penalty when a sequence has one equal to 1.0. What differs is lifetime: a
returned tensor holds its values until the call ``max_concurrency`` calls later
(graph inputs: until the next decode), as nano-vllm's engine uses them.

``attach`` accepts a ``ModelRunner`` (built with its model or not: it needs only the
runner's ``config`` and ``block_size``), an ``LLM`` or ``LLMEngine`` (its
``model_runner``), or the ``ModelRunner`` class itself: every runner then prepares on
stagebuf, from its construction on, which is how nano-vllm starts where pinned memory
is missing (its own construction pins buffers). Only the versions in :data:`TESTED`
are accepted; anything else raises :class:`NanoVllmVersionError` and changes nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
import weakref
from importlib import metadata
from pathlib import Path
from typing import Any

from ._common.errors import ArgumentTypeError, SetupError
from ._common.log import logger, warn_once
from ._engines.nanovllm_prep import Prep, run_model

__all__ = ["TESTED", "NanoVllmVersionError", "attach", "detach", "is_attached", "stats", "status"]

TESTED: dict[str, tuple[str, ...]] = {"nano-vllm-fork": ("20260210",)}
"""Distributions and versions of nano-vllm whose input preparation was run on stagebuf."""

METHODS: dict[str, tuple[str, ...]] = {
    "prepare_block_tables": ("self", "seqs"),
    "prepare_prefill": ("self", "seqs"),
    "prepare_decode": ("self", "seqs"),
    "prepare_sample": ("self", "seqs", "is_cfg_batch"),
    "run_model": ("self", "input_ids", "positions", "is_prefill"),
}
"""The ModelRunner methods attach replaces, with their parameters in the tested versions."""

_OWN = "_stagebuf_own"  # on an attached class (set with setattr): its own methods, to restore

_PREPS: weakref.WeakKeyDictionary[Any, Prep] = weakref.WeakKeyDictionary()
"""Each prepared runner's Prep, kept outside nano-vllm's object: it goes with its runner."""


class NanoVllmVersionError(SetupError, RuntimeError):
    """The nano-vllm to attach to is not a tested version (or not nano-vllm's ModelRunner API)."""


# --- what is attached to ----------------------------------------------------------------------


def _runner_class(target: Any) -> tuple[type, Any]:
    """(the ModelRunner class, the runner or None for the class itself) of ``target``; or raise."""
    if isinstance(target, type):
        if all(callable(getattr(target, m, None)) for m in METHODS):
            return target, None
    else:
        runner = getattr(target, "model_runner", target)
        if hasattr(runner, "config") and all(callable(getattr(runner, m, None)) for m in METHODS):
            return type(runner), runner
    raise ArgumentTypeError(
        f"target={type(target).__name__} object is not nano-vllm's; allowed: a nanovllm ModelRunner, "
        "an LLM or LLMEngine (its model_runner), or the ModelRunner class"
    )


def _distribution(cls: type) -> tuple[str, str]:
    """(distribution name, version) of the package that defines ``cls``; ("unknown", "") if none says."""
    mod = sys.modules.get(cls.__module__)
    top = cls.__module__.split(".")[0]
    file = getattr(mod, "__file__", None)
    found: list[tuple[str, str]] = []
    if file:
        # the distribution installed next to the package itself (site-packages, or an unpacked wheel)
        site = Path(file).resolve().parents[cls.__module__.count(".")]
        for dist in metadata.distributions(path=[str(site)]):
            tops = (dist.read_text("top_level.txt") or "").split()
            if top in tops:
                found.append((dist.metadata["Name"], dist.version))
    if not found:
        for name in metadata.packages_distributions().get(top, []):
            with contextlib.suppress(metadata.PackageNotFoundError):  # a stale record
                found.append((name, metadata.version(name)))
    return found[0] if found else ("unknown", "")


def _tested_names() -> tuple[str, ...]:
    return tuple(f"{d} {v}" for d, vs in TESTED.items() for v in vs)


def _check(cls: type) -> None:
    """Raise NanoVllmVersionError unless ``cls`` is a tested nano-vllm's ModelRunner, with its API."""
    name, version = _distribution(cls)

    def refuse(message: str, cause: str, fix: str | None = None) -> NanoVllmVersionError:
        return NanoVllmVersionError(
            f"stagebuf.nanovllm: {message}",
            setting="nano-vllm",
            value=f"{name} {version}".strip(),
            cause=cause,
            allowed=_tested_names(),
            **({"fix": fix} if fix is not None else {}),
        )

    if version not in TESTED.get(name, ()):
        raise refuse(
            f"{name} {version or '(no version)'} is not a tested nano-vllm",
            "its input preparation was not run on stagebuf; nothing was attached",
            "pip install 'stagebuf[nanovllm]' for the tested version, or leave this runner on "
            "nano-vllm's own input preparation",
        )
    for m, params in METHODS.items():
        got = tuple(inspect.signature(getattr(cls, m)).parameters)
        if got != params:
            raise refuse(
                f"{cls.__qualname__}.{m}{got} differs from {name} {version}'s {params}",
                "the ModelRunner was changed; nothing was attached",
                "use an unmodified ModelRunner of a tested version",
            )
    mod = sys.modules.get(cls.__module__)
    if not (callable(getattr(mod, "set_context", None)) and callable(getattr(mod, "get_context", None))):
        raise refuse(
            f"{cls.__module__} has no set_context/get_context",
            "the attention context cannot be set as nano-vllm sets it; nothing was attached",
        )


# --- the methods attached ---------------------------------------------------------------------


def _prep(runner: Any) -> Prep:
    """The runner's Prep, made at its first use."""
    p = _PREPS.get(runner)
    if p is None:
        p = _PREPS[runner] = Prep(runner)
        logger.info(
            "stagebuf.nanovllm: %s prepares its inputs on tier %s (steps: %s)",
            type(runner).__name__, p.sampler.tier, p.stager.tier,
        )  # fmt: skip
    return p


def _own(runner: Any, name: str) -> Any:
    cls = type(runner)
    saved = vars(cls).get(_OWN)  # the class's own entry, not a base class's
    return saved[name] if saved else getattr(cls, name)


def _prepare_block_tables(self: Any, seqs: list[Any]) -> Any:
    return _prep(self).block_tables(seqs)


def _prepare_prefill(self: Any, seqs: list[Any]) -> Any:
    return _prep(self).prefill(seqs)


def _prepare_decode(self: Any, seqs: list[Any]) -> Any:
    return _prep(self).decode(self, seqs)


def _prepare_sample(self: Any, seqs: list[Any], is_cfg_batch: bool = False) -> Any:
    return _prep(self).sample(seqs, is_cfg_batch)


def _run_model(self: Any, input_ids: Any, positions: Any, is_prefill: bool) -> Any:
    return run_model(self, _prep(self), _own(self, "run_model"), input_ids, positions, is_prefill)


def _allocate_sample_buffers(self: Any) -> None:
    """nano-vllm's pinned buffers where pinning works; without them where it fails (unused attached)."""
    try:
        _own(self, "_allocate_sample_buffers")(self)
    except RuntimeError as e:
        warn_once(
            "nanovllm-pin",
            f"stagebuf.nanovllm: nano-vllm's pinned sample buffers could not be allocated ({e}); "
            "stagebuf prepares the inputs without them",
        )


_REPLACEMENTS: dict[str, Any] = {
    "prepare_block_tables": _prepare_block_tables,
    "prepare_prefill": _prepare_prefill,
    "prepare_decode": _prepare_decode,
    "prepare_sample": _prepare_sample,
    "run_model": _run_model,
}


def _bound(runner: Any) -> bool:
    """Whether the runner itself (not its class) holds all the replacing methods."""
    mine = vars(runner)
    return all(n in mine for n in _REPLACEMENTS)


# --- the public face ----------------------------------------------------------------------------


def attach(target: Any) -> None:
    """Prepare ``target``'s inputs on stagebuf; idempotent.

    Parameters
    ----------
    target : ModelRunner, LLM, LLMEngine or the ModelRunner class
        A nano-vllm runner (built with a model or without: only its ``config`` and
        ``block_size`` are read), an engine (its ``model_runner``), or the class, so that
        every runner prepares on stagebuf from its construction on.

    Raises
    ------
    ArgumentTypeError
        If ``target`` is none of those.
    NanoVllmVersionError
        If its nano-vllm is not a version in :data:`TESTED`, or its ModelRunner's
        methods differ from the tested API; nothing is attached.
    SetupError
        As :func:`stagebuf.capabilities`, on the first preparation (a bad setting).
    """
    cls, runner = _runner_class(target)
    _check(cls)
    if runner is None:
        mine = vars(cls)  # read only: what the class defines itself, as it is (not bound, not inherited)
        if _OWN in mine:
            return
        own = {n: mine[n] for n in (*_REPLACEMENTS, "_allocate_sample_buffers") if n in mine}
        setattr(cls, _OWN, own)
        for n, f in _REPLACEMENTS.items():
            setattr(cls, n, f)
        if "_allocate_sample_buffers" in own:
            cls._allocate_sample_buffers = _allocate_sample_buffers  # type: ignore[attr-defined]
        logger.info("stagebuf.nanovllm: attached to %s.%s", cls.__module__, cls.__qualname__)
        return
    if runner in _PREPS and _bound(runner):
        return
    _prep(runner)  # built first: a failure leaves the runner as it was
    for n, f in _REPLACEMENTS.items():
        setattr(runner, n, types.MethodType(f, runner))


def detach(target: Any) -> None:
    """Give ``target`` back nano-vllm's own input preparation; idempotent.

    Parameters
    ----------
    target : ModelRunner, LLM, LLMEngine or the ModelRunner class
        As for :func:`attach`. Detaching the class restores its methods; a runner that
        was attached by itself stays attached until it is detached itself.

    Raises
    ------
    ArgumentTypeError
        If ``target`` is none of those.
    """
    cls, runner = _runner_class(target)
    if runner is None:
        own = vars(cls).get(_OWN)
        if own is None:
            return
        for n in (*_REPLACEMENTS, "_allocate_sample_buffers"):
            if n in own:
                setattr(cls, n, own[n])
        delattr(cls, _OWN)
        return
    for n in _REPLACEMENTS:
        if n in vars(runner):
            delattr(runner, n)
    if _OWN not in vars(cls):
        _PREPS.pop(runner, None)


def is_attached(target: Any) -> bool:
    """Whether ``target`` (as for :func:`attach`) prepares its inputs on stagebuf."""
    cls, runner = _runner_class(target)
    if _OWN in vars(cls):
        return True
    return runner is not None and _bound(runner)


def stats(target: Any) -> dict[str, Any]:
    """What an attached runner did: its tier (the machine's: graph inputs and sampling), the tier of its
    prefill and decode steps (``step_tier``: PINNED on a UVA machine, a copy per step, as the forward reads
    those inputs in every layer), its two stagers' counters, graph-input copies.

    Raises
    ------
    ArgumentTypeError
        If ``target`` is not a runner or engine (as for :func:`attach`, the class excluded).
    """
    cls, runner = _runner_class(target)
    if runner is None:
        raise ArgumentTypeError("target=the ModelRunner class; allowed: a runner, LLM or LLMEngine")
    prep = _PREPS.get(runner)
    if prep is None:
        return {"attached": is_attached(runner), "prepared": False}
    g = prep.graph
    return {
        "attached": is_attached(runner),
        "prepared": True,
        "tier": prep.sampler.tier.name,
        "step_tier": prep.stager.tier.name,
        "stager": prep.stager.stats(),
        "sampler": prep.sampler.stats(),
        "graph_input_copies": 0 if g is None else g.copies,
    }


def status() -> dict[str, Any]:
    """Whether nano-vllm is installed here and whether its version is tested (for ``stagebuf doctor``).

    Returns
    -------
    dict
        ``installed`` (bool), ``distribution`` and ``version`` (None when not installed),
        ``tested`` (bool), ``tested_versions`` (list of str) and ``note`` (one sentence).
    """
    tested = list(_tested_names())
    for name in (*TESTED, "nano-vllm"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        ok = version in TESTED.get(name, ())
        note = (
            f"{name} {version}, tested: stagebuf.nanovllm.attach(llm) puts its input preparation on stagebuf"
            if ok
            else f"{name} {version} is not tested; attach() refuses it (tested: {', '.join(tested)})"
        )
        return {"installed": True, "distribution": name, "version": version, "tested": ok,
                "tested_versions": tested, "note": note}  # fmt: skip
    return {
        "installed": False,
        "distribution": None,
        "version": None,
        "tested": False,
        "tested_versions": tested,
        "note": f"not installed (tested: {', '.join(tested)}; the nanovllm extra of stagebuf installs it)",
    }
