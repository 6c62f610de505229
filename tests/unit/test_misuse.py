"""Misuse, by introspection: whatever stagebuf raises when its public objects are misused is a StagebufError.

For every public class and function of ``stagebuf.__all__`` (the exception classes aside: they
carry data, see ``test_errors.py``), on the CPU tiers (HOST, and PAGEABLE forced through
``STAGEBUF_TIER``):

* every public attribute of an instance (``dir(obj)`` less private names and what classes outside
  stagebuf define: ``int``'s and ``Enum``'s on a ``Tier``) is read, assigned and deleted. Reading
  raises nothing. Assigning (its own value, then ``object()``) raises ReadOnlyAttributeError,
  except the documented copy-ins (``.np`` and ``.cpu`` of buffers, backed tensors and param-table
  fields), which copy new values into the same array, and take each value of ``BAD`` or refuse
  it with a StagebufError. Deleting raises ReadOnlyAttributeError.
* every public method, constructor and function (and ``obj[key]`` / ``key in obj`` where stagebuf
  defines them) is called with each value of ``BAD`` in one parameter, the others good (their
  defaults, or ``GOOD``), from ``inspect.signature``. A call may succeed (some "bad" values are
  valid: then the object's ``settle`` call runs too, e.g. ``apply_write()``, where late checks
  live); whatever escapes must be a StagebufError, and no call may run past ``LIMIT_S``.
  A method without parameters is called twice on one object (the usual order misuse).

Each (object, member, parameter) is one case. A violation in a file being refactored is marked
``xfail(strict=True)`` in ``KNOWN`` with what escapes: fixing it fails the mark until it is
dropped. ``test_every_object_refuses_some_misuse`` checks that the sweep exercises each object
for real (at least one misuse raised), and ``test_the_sweep_reports_*`` inject a plain ValueError,
a bare AttributeError, an accepted write and a hang into the real objects and check that the
sweep reports each.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf
from stagebuf import ReadOnlyAttributeError, StagebufError
from stagebuf._rings import guard as guard_mod

LIMIT_S = 2.0
"""A call that has not returned after this long is reported as hung (neither refused nor used).
The slowest accepted call takes about 50 ms on the 2-core CI machine, and up to some hundreds of
ms with other test runs and a swapping neighbour on it: 0.5 s was seen to flake there."""


# --- the bad values ----------------------------------------------------------------------


def _bad_values() -> dict[str, Any]:
    """label -> bad value, made afresh for each call (lists and arrays are mutable)."""
    return {
        "object()": object(),
        "'x'": "x",
        "1.5": 1.5,
        "None": None,
        "['a', 'b']": ["a", "b"],
        "-1": -1,
        "2**70": 2**70,
        "True": True,
        "nan": math.nan,
        "np 3-D": np.zeros((2, 2, 2), np.int32),
        "torch 3-D": torch.zeros((2, 2, 2), dtype=torch.int32),
        "ragged": [[1], [2, 3]],
    }


BAD = list(_bad_values())


# --- the public objects ------------------------------------------------------------------


def _caps() -> stagebuf.Capabilities:
    stagebuf.reset_capabilities()  # a fresh probe: capabilities() hands out the cached one
    return stagebuf.capabilities()


def _table() -> stagebuf.DeviceParamTable:
    return stagebuf.DeviceParamTable(4, {"a": torch.int32, "b": torch.float32})


def _swt() -> stagebuf.StagedWriteTensor:
    return stagebuf.StagedWriteTensor((4, 8), torch.int32)


def _tier_lookup(value: Any) -> stagebuf.Tier:
    """``Tier(value)``, the lookup (``Tier``'s other parameters are Enum's functional API)."""
    return stagebuf.Tier(value)


GOOD: dict[str, Callable[[Any], Any]] = {
    # parameter name -> a good value, given the instance (None for constructors and functions)
    "size": lambda o: 4,
    "dtype": lambda o: torch.int32,
    "x": lambda o: [1, 2],
    "n": lambda o: 1,
    "num_rows": lambda o: 4,
    "fields": lambda o: {"a": torch.int32},
    "index": lambda o: 0,
    "start": lambda o: 0,
    "values": lambda o: [1, 2],
    "value": lambda o: 3,
    "rows": lambda o: np.array([0, 1]),
    "starts": lambda o: np.array([0, 2]),
    "tensors": lambda o: [_swt()],
    "out": lambda o: torch.zeros(4, dtype=o.dtype, device=o.device),  # StagingBuffer.copy_to
    "key": lambda o: "a",  # obj[key], key in obj
}
"""Good values of the parameters that have no default (the others keep their defaults)."""

COPY_IN = frozenset({"np", "cpu"})


@dataclass
class Target:
    """One public object: how to get a valid one, its copy-ins and its settle call."""

    name: str
    ctor: Callable[..., Any] | None
    """Swept as the constructor: the class, or the function. None: the object is handed out by
    another (``capabilities()``, ``stager.step()``, ``table[name]``), not made by users."""
    make: Callable[[], Any] | None = None
    """A fresh valid instance; None for a function, or a class with no instance on a CPU machine."""
    writable: frozenset[str] = frozenset()
    """Attributes documented as copy-ins (``obj.np = values`` copies into the same array)."""
    settle: Callable[[Any], Any] | None = None
    """Run after a misuse that was accepted: the values go to the device, and late checks run."""
    good: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    """Good values for this object's parameters, over their defaults and ``GOOD``."""


def _buffer(cls: type[stagebuf.StagingBuffer]) -> Target:
    return Target(cls.__name__, cls, lambda: cls(4, torch.int32), COPY_IN, settle=lambda b: b.uva())


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target("Capabilities", None, _caps),
        Target("DeviceParamTable", stagebuf.DeviceParamTable, _table, settle=lambda t: t.sync()),
        Target("FusedStagedWriter", stagebuf.FusedStagedWriter, stagebuf.FusedStagedWriter),
        _buffer(stagebuf.HostBuffer),
        _buffer(stagebuf.NonUvaBuffer),
        Target("ParamField", None, lambda: _table()["a"], COPY_IN),
        Target("PinnedBuffer", stagebuf.PinnedBuffer),  # no instance on a CPU machine
        Target("StagedWriteTensor", stagebuf.StagedWriteTensor, _swt, settle=lambda t: t.apply_write()),
        Target("StagingBuffer", stagebuf.StagingBuffer),  # the base class (make_buffer's result type)
        Target("Step", None, lambda: stagebuf.StepStager(capacity=1024).step(), settle=lambda s: s.flush()),
        Target(
            "StepStager",
            stagebuf.StepStager,
            lambda: stagebuf.StepStager(capacity=1024),
            good={"capacity": lambda o: 1024},  # (the default, 1 MiB a slot, is slow to zero-fill)
        ),
        Target("Tier", _tier_lookup, lambda: stagebuf.Tier.PAGEABLE, good={"value": lambda o: "host"}),
        Target(
            "UvaBackedTensor",
            stagebuf.UvaBackedTensor,
            lambda: stagebuf.UvaBackedTensor(4, torch.int32),
            COPY_IN,
            settle=lambda t: t.copy_to_uva(),
        ),
        Target("UvaBuffer", stagebuf.UvaBuffer),  # no instance on a CPU machine
        Target("UvaBufferPool", stagebuf.UvaBufferPool, lambda: stagebuf.UvaBufferPool(4, torch.int32)),
        *(
            Target(name, getattr(stagebuf, name))
            for name in stagebuf.__all__
            if inspect.isfunction(getattr(stagebuf, name))
        ),
    ]
}

NOTHING_TO_MISUSE = {"reset_capabilities": "it takes no arguments and has no attributes"}

EXCUSED: dict[tuple[str, str], dict[str, str]] = {
    ("Tier", "()"): {
        label: "Enum's lookup compares the members with == before Enum's _missing_ hook runs (on "
        "Python < 3.12), and numpy and torch refuse the truth value of an elementwise =="
        for label in ("np 3-D", "torch 3-D")
    },
}
"""(object, member) -> {bad value: why what escapes is not stagebuf's}."""


def test_the_targets_are_the_public_api() -> None:
    objs = {n: getattr(stagebuf, n) for n in stagebuf.__all__}
    errors = {n for n, o in objs.items() if isinstance(o, type) and issubclass(o, BaseException)}
    assert len(errors) >= 14 and set(TARGETS) == set(objs) - errors


# --- introspection -----------------------------------------------------------------------


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "stagebuf"


def public_members(obj: Any) -> list[str]:
    """The public attributes stagebuf gives ``obj``: its own, and its stagebuf classes'."""
    own = set(getattr(obj, "__dict__", {}))
    mro = [c for c in type(obj).__mro__ if _ours(c)]
    names = [n for n in dir(obj) if not n.startswith("_") and (n in own or any(n in vars(c) for c in mro))]
    return [n for n in names if not isinstance(getattr(type(obj), n, None), type(obj))]  # Tier.HOST


def _dunders(obj: Any) -> list[str]:
    """``__getitem__`` and ``__contains__`` where a stagebuf class of ``obj`` defines them."""
    mro = [c for c in type(obj).__mro__ if _ours(c)]
    return [d for d in PROTOCOL if any(d in vars(c) for c in mro)]


def _is_method(obj: Any, name: str) -> bool:
    value = getattr(obj, name)
    return callable(value) and not isinstance(value, (torch.Tensor, np.ndarray, type))


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


PROTOCOL: dict[str, Callable[[Any], Callable[[Any], Any]]] = {
    "__getitem__": lambda obj: lambda key: obj[key],
    "__contains__": lambda obj: lambda key: key in obj,
}
"""The protocol methods swept (through the syntax, ``obj[key]`` and ``key in obj``)."""


@contextlib.contextmanager
def _forced_tier(tier: str) -> Iterator[None]:
    old = os.environ.get("STAGEBUF_TIER")
    os.environ["STAGEBUF_TIER"] = tier
    stagebuf.reset_capabilities()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("STAGEBUF_TIER", None)
        else:
            os.environ["STAGEBUF_TIER"] = old
        stagebuf.reset_capabilities()


@dataclass(frozen=True)
class Case:
    """One case: the calls of ``member`` with a bad ``param``, or the misuse of attribute ``member``."""

    target: str
    member: str
    """"()" the constructor or function, else a method or attribute name (or a ``PROTOCOL`` method)."""
    param: str | None
    """The parameter the bad values go into ("" when there is none); None: an attribute case."""

    @property
    def id(self) -> str:
        if self.param is None:
            return f"{self.target}.{self.member} (attribute)"
        return f"{_label(self.target, self.member)}({self.param})"


def _label(target: str, member: str) -> str:
    """How a call of ``member`` reads: ``UvaBufferPool``, ``UvaBufferPool.copy_to_uva``."""
    return target if member == "()" else f"{target}.{member}"


def collect() -> list[Case]:
    """Every case, from a real instance of each object (made on the HOST tier) and its signatures."""
    cases = []
    with _forced_tier("host"):
        for t in TARGETS.values():
            if t.ctor is not None:
                cases += [Case(t.name, "()", p.name) for p in _params(t.ctor)] or [Case(t.name, "()", "")]
            if t.make is None:
                continue
            obj = t.make()
            cases += [Case(t.name, d, "key") for d in _dunders(obj)]
            for name in public_members(obj):
                if _is_method(obj, name):
                    ps = _params(getattr(obj, name))
                    cases += [Case(t.name, name, p.name) for p in ps] or [Case(t.name, name, "")]
                cases.append(Case(t.name, name, None))
    return cases


# --- the sweep ---------------------------------------------------------------------------


class _Hung(BaseException):
    """Raised into a call that ran past LIMIT_S (a BaseException: ``except Exception`` misses it)."""


@dataclass
class Outcome:
    where: str
    """The misuse, as code: ``UvaBufferPool(size=-1)``, ``Step.seq = object()``."""
    kind: str
    """``ok`` (accepted), ``raised`` (a StagebufError), ``escaped`` (anything else) or ``hung``."""
    error: BaseException | None = None
    expect: str = "no escape"
    """``no escape`` (accepted, or a StagebufError), ``read-only`` (ReadOnlyAttributeError) or ``ok``."""

    @property
    def fine(self) -> bool:
        if self.expect == "ok":
            return self.kind == "ok"
        if self.expect == "read-only":
            return isinstance(self.error, ReadOnlyAttributeError)
        return self.kind in ("ok", "raised")

    def __str__(self) -> str:
        what = "" if self.error is None else f": {type(self.error).__name__}: {str(self.error)[:200]}"
        return f"{self.where} -> {self.kind}{what} (expected: {self.expect})"


_TICKS = random.Random(0)


def _raise_hung(signum: int, frame: Any) -> None:
    signal.setitimer(signal.ITIMER_REAL, _TICKS.uniform(0.01, 0.03))  # the next tick, re-armed first
    raise _Hung


class _Armed:
    """The interrupt of one call: SIGALRM after LIMIT_S, then every 10-30 ms, raises _Hung into it.

    A raise that lands in a finalizer (a ``__del__`` run by the garbage collector) is swallowed by
    Python, so a one-shot timer would let a hung call run until memory runs out: the timer repeats.
    Its interval is random: a fixed one locks in phase with a loop whose period divides it (each
    swallowed raise ends the finalizer, so the next tick lands at the same point of the loop). With
    ticks every 20 ms and a loop of 1 ms in a finalizer and 1 ms outside, all 401 ticks of a 10 s
    call landed in the finalizer (Python 3.11), and the hang was never reported.
    What is swallowed goes to ``sys.unraisablehook``: while armed, a hook that drops the _Hung ones
    (pytest's hook would report them as errors of the test) and passes the others on.
    """

    def __enter__(self) -> None:
        self.handler = signal.signal(signal.SIGALRM, _raise_hung)
        self.hook = sys.unraisablehook
        hook = self.hook
        sys.unraisablehook = lambda u: None if u.exc_type is _Hung else hook(u)
        signal.setitimer(signal.ITIMER_REAL, LIMIT_S)  # _raise_hung re-arms it

    def disarm(self) -> None:
        """Stop the timer and restore the handler and hook, even if a last tick raises into this."""
        while True:
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, self.handler)
                sys.unraisablehook = self.hook
                return
            except _Hung:
                continue


def run(where: str, call: Callable[[], Any], expect: str = "no escape") -> Outcome:
    """Run one misuse (interrupted after LIMIT_S: see ``_Armed``) and classify what came of it."""
    default = guard_mod._DEFAULT_MAX_CONCURRENCY  # set_default_max_concurrency is global state
    armed = _Armed()
    try:
        try:
            armed.__enter__()
            call()
        finally:
            armed.disarm()
    except _Hung:
        armed.disarm()
        return Outcome(where, "hung", None, expect)
    except StagebufError as e:
        return Outcome(where, "raised", e, expect)
    except Exception as e:
        return Outcome(where, "escaped", e, expect)
    finally:
        guard_mod._DEFAULT_MAX_CONCURRENCY = default
    return Outcome(where, "ok", None, expect)


def _callable(t: Target, member: str, obj: Any) -> Callable[..., Any]:
    if member == "()":
        assert t.ctor is not None
        return t.ctor
    if member in PROTOCOL:
        return PROTOCOL[member](obj)
    fn: Callable[..., Any] = getattr(obj, member)
    return fn


def _good(t: Target, p: inspect.Parameter, obj: Any) -> Any:
    if p.name in t.good:
        return t.good[p.name](obj)
    if p.default is not p.empty:
        return p.default
    return GOOD.get(p.name, lambda o: None)(obj)


def _calls(t: Target, member: str, param: str) -> list[Outcome]:
    """``member`` called with each bad value in ``param`` (twice, on one object, without params)."""
    label = _label(t.name, member)

    def fresh() -> Any:
        return None if member == "()" or t.make is None else t.make()

    if not param:
        obj = fresh()
        fn = _callable(t, member, obj)
        return [run(f"{label}() (call {k})", fn) for k in (1, 2)]
    excused = EXCUSED.get((t.name, member), {})
    out = []
    for bad in BAD:
        if bad in excused:
            continue

        def call(bad: str = bad) -> None:
            obj = fresh()
            fn = _callable(t, member, obj)
            params = _params(fn)
            args = {q.name: (_bad_values()[bad] if q.name == param else _good(t, q, obj)) for q in params}
            pos = [args.pop(q.name) for q in params if q.kind is q.POSITIONAL_ONLY]
            result = fn(*pos, **args)
            if t.settle is not None:  # accepted: the values reach the device (a new object: it works)
                t.settle(result if member == "()" else obj)

        out.append(run(f"{label}({param}={bad})", call))
    return out


def _attribute(t: Target, name: str) -> list[Outcome]:
    """Read, assign and delete attribute ``name`` of a fresh instance each time."""
    make = t.make
    assert make is not None
    out = [run(f"{t.name}.{name} (read)", lambda: getattr(make(), name), "ok")]
    if name in t.writable:

        def copy_in() -> None:
            obj = make()
            before = getattr(obj, name)
            values = np.arange(1, before.shape[0] + 1).astype(np.asarray(before).dtype)
            setattr(obj, name, values)
            after = getattr(obj, name)
            if after is not before or not np.array_equal(np.asarray(after), values):
                raise AssertionError(f"{t.name}.{name} = values did not copy into the same array")

        out.append(run(f"{t.name}.{name} = new values (a copy-in)", copy_in, "ok"))
        values, expect = BAD, "no escape"
    else:
        values, expect = ["<its own value>", "object()"], "read-only"
    for bad in values:

        def assign(bad: str = bad) -> None:
            obj = make()
            setattr(obj, name, getattr(obj, name) if bad == "<its own value>" else _bad_values()[bad])

        out.append(run(f"{t.name}.{name} = {bad}", assign, expect))
    out.append(run(f"del {t.name}.{name}", lambda: delattr(make(), name), "read-only"))
    return out


def sweep(case: Case) -> list[Outcome]:
    t = TARGETS[case.target]
    if case.param is None:
        return _attribute(t, case.member)
    return _calls(t, case.member, case.param)


def problems(outcomes: list[Outcome]) -> list[str]:
    """The outcomes that break the rule, one line each."""
    return [str(o) for o in outcomes if not o.fine]


# --- the cases ---------------------------------------------------------------------------

KNOWN: dict[str, str] = {
    # case id -> what escapes, for a violation found in a file someone else is changing: the case is
    # marked xfail(strict=True) until it is fixed, then the strict mark fails until it is dropped.
    # (The first run listed 25 such cases, each fixed since: dtype=<a tensor> in torch_dtype,
    # max_concurrency=2**70 without an upper bound, guard=<an array>, Step's attributes, ...)
}

CASES = collect()


def _params_of_cases() -> list[Any]:
    out = []
    for c in CASES:
        reason = KNOWN.get(c.id)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


_results: dict[tuple[str, Case], list[Outcome]] = {}
"""(tier, case) -> outcomes, kept for ``test_every_object_refuses_some_misuse``."""


def _swept(tier: stagebuf.Tier, case: Case) -> list[Outcome]:
    key = (tier.name, case)
    if key not in _results:
        _results[key] = sweep(case)
    return _results[key]


def test_known_violations_are_cases() -> None:
    assert set(KNOWN) <= {c.id for c in CASES}


@pytest.mark.parametrize("case", _params_of_cases())
def test_misuse_raises_only_stagebuf_errors(cpu_tier: stagebuf.Tier, case: Case) -> None:
    found = problems(_swept(cpu_tier, case))
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("target", sorted(set(TARGETS) - set(NOTHING_TO_MISUSE)))
def test_every_object_refuses_some_misuse(cpu_tier: stagebuf.Tier, target: str) -> None:
    """The sweep exercises each object for real: one of its misuses at least raised a StagebufError;
    and an instance made on this tier has the members the cases were collected from."""
    t = TARGETS[target]
    if t.make is not None:
        with _forced_tier("host"):
            collected = public_members(t.make())
        assert public_members(t.make()) == collected
    mine = [c for c in CASES if c.target == target]
    raised = [o for c in mine for o in _swept(cpu_tier, c) if o.kind == "raised"]
    assert mine and raised, f"no misuse of {target} raised"


# --- the settings, and the fixed cases of issue 18 -----------------------------------------


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        *[("STAGEBUF_CHECK", v) for v in ("false", "no", "off", "true", "yes", "2", "x")],
        *[("STAGEBUF_TIER", v) for v in ("fast", "gpu", "1")],
        *[("STAGEBUF_WRITE_KERNEL", v) for v in ("fast", "1", "cuda")],
    ],
)
def test_a_bad_setting_raises_setting_value_error_at_the_first_probe(
    monkeypatch: pytest.MonkeyPatch, setting: str, value: str
) -> None:
    monkeypatch.setenv(setting, value)
    for first_use in (stagebuf.capabilities, lambda: stagebuf.UvaBufferPool(4, torch.int32)):
        stagebuf.reset_capabilities()
        with pytest.raises(stagebuf.SetupError, match=f"{setting}={value!r}") as e:
            first_use()
        assert type(e.value) is stagebuf.SettingValueError and isinstance(e.value, ValueError)
        assert e.value.setting == setting and e.value.allowed


def test_the_sweep_covers_the_misuses_issue_18_named(cpu_tier: stagebuf.Tier) -> None:
    """``buf.device = x`` (once a bare AttributeError) and an unknown field, both ways, are cases."""
    ids = {c.id for c in CASES}
    assert {"HostBuffer.device (attribute)", "NonUvaBuffer.device (attribute)"} <= ids
    table = _table()
    for get in (lambda: table["nope"], lambda: table.fields["nope"]):
        with pytest.raises(stagebuf.UnknownFieldError, match="no field 'nope'; fields: a, b"):
            get()


# --- the sweep can fail --------------------------------------------------------------------


def _case(case_id: str) -> Case:
    return next(c for c in CASES if c.id == case_id)


def test_the_sweep_reports_a_plain_value_error(
    cpu_tier: stagebuf.Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = _case("UvaBufferPool.copy_to_uva(x)")
    assert problems(sweep(case)) == []
    real = stagebuf.UvaBufferPool.copy_to_uva

    def plain_value_error(self: stagebuf.UvaBufferPool, x: Any) -> Any:
        if x is None:
            raise ValueError("x=None")  # what a stagebuf check must never raise
        return real(self, x)

    monkeypatch.setattr(stagebuf.UvaBufferPool, "copy_to_uva", plain_value_error)
    found = problems(sweep(case))
    assert found == ["UvaBufferPool.copy_to_uva(x=None) -> escaped: ValueError: x=None (expected: no escape)"]


def test_the_sweep_reports_a_bare_attribute_error_and_an_accepted_write(
    cpu_tier: stagebuf.Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``buf.device = x`` did before it raised ReadOnlyAttributeError; then a write accepted."""
    case = _case("UvaBufferPool.device (attribute)")
    assert problems(sweep(case)) == []

    def bare(self: Any, name: str, value: Any) -> None:
        if "_sealed" in self.__dict__ and not name.startswith("_"):
            raise AttributeError(f"{name} is read-only")
        object.__setattr__(self, name, value)

    monkeypatch.setattr(stagebuf.UvaBufferPool, "__setattr__", bare)
    found = problems(sweep(case))
    assert len(found) == 2 and all("escaped: AttributeError: device is read-only" in f for f in found)
    monkeypatch.setattr(stagebuf.UvaBufferPool, "__setattr__", object.__setattr__)
    monkeypatch.setattr(stagebuf.UvaBufferPool, "__delattr__", object.__delattr__)
    found = problems(sweep(case))
    assert [f.split(" -> ")[0] for f in found] == [
        "UvaBufferPool.device = <its own value>",
        "UvaBufferPool.device = object()",
        "del UvaBufferPool.device",
    ]
    assert all(" -> ok (expected: read-only)" in f for f in found)


def test_the_sweep_reports_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    real = stagebuf.UvaBufferPool.copy_to_uva

    def hang(self: stagebuf.UvaBufferPool, x: Any) -> Any:
        while x is None:
            pass
        return real(self, x)

    monkeypatch.setattr(stagebuf.UvaBufferPool, "copy_to_uva", hang)
    found = problems(sweep(_case("UvaBufferPool.copy_to_uva(x)")))
    assert found == ["UvaBufferPool.copy_to_uva(x=None) -> hung (expected: no escape)"]


class _SlowFinalizer:
    def __del__(self) -> None:
        _busy(0.001)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_sweep_reports_a_hang_that_spends_its_time_in_finalizers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first interrupt often lands in a ``__del__`` and is swallowed (as it did in a slot loop
    that built 2**70 slots, in the full suite, until 16 GB were gone): the sweep raises again."""
    real = stagebuf.UvaBufferPool.copy_to_uva

    def hang(self: stagebuf.UvaBufferPool, x: Any) -> Any:
        start = time.perf_counter()
        while x is None and time.perf_counter() - start < 5 * LIMIT_S:  # bounded: a failing test ends
            _SlowFinalizer()  # half the time in a finalizer, half outside
            _busy(0.001)
        return real(self, x)

    monkeypatch.setattr(stagebuf.UvaBufferPool, "copy_to_uva", hang)
    for _ in range(2):  # twice: a timer locked in phase failed every sweep in a row
        found = problems(sweep(_case("UvaBufferPool.copy_to_uva(x)")))
        assert found == ["UvaBufferPool.copy_to_uva(x=None) -> hung (expected: no escape)"]


def test_an_object_that_refuses_nothing_is_reported() -> None:
    """The per-object check: a function that takes every bad value raises nothing at all."""
    t = Target("permissive", lambda x, n=1: None)
    outcomes = _calls(t, "()", "x") + _calls(t, "()", "n")
    assert len(outcomes) == 2 * len(BAD) and problems(outcomes) == []
    assert not [o for o in outcomes if o.kind == "raised"]


OBJECT_HOOK = pytest.mark.skipif(
    sys.version_info < (3, 12),
    reason="Python 3.12+: on 3.10/3.11 a __getattr__ hook slows every attribute read (_common.sealed)",
)


@OBJECT_HOOK
@pytest.mark.parametrize("target", [n for n, t in TARGETS.items() if t.make is not None])
def test_reading_a_missing_attribute_raises_a_stagebuf_error(cpu_tier: stagebuf.Tier, target: str) -> None:
    """A typo'd attribute read is the package's error too (an AttributeError: getattr/hasattr still work)."""
    obj = TARGETS[target].make()
    with pytest.raises(StagebufError) as e:
        obj.no_such_attribute  # noqa: B018
    assert isinstance(e.value, AttributeError) and "'no_such_attribute'" in str(e.value)
    assert not hasattr(obj, "no_such_attribute") and getattr(obj, "no_such_attribute", 7) == 7


def test_a_missing_module_attribute_is_a_stagebuf_error() -> None:
    with pytest.raises(stagebuf.UnknownAttributeError, match="stagebuf.__all__") as e:
        stagebuf.UvaBuffers  # noqa: B018
    assert isinstance(e.value, AttributeError) and not hasattr(stagebuf, "UvaBuffers")


@OBJECT_HOOK
def test_a_field_read_as_an_attribute_says_what_to_do() -> None:
    table = stagebuf.DeviceParamTable(2, {"temperature": torch.float32}, device="cpu")
    with pytest.raises(stagebuf.UnknownAttributeError, match=r"it is table\['temperature'\]"):
        table.temperature  # noqa: B018
