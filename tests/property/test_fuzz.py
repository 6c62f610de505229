"""Differential fuzzing: random call sequences against a pure-numpy model of the device.

Each ``RuleBasedStateMachine`` drives one public object (pool, backed tensor,
step stager, staged-write tensor, fused writer, param table) through random
sequences of calls: lengths that cross growth, every supported dtype and input
kind (list, ndarray, tensor, non-contiguous), and invalid calls that must be
refused without changing anything. After every step the device contents are
read back and compared with a numpy model kept by the machine itself: the model
never calls stagebuf to compute an expected value.

Each machine also runs in a lazy variant (``*_async``): every result is read by a
device kernel queued behind a ``torch.cuda._sleep``, with no synchronisation until
the example ends, so the host runs ahead and reuses slots while the device may
still read them. Only the slot guards keep those reads right. On the CPU, where
nothing is asynchronous, the lazy variants run a fifth of the examples.

Tiers: HOST and PAGEABLE (targeting the CPU) run everywhere, with a bounded
example count; UVA, PINNED and PAGEABLE on the CUDA device carry the ``gpu``
marker. Knobs (environment):

* ``STAGEBUF_FUZZ_EXAMPLES``: examples per machine and tier (default 25)
* ``STAGEBUF_FUZZ_STEPS``: steps per example (default 30)
* ``STAGEBUF_FUZZ_REPORT``: a JSON file that receives the examples and steps run
  per machine and tier (merged with what the file already holds)
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from helpers import FakeStream, force_tier, guard_staged_writes, read_back
from stagebuf import StepStager, Tier, UvaBackedTensor, UvaBufferPool
from stagebuf._rings import guard as guard_mod

try:
    from stagebuf import FusedStagedWriter, StagedWriteError, StagedWriteTensor
except ImportError:  # pragma: no cover - the module is part of the package
    StagedWriteTensor = FusedStagedWriter = StagedWriteError = None  # type: ignore[assignment,misc]
try:
    from stagebuf._rings.param_table import DeviceParamTable
except ImportError:  # pragma: no cover
    DeviceParamTable = None  # type: ignore[assignment,misc]

EXAMPLES = int(os.environ.get("STAGEBUF_FUZZ_EXAMPLES", "25"))
STEPS = int(os.environ.get("STAGEBUF_FUZZ_STEPS", "30"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

# (STAGEBUF_TIER, device): the CPU tiers target the CPU explicitly so that they mean the
# same on a GPU machine; the CUDA tiers use the default device.
TIER_PARAMS = [
    pytest.param("host", "cpu", id="host"),
    pytest.param("pageable", "cpu", id="pageable-cpu"),
    pytest.param("uva", None, id="cuda-uva", marks=pytest.mark.gpu),
    pytest.param("pinned", None, id="cuda-pinned", marks=pytest.mark.gpu),
    pytest.param("pageable", None, id="cuda-pageable", marks=pytest.mark.gpu),
]

NP_DTYPES = [
    np.dtype(d)
    for d in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64)
]
TORCH_OF = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}
KINDS = ["ndarray", "list", "tensor", "strided-tensor", "strided-ndarray"]

COUNTS: Counter[tuple[str, str, str]] = Counter()
SLEEP_CYCLES = 200_000  # about 0.1 ms of a GPU clock: long enough for the host to run ahead


# --------------------------------------------------------------------------- the model's helpers


def rand_array(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Random values of ``dtype`` over its whole range, floats with specials sprinkled in."""
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = (info.min, info.max) if rng.random() < 0.5 else (max(info.min, -100), min(info.max, 100))
        a = rng.integers(lo, hi, shape, dtype=dtype, endpoint=True)
        if a.size and rng.random() < 0.5:  # the edges of the range
            edges = np.array(sorted({info.min, info.max, 0, 1, max(info.min, -1)}), dtype=dtype)
            idx = rng.integers(0, a.size, min(a.size, 3))
            a.reshape(-1)[idx] = rng.choice(edges, idx.shape[0])
        return a
    a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
    if a.size and rng.random() < 0.5:
        fi = np.finfo(dtype)
        specials = np.array([np.nan, np.inf, -np.inf, -0.0, fi.max, fi.min, fi.tiny], dtype=dtype)
        idx = rng.integers(0, a.size, min(a.size, 3))
        a.reshape(-1)[idx] = rng.choice(specials, idx.shape[0])
    return a


def as_input(a: np.ndarray, kind: str) -> Any:
    """``a`` in one of the host input kinds the entry points accept."""
    if kind == "list":
        return a.tolist()
    if kind == "tensor":
        return torch.from_numpy(a.copy())
    if kind == "strided-tensor":  # every other element of a twice-as-long tensor
        big = torch.zeros((a.shape[0] * 2, *a.shape[1:]), dtype=TORCH_OF[a.dtype])
        big[::2] = torch.from_numpy(a.copy())
        return big[::2]
    if kind == "strided-ndarray":
        big = np.zeros((a.shape[0] * 2, *a.shape[1:]), dtype=a.dtype)
        big[::2] = a
        return big[::2]
    return a.copy()


def same(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype.kind == "f":
        return bool(
            np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want))
        )
    return bool(np.array_equal(got, want))


def assert_same(t: torch.Tensor, want: np.ndarray, what: str) -> None:
    got = read_back(t)
    assert same(got, want), f"{what}: device holds\n{got!r}\nmodel says\n{want!r}"


def _float_holds(v: int, target: np.dtype) -> bool:
    """Whether the float ``target`` holds the integer ``v`` exactly: its significant bits fit."""
    bits = int(np.finfo(target).nmant) + 1
    drop = max(abs(v).bit_length() - bits, 0)
    return abs(v) >> drop << drop == abs(v)


def _fits(a: np.ndarray, target: np.dtype) -> np.ndarray | None:
    """``a`` converted to ``target`` where the documented rule accepts it, else None.

    The rule, in exact Python arithmetic: bools and numbers never mix; into an integer dtype
    every value must be finite, whole and inside the range; into a float dtype every finite
    value must be inside the range (rounding a float is allowed, NaN and inf pass), and every
    integer must be one the float dtype holds exactly (at most ``nmant + 1`` significant bits).
    """
    if a.dtype == target:
        return a.copy()
    if (a.dtype.kind == "b") != (target.kind == "b"):
        return None
    values = a.reshape(-1).tolist()
    if target.kind in "iu":
        info = np.iinfo(target)
        for v in values:
            if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf")) or v != int(v)):
                return None
            if not info.min <= int(v) <= info.max:
                return None
    else:
        fmax = float(np.finfo(target).max)
        for v in values:
            if isinstance(v, int) and (abs(v) > fmax or not _float_holds(v, target)):
                return None
            if isinstance(v, float) and v == v and abs(v) != float("inf") and abs(v) > fmax:
                return None
    return a.astype(target)


def pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


seeds = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------- the machines


class TierMachine(RuleBasedStateMachine):
    """Base: the tier and device under test, and the counters."""

    tier_name: ClassVar[str] = "host"
    device: ClassVar[str | None] = "cpu"
    label: ClassVar[str] = "base"
    lazy: ClassVar[bool] = False
    """Asynchronous consumers: each result is read by a device kernel queued behind a sleep, with
    no synchronisation until the example ends, so the host runs ahead and reuses slots while the
    device may still read them; only the slot guards keep the results right."""

    def __init__(self) -> None:
        super().__init__()
        COUNTS[(self.label, self.tier_id(), "examples")] += 1
        self.snaps: list[tuple[torch.Tensor, np.ndarray, str]] = []
        self.nstep = 0

    def consume(self, t: torch.Tensor, want: np.ndarray, what: str) -> None:
        """Lazy mode: queue a device read of ``t`` now, compare it when the example ends."""
        if not self.lazy:
            return
        if t.device.type == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream falls behind the host
        self.snaps.append((t.clone(), want.copy(), what))

    def teardown(self) -> None:
        if not self.snaps:
            return
        if any(t.device.type == "cuda" for t, _, _ in self.snaps):
            torch.cuda.synchronize()
        for i, (t, want, what) in enumerate(self.snaps):
            got = t.cpu().numpy()
            assert same(got, want), f"read {i} ({what}) queued on the device saw\n{got!r}\nnot\n{want!r}"

    @classmethod
    def tier_id(cls) -> str:
        return f"{cls.tier_name}-{'cpu' if cls.device == 'cpu' else 'cuda'}"

    def count(self) -> None:
        COUNTS[(self.label, self.tier_id(), "steps")] += 1
        self.nstep += 1

    def rng(self, seed: int) -> np.random.Generator:
        """Values for this step: the drawn seed mixed with the step number, so that the seeds
        hypothesis likes to repeat (0, 2**32 - 1, ...) still give fresh values; replays agree."""
        return np.random.default_rng([seed, self.nstep])

    @property
    def tier(self) -> Tier:
        return Tier.parse(self.tier_name)


class PoolMachine(TierMachine):
    """UvaBufferPool: copy_to_uva / copy_to_gpu of random lengths, growth included."""

    label = "pool"

    @initialize(
        dtype=st.sampled_from(NP_DTYPES),
        rows=st.integers(0, 8),
        trailing=st.sampled_from([(), (1,), (3,)]),
        depth=st.integers(1, 4),
    )
    def build(self, dtype: np.dtype, rows: int, trailing: tuple[int, ...], depth: int) -> None:
        self.dtype, self.trailing = dtype, trailing
        self.pool = UvaBufferPool(
            (rows, *trailing), TORCH_OF[dtype], max_concurrency=depth, device=self.device
        )
        self.slots = max(2, depth)
        self.caps = [rows] * self.slots  # the model of each slot's first dimension
        self.next_slot = 0
        self.growths = 0
        self.transfers = 0
        # copy_to_uva results still valid: (slot, tensor, values); a slot taken again drops its own
        self.window: list[tuple[int, torch.Tensor, np.ndarray]] = []
        self.owned: list[tuple[torch.Tensor, np.ndarray]] = []  # copy_to_gpu results: never overwritten
        self.published: np.ndarray | None = None  # what the current slot's device side last received
        assert self.pool.tier is self.tier

    def _take_slot(self, n: int) -> int:
        s = self.next_slot
        if n > self.caps[s]:
            self.caps[s] = pow2_at_least(n)
            self.growths += 1
        self.next_slot = (s + 1) % self.slots
        self.window = [w for w in self.window if w[0] != s]
        return s

    def _publish(self, t: torch.Tensor, a: np.ndarray) -> None:
        """copy_to_uva of the values ``a``: equal to the current slot's last publish (its first
        len(a) rows), it reuses that slot (no copy, no new slot); else it takes the next one."""
        last = self.published
        if last is not None and a.shape[0] <= last.shape[0] and a.tobytes() == last[: a.shape[0]].tobytes():
            slot = (self.next_slot - 1) % self.slots
        else:
            slot = self._take_slot(a.shape[0])
            if self.tier.copies:
                self.transfers += 1
            self.published = a.copy()
        self.window.append((slot, t, a))

    @rule(n=st.integers(0, 40), kind=st.sampled_from(KINDS), seed=seeds)
    def copy_to_uva(self, n: int, kind: str, seed: int) -> None:
        self.count()
        a = rand_array(self.rng(seed), self.dtype, (n, *self.trailing))
        t = self.pool.copy_to_uva(as_input(a, kind))
        self._publish(t, a)
        self.consume(t, a, "copy_to_uva")

    @rule(src=st.sampled_from(NP_DTYPES), n=st.integers(1, 12), seed=seeds, as_tensor=st.booleans())
    def convert(self, src: np.dtype, n: int, seed: int, as_tensor: bool) -> None:
        """An input of another dtype: accepted and converted where every value fits, else refused."""
        self.count()
        a = rand_array(self.rng(seed), src, (n, *self.trailing))
        fits = _fits(a, self.dtype)
        x = torch.from_numpy(a.copy()) if as_tensor else a
        if fits is None:
            with pytest.raises((TypeError, ValueError)):
                self.pool.copy_to_uva(x)
            return
        t = self.pool.copy_to_uva(x)
        self._publish(t, fits)
        self.consume(t, fits, "converted copy_to_uva")

    @rule(n=st.integers(0, 40), kind=st.sampled_from(KINDS), seed=seeds, with_out=st.booleans())
    def copy_to_gpu(self, n: int, kind: str, seed: int, with_out: bool) -> None:
        self.count()
        a = rand_array(self.rng(seed), self.dtype, (n, *self.trailing))
        out = None
        if with_out:
            out = torch.full((n, *self.trailing), 1, dtype=TORCH_OF[self.dtype], device=self.pool.device)
        t = self.pool.copy_to_gpu(as_input(a, kind), out=out)
        if out is not None:
            assert t.data_ptr() == out.data_ptr()
        self._take_slot(n)  # took a slot: its result is not a view of it
        self.published = None  # nor did the slot's device side receive the values
        if self.tier is not Tier.HOST:
            self.transfers += 1
        self.owned = (self.owned + [(t, a)])[-8:]
        self.consume(t, a, "copy_to_gpu")

    @rule(data=st.data())
    def refused(self, data: st.DataObject) -> None:
        """An invalid input: refused, and no slot taken (the window below still holds)."""
        self.count()
        row = self.trailing
        bad: list[Any] = [
            np.zeros((2, *row, 2), self.dtype),  # one rank too many
            None,
            [[1, "a"]] if row else [1, "a"],  # mixed types
            torch.zeros((2, *row), dtype=TORCH_OF[self.dtype], device="meta"),  # on another device
        ]
        if row:
            bad.append(np.zeros((2, row[0] + 1), self.dtype))  # rows of the wrong shape
        if self.dtype.kind in "iu":
            bad += [np.full((2, *row), np.nan), np.full((2, *row), 2.0**70), np.full((2, *row), 0.5)]
        if self.dtype.kind != "b":
            bad.append(np.ones((2, *row), bool))
        if self.dtype.kind == "f" and self.dtype.itemsize < 8:
            bad.append(np.full((2, *row), 1e300))  # finite, beyond the dtype's range
        x = data.draw(st.sampled_from(bad))
        with pytest.raises((TypeError, ValueError)):
            self.pool.copy_to_uva(x)

    @invariant()
    def device_matches_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        for i, (slot, t, a) in enumerate([] if self.lazy else self.window):
            assert t.device == self.pool.device and t.dtype == TORCH_OF[self.dtype]
            assert_same(t, a, f"copy_to_uva result {i} of those still valid (slot {slot})")
        for t, a in [] if self.lazy else self.owned:
            assert_same(t, a, "copy_to_gpu result")
        s = self.pool.stats()
        assert s["growths"] == self.growths and s["transfers"] == self.transfers
        assert self.pool.tier is self.tier


class BackedMachine(TierMachine):
    """UvaBackedTensor: host writes through .np / .cpu, publishes of the first n rows."""

    label = "backed"

    @initialize(
        dtype=st.sampled_from(NP_DTYPES),
        rows=st.integers(1, 12),
        trailing=st.sampled_from([(), (2,)]),
        depth=st.integers(1, 3),
    )
    def build(self, dtype: np.dtype, rows: int, trailing: tuple[int, ...], depth: int) -> None:
        self.dtype, self.rows, self.trailing = dtype, rows, trailing
        self.bt = UvaBackedTensor(
            (rows, *trailing), TORCH_OF[dtype], max_concurrency=depth, device=self.device
        )
        self.slots = max(2, depth)
        self.host = np.zeros((rows, *trailing), dtype)
        self.window = [(self.bt.gpu, self.host.copy())]
        assert self.bt.tier is self.tier

    @rule(data=st.data(), seed=seeds, via_torch=st.booleans())
    def host_write(self, data: st.DataObject, seed: int, via_torch: bool) -> None:
        self.count()
        lo = data.draw(st.integers(0, self.rows - 1))
        hi = data.draw(st.integers(lo, self.rows))
        vals = rand_array(self.rng(seed), self.dtype, (hi - lo, *self.trailing))
        if via_torch:
            self.bt.cpu[lo:hi] = torch.from_numpy(vals.copy())
        else:
            self.bt.np[lo:hi] = vals
        self.host[lo:hi] = vals

    @rule(n=st.one_of(st.none(), st.integers(0, 12)))
    def publish(self, n: int | None) -> None:
        self.count()
        if n is not None and n > self.rows:
            with pytest.raises(ValueError, match="n="):
                self.bt.copy_to_uva(n)
            return
        g = self.bt.copy_to_uva(n)
        assert g is self.bt.gpu
        k = self.rows if n is None else n
        self.window = (self.window + [(g, self.host[:k].copy())])[-self.slots :]
        self.consume(g, self.host[:k], f"publish of {k} rows")

    @invariant()
    def device_matches_model(self) -> None:
        if not hasattr(self, "bt"):
            return
        assert same(self.bt.np, self.host) and same(self.bt.cpu.numpy(), self.host)
        for t, snap in [] if self.lazy else self.window:  # later host writes never reach a published tensor
            assert_same(t, snap, "published rows")


_STAGE_DTYPES = [None, torch.int32, torch.int64, torch.float32, torch.float16, torch.uint8, torch.bool]


class StagerMachine(TierMachine):
    """StepStager: steps of many arrays (growth inside a step), flushes, abandons, marks."""

    label = "stager"

    @initialize(capacity=st.sampled_from([16, 64, 200, 4096]), depth=st.integers(1, 3))
    def build(self, capacity: int, depth: int) -> None:
        self.stager = StepStager(device=self.device, capacity=capacity, max_concurrency=depth)
        self.slots = max(2, depth)
        self.step: Any = None
        self.pending: list[tuple[torch.Tensor, np.ndarray]] = []
        self.done: list[tuple[int, list[tuple[torch.Tensor, np.ndarray]]]] = []  # (seq, results)
        self.seq = 0
        self.transfers = 0
        assert self.stager.tier is self.tier

    @precondition(lambda self: self.step is None)
    @rule()
    def begin(self) -> None:
        self.count()
        self.step = self.stager.step()
        self.pending = []
        self.seq += 1

    @precondition(lambda self: self.step is not None)
    @rule(
        dtype=st.sampled_from(NP_DTYPES),
        shape=st.sampled_from([(0,), (1,), (7,), (33,), (3, 5), (20, 4)]),
        kind=st.sampled_from(KINDS),
        seed=seeds,
        give_dtype=st.booleans(),
    )
    def stage(self, dtype: np.dtype, shape: tuple[int, ...], kind: str, seed: int, give_dtype: bool) -> None:
        self.count()
        a = rand_array(self.rng(seed), dtype, shape)
        x = as_input(a, kind)
        if kind == "list" and not give_dtype:  # numpy's reading of a list; an empty one is int64
            want = np.asarray(a.tolist()) if a.size else np.empty(shape, np.int64)
        else:
            want = a
        t = self.step.stage(x, dtype=TORCH_OF[dtype] if give_dtype else None)
        assert t.device == self.stager.device and t.shape == want.shape
        assert t.data_ptr() % 16 == 0 or want.size == 0
        self.pending.append((t, want))

    @precondition(lambda self: self.step is not None)
    @rule(src=st.sampled_from(NP_DTYPES), dst=st.sampled_from(NP_DTYPES), n=st.integers(1, 12), seed=seeds)
    def stage_converted(self, src: np.dtype, dst: np.dtype, n: int, seed: int) -> None:
        """An array of one dtype staged as another: converted where every value fits, else refused."""
        self.count()
        a = rand_array(self.rng(seed), src, (n,))
        want = _fits(a, dst)
        if want is None:
            with pytest.raises((TypeError, ValueError)):
                self.step.stage(a, dtype=TORCH_OF[dst])
            return
        self.pending.append((self.step.stage(a, dtype=TORCH_OF[dst]), want))

    @precondition(lambda self: self.step is not None)
    @rule(bad=st.sampled_from(["rank3", "scalar", "none", "mixed", "nan-int", "bool-int"]))
    def refused(self, bad: str) -> None:
        self.count()
        x, dt = {
            "rank3": (np.zeros((2, 2, 2)), None),
            "scalar": (5, None),
            "none": (None, None),
            "mixed": ([1, "a"], None),
            "nan-int": ([1.0, np.nan], torch.int32),
            "bool-int": (np.array([True]), torch.int64),
        }[bad]
        with pytest.raises((TypeError, ValueError)):
            self.step.stage(x, dtype=dt)

    @precondition(lambda self: self.step is not None)
    @rule()
    def flush(self) -> None:
        self.count()
        self.step.flush()
        if self.tier.copies and any(w.size for _, w in self.pending):
            self.transfers += 1
        self.done.append((self.seq, self.pending))
        for t, want in self.pending:
            self.consume(t, want, f"step {self.seq}")
        self.step = None

    @precondition(lambda self: self.step is not None)
    @rule()
    def abandon(self) -> None:
        """An exception inside ``with stager.step()``: the step is dropped, the stager goes on."""
        self.count()
        with pytest.raises(KeyError), self.step:
            raise KeyError("the engine failed mid-step")
        self.step = None

    @precondition(lambda self: self.step is None)
    @rule()
    def mark_consumed(self) -> None:
        self.count()
        self.stager.mark_consumed()

    @invariant()
    def device_matches_model(self) -> None:
        if not hasattr(self, "stager"):
            return
        # a flushed step's tensors hold until its slot is begun again, `slots` steps later
        for seq, results in [] if self.lazy else self.done:
            if seq > self.seq - self.slots:
                for t, want in results:
                    assert_same(t, want, f"step {seq} (now at step {self.seq})")
        s = self.stager.stats()
        assert s["steps"] == self.seq and s["transfers"] == self.transfers
        self.done = [d for d in self.done if d[0] > self.seq - self.slots]


SW_DTYPES = [torch.int32, torch.int64, torch.float32]
SW_NP = {d: np.dtype(torch.empty(0, dtype=d).numpy().dtype) for d in SW_DTYPES}
BAD_LISTS = ["nan", "fraction", "range", "bools", "string", "nested", "none"]


def bad_list(kind: str, target: np.dtype) -> list[Any]:
    """A list value ``target`` cannot hold (checked when applied), first element bad; 1 or 2 elements."""
    if target.kind == "f":
        return {
            "nan": [1e300],
            "fraction": [-1e300, 1.0],
            "range": [1e39],
            "bools": [True, False],
            "string": ["a", 1.0],
            "nested": [[1.0]],
            "none": [None, 1.0],
        }[kind]
    past = 2**63 if target.itemsize == 8 else 2**31
    return {
        "nan": [float("nan")],
        "fraction": [0.5, 1],
        "range": [past, 1],
        "bools": [True],
        "string": ["1"],
        "nested": [[1, 2]],
        "none": [None],
    }[kind]


class StagedEdits:
    """The model of one StagedWriteTensor: its contents and its staged edits (a bad one: refused at apply)."""

    def __init__(self, t: StagedWriteTensor, np_dtype: np.dtype):
        self.t = t
        self.model = np.zeros((t.rows, t.cols), np_dtype)
        self.staged: list[tuple[int, int, Any, bool]] = []  # (row, start, values, bad)

    def add(self, row: int, start: int, values: Any, bad: bool = False) -> None:
        if bad or len(values):
            self.staged.append((row, start, values, bad))

    def first_bad(self) -> int | None:
        return next((k for k, e in enumerate(self.staged) if e[3]), None)

    def apply(self) -> None:
        assert self.first_bad() is None
        for row, start, a, _ in self.staged:  # staging order: later edits win
            self.model[row, start : start + len(a)] = a
        self.staged = []

    def want(self) -> np.ndarray:
        return self.model if self.t.gpu.dim() == 2 else self.model[:, 0]

    def refused(self, err: BaseException) -> None:
        """``err`` names the first bad edit; the staged edits are all still there, in order."""
        k = self.first_bad()
        assert isinstance(err, StagedWriteError) and k is not None
        row, start = self.staged[k][:2]
        assert (err.position, err.index, err.start) == (k, row, start), (err, k, row, start)
        self.check_pending()

    def check_pending(self) -> None:
        got = self.t.pending_writes()
        assert self.t.num_staged == len(got) == len(self.staged)
        for (r, s, vals), (mr, ms, mv, bad) in zip(got, self.staged, strict=True):
            assert (r, s, len(vals)) == (mr, ms, len(mv))
            if not bad:
                assert same(np.array(vals, dtype=self.model.dtype), np.asarray(mv))

    def restage_good(self) -> None:
        """The caller's recovery from a refused apply: clear, then stage the good edits again."""
        good = [e for e in self.staged if not e[3]]
        self.t.clear_staged_writes()
        self.staged = []
        for row, start, a, _ in good:
            self.t.stage_write(row, start, a)
            self.add(row, start, a)


Batch = tuple[np.ndarray, np.ndarray, np.ndarray, "np.ndarray | None", list[tuple[int, int, np.ndarray]]]


def draw_batch(data: st.DataObject, rng: np.random.Generator, rows: int, cols: int, dtype: np.dtype) -> Batch:
    """A valid stage_writes batch (2-D values, 1-D values, or runs with lengths) and its edits."""
    e = data.draw(st.integers(0, 5))
    form = data.draw(st.sampled_from(["2d", "1d", "runs"]))
    r = rng.integers(0, rows, e)
    if form == "runs":
        s = rng.integers(0, cols + 1, e)
        lens = (rng.integers(0, cols + 1, e) % (cols - s + 1)).astype(np.int64)
        v = rand_array(rng, dtype, (int(lens.sum()),))
        ends = np.cumsum(lens)
        edits = [(int(r[i]), int(s[i]), v[ends[i] - lens[i] : ends[i]]) for i in range(e)]
        return r, s, v, lens, edits
    width = 1 if form == "1d" else int(rng.integers(0, cols + 1))
    s = rng.integers(0, cols - width + 1, e)
    v = rand_array(rng, dtype, (e,) if form == "1d" else (e, width))
    edits = [(int(r[i]), int(s[i]), v[i].reshape(-1)) for i in range(e)]
    return r, s, v, None, edits


class StagedWriteMachine(TierMachine):
    """StagedWriteTensor: random edits (lists, arrays, batches; overlapping, empty, whole-row), bad list
    values refused at apply (nothing written, everything kept; then cleared or re-staged), applies, clears."""

    label = "staged_write"

    @initialize(
        dtype=st.sampled_from(SW_DTYPES),
        rows=st.integers(1, 9),
        cols=st.sampled_from([None, 1, 5, 40]),
        uva=st.booleans(),
        depth=st.integers(1, 3),
    )
    def build(self, dtype: torch.dtype, rows: int, cols: int | None, uva: bool, depth: int) -> None:
        self.np_dtype = SW_NP[dtype]
        size = rows if cols is None else (rows, cols)
        self.swt = StagedWriteTensor(size, dtype, self.device, max_concurrency=depth, uva_instead_of_gpu=uva)
        self.m = StagedEdits(self.swt, self.np_dtype)
        self.rows, self.cols = rows, 1 if cols is None else cols
        assert self.swt.gpu.shape == ((rows,) if cols is None else (rows, cols))
        assert self.swt.num_rows == rows and self.swt.max_concurrency == max(2, depth)

    @rule(data=st.data(), seed=seeds, kind=st.sampled_from(KINDS + ["iterable"]))
    def stage_write(self, data: st.DataObject, seed: int, kind: str) -> None:
        self.count()
        row = data.draw(st.integers(0, self.rows - 1))
        start = data.draw(st.integers(0, self.cols))
        n = data.draw(st.integers(0, self.cols - start))
        a = rand_array(self.rng(seed), self.np_dtype, (n,))
        x = iter(a.tolist()) if kind == "iterable" else as_input(a, kind)
        self.swt.stage_write(row, start, x)
        self.m.add(row, start, a)

    @rule(data=st.data(), src=st.sampled_from(NP_DTYPES), seed=seeds)
    def stage_write_converted(self, data: st.DataObject, src: np.dtype, seed: int) -> None:
        """Values of another dtype: staged where every value fits the target's dtype, else refused."""
        self.count()
        row = data.draw(st.integers(0, self.rows - 1))
        n = data.draw(st.integers(1, self.cols))
        a = rand_array(self.rng(seed), src, (n,))
        want = _fits(a, self.np_dtype)
        if want is None:
            with pytest.raises((TypeError, ValueError)):
                self.swt.stage_write(row, 0, a)
            return
        self.swt.stage_write(row, 0, a)
        self.m.add(row, 0, want)

    @rule(data=st.data(), seed=seeds)
    def stage_write_elem(self, data: st.DataObject, seed: int) -> None:
        self.count()
        row = data.draw(st.integers(0, self.rows - 1))
        a = rand_array(self.rng(seed), self.np_dtype, (1,))
        v = data.draw(st.sampled_from(["python", "numpy", "tensor0d"]))
        value: Any = {"python": a[0].item(), "numpy": a[0], "tensor0d": torch.from_numpy(a.copy())[0]}[v]
        self.swt.stage_write_elem(row, value)
        self.m.add(row, 0, a)

    @rule(data=st.data(), seed=seeds)
    def stage_writes(self, data: st.DataObject, seed: int) -> None:
        """A batch from arrays, checked when staged, in staging order with the other edits."""
        self.count()
        r, s, v, lens, edits = draw_batch(data, self.rng(seed), self.rows, self.cols, self.np_dtype)
        self.swt.stage_writes(r, s, v, lens)
        for row, start, a in edits:
            self.m.add(row, start, a)

    @rule(bad=st.sampled_from(["row", "start", "past", "lengths", "values", "bools", "rows-dtype"]))
    def stage_writes_refused(self, bad: str) -> None:
        """A bad batch raises naming what is wrong, and stages none of its edits."""
        self.count()
        z = np.zeros((2, 1), self.np_dtype)
        worse = 0.5 if self.np_dtype.kind in "iu" else 1e300
        call, exc, match = {
            "row": (lambda: self.swt.stage_writes([0, self.rows], [0, 0], z), ValueError, r"rows\[1\]="),
            "start": (lambda: self.swt.stage_writes([0, 0], [0, -1], z), ValueError, r"starts\[1\]=-1"),
            "past": (lambda: self.swt.stage_writes([0, 0], [0, self.cols], z), ValueError, "edit 1 "),
            "lengths": (
                lambda: self.swt.stage_writes([0], [0], z.reshape(-1), lengths=[1]),
                ValueError,
                "lengths add up to 1",
            ),
            "values": (
                lambda: self.swt.stage_writes([0, 0], [0, 0], np.array([[0.0], [worse]])),
                ValueError,
                r"edit 1 \(rows\[1\]=0, starts\[1\]=0\)",
            ),
            "bools": (lambda: self.swt.stage_writes([0], [0], np.array([True])), TypeError, "bools"),
            "rows-dtype": (lambda: self.swt.stage_writes([0.5], [0], z[:1]), TypeError, "rows has dtype"),
        }[bad]
        with pytest.raises(exc, match=match):
            call()

    @rule(data=st.data(), kind=st.sampled_from(BAD_LISTS), elem=st.booleans())
    def stage_bad_list(self, data: st.DataObject, kind: str, elem: bool) -> None:
        """A value only apply refuses: a list, or a Python number for stage_write_elem."""
        self.count()
        raw = bad_list(kind, self.np_dtype)[: self.cols]
        row = data.draw(st.integers(0, self.rows - 1))
        if elem and isinstance(raw[0], (int, float)) and not isinstance(raw[0], bool):
            self.swt.stage_write_elem(row, raw[0])
            self.m.add(row, 0, raw[:1], bad=True)
            return
        start = data.draw(st.integers(0, self.cols - len(raw)))
        self.swt.stage_write(row, start, raw)
        self.m.add(row, start, raw, bad=True)

    @rule(
        bad=st.sampled_from(
            ["row", "neg-row", "start", "too-long", "nan-array", "bool-array", "none", "elem-bool", "rank2"]
        )
    )
    def refused(self, bad: str) -> None:
        """Refused when staged: the row, the columns, and values that are not a list."""
        self.count()
        not_fit = np.array([1e300]) if self.np_dtype.kind == "f" else np.array([np.nan])
        call = {
            "row": lambda: self.swt.stage_write(self.rows, 0, [1]),
            "neg-row": lambda: self.swt.stage_write(-1, 0, [1]),
            "start": lambda: self.swt.stage_write(0, -1, [1]),
            "too-long": lambda: self.swt.stage_write(0, 0, [1.5] * (self.cols + 1)),
            "nan-array": lambda: self.swt.stage_write(0, 0, not_fit),
            "bool-array": lambda: self.swt.stage_write(0, 0, np.array([True])),
            "none": lambda: self.swt.stage_write_elem(0, None),
            "elem-bool": lambda: self.swt.stage_write_elem(0, True),
            "rank2": lambda: self.swt.stage_write(0, 0, np.zeros((1, 1), self.np_dtype)),
        }[bad]
        with pytest.raises((TypeError, ValueError)):
            call()

    @rule()
    def apply(self) -> None:
        self.count()
        if self.m.first_bad() is not None:
            with pytest.raises(StagedWriteError) as ei:
                self.swt.apply_write()
            self.m.refused(ei.value)
            return
        self.swt.apply_write()
        self.m.apply()
        self.consume(self.swt.gpu, self.m.want(), "after apply")

    @precondition(lambda self: hasattr(self, "m") and self.m.first_bad() is not None)
    @rule(clear=st.booleans())
    def recover(self, clear: bool) -> None:
        """After a refused apply: drop everything, or re-stage the good edits."""
        self.count()
        if clear:
            self.clear()
        else:
            self.m.restage_good()

    @rule()
    def clear(self) -> None:
        self.count()
        self.swt.clear_staged_writes()
        self.m.staged = []

    @invariant()
    def device_matches_model(self) -> None:
        if not hasattr(self, "swt"):
            return
        if not self.lazy:  # staged, unapplied edits are invisible
            assert_same(self.swt.gpu, self.m.want(), "staged-write target")
        self.m.check_pending()


class FusedWriterMachine(TierMachine):
    """FusedStagedWriter over several tensors of one dtype, mixed with single applies; a bad list value
    in any tensor makes the whole apply refuse (nothing written anywhere, everything kept)."""

    label = "fused_writer"

    @initialize(
        dtype=st.sampled_from(SW_DTYPES),
        shapes=st.lists(st.tuples(st.integers(1, 6), st.sampled_from([1, 3, 17])), min_size=1, max_size=3),
        max_writes=st.integers(1, 4),
        depth=st.integers(1, 3),
    )
    def build(self, dtype: torch.dtype, shapes: list[tuple[int, int]], max_writes: int, depth: int) -> None:
        self.np_dtype = SW_NP[dtype]
        self.ts = [StagedWriteTensor(s, dtype, self.device, max_concurrency=depth) for s in shapes]
        self.writer = FusedStagedWriter(self.device, max_writes, max_concurrency=depth)
        self.ms = [StagedEdits(t, self.np_dtype) for t in self.ts]

    @rule(data=st.data(), seed=seeds, as_list=st.booleans())
    def stage(self, data: st.DataObject, seed: int, as_list: bool) -> None:
        self.count()
        i = data.draw(st.integers(0, len(self.ts) - 1))
        rows, cols = self.ms[i].model.shape
        row = data.draw(st.integers(0, rows - 1))
        start = data.draw(st.integers(0, cols - 1))
        n = data.draw(st.integers(1, cols - start))
        a = rand_array(self.rng(seed), self.np_dtype, (n,))
        self.ts[i].stage_write(row, start, a.tolist() if as_list else a)
        self.ms[i].add(row, start, a)

    @rule(data=st.data(), seed=seeds)
    def stage_batch(self, data: st.DataObject, seed: int) -> None:
        self.count()
        i = data.draw(st.integers(0, len(self.ts) - 1))
        rows, cols = self.ms[i].model.shape
        r, s, v, lens, edits = draw_batch(data, self.rng(seed), rows, cols, self.np_dtype)
        self.ts[i].stage_writes(r, s, v, lens)
        for row, start, a in edits:
            self.ms[i].add(row, start, a)

    @rule(data=st.data(), kind=st.sampled_from(BAD_LISTS))
    def stage_bad_list(self, data: st.DataObject, kind: str) -> None:
        self.count()
        i = data.draw(st.integers(0, len(self.ts) - 1))
        rows, cols = self.ms[i].model.shape
        raw = bad_list(kind, self.np_dtype)[:cols]
        row = data.draw(st.integers(0, rows - 1))
        start = data.draw(st.integers(0, cols - len(raw)))
        self.ts[i].stage_write(row, start, raw)
        self.ms[i].add(row, start, raw, bad=True)

    def _refusing(self, idx: list[int]) -> int | None:
        """Applying ``idx`` (in order, repeats once) writes all, or none: the first tensor with a bad edit."""
        order = list(dict.fromkeys(idx))
        bad = [i for i in order if self.ms[i].first_bad() is not None]
        return bad[0] if bad else None

    @rule(data=st.data())
    def fused_apply(self, data: st.DataObject) -> None:
        self.count()
        idx = data.draw(st.lists(st.integers(0, len(self.ts) - 1), max_size=4))  # repeats allowed
        tensors = [self.ts[i] for i in idx]
        kw: dict[str, Any] = {}
        if data.draw(st.booleans()):  # vLLM's call shape: the pointers and row strides, checked
            kw = {
                "output_ptrs": [t.gpu.data_ptr() for t in tensors],
                "output_strides": torch.tensor([t.row_stride for t in tensors], dtype=torch.int64),
            }
        first_bad = self._refusing(idx)
        if first_bad is not None:
            with pytest.raises(StagedWriteError) as ei:
                self.writer.apply(tensors, **kw)
            self.ms[first_bad].refused(ei.value)
            return
        self.writer.apply(tensors, **kw)
        for i in set(idx):
            self.ms[i].apply()
            self.consume(self.ts[i].gpu, self.ms[i].want(), f"tensor {i} after apply")

    @rule(data=st.data())
    def single_apply(self, data: st.DataObject) -> None:
        self.count()
        i = data.draw(st.integers(0, len(self.ts) - 1))
        if self.ms[i].first_bad() is not None:
            with pytest.raises(StagedWriteError) as ei:
                self.ts[i].apply_write()
            self.ms[i].refused(ei.value)
            return
        self.ts[i].apply_write()
        self.ms[i].apply()
        self.consume(self.ts[i].gpu, self.ms[i].want(), f"tensor {i} after apply")

    @precondition(lambda self: hasattr(self, "ms") and any(m.first_bad() is not None for m in self.ms))
    @rule(clear=st.booleans())
    def recover(self, clear: bool) -> None:
        self.count()
        for t, m in zip(self.ts, self.ms, strict=True):
            if m.first_bad() is None:
                continue
            if clear:
                t.clear_staged_writes()
                m.staged = []
            else:
                m.restage_good()

    @rule(bad=st.sampled_from(["not-a-tensor", "none-item", "ptrs", "strides"]))
    def refused(self, bad: str) -> None:
        """A bad call is refused before anything is applied: every staged edit stays staged."""
        self.count()
        if bad in ("ptrs", "strides"):
            wrong = {"output_ptrs": [0] * len(self.ts)} if bad == "ptrs" else {"output_strides": [-1]}
            with pytest.raises(ValueError, match="does not match"):
                self.writer.apply(self.ts, **wrong)
            return
        items: list[Any] = [*self.ts, "x"] if bad == "not-a-tensor" else [self.ts[0], None]
        with pytest.raises(TypeError, match=r"tensors\[\d\]"):
            self.writer.apply(items)

    @invariant()
    def device_matches_model(self) -> None:
        if not hasattr(self, "ts"):
            return
        for i, (t, m) in enumerate(zip(self.ts, self.ms, strict=True)):
            if not self.lazy:
                assert_same(t.gpu, m.want(), f"tensor {i}")
            m.check_pending()


class SharedGuardMachine(TierMachine):
    """Two pools, a step stager and a staged-write tensor on one device, all guarded by its one step clock.

    Every ring's guard is on (``wait``; on the CPU through fake events that complete when waited for
    or when the device "catches up"). Results must hold for their whole reuse window; on the CPU the
    guard's waits are exactly the fake stream's synchronisations and it never records more events
    than there were uses.
    """

    label = "shared_guard"

    @initialize(depth=st.integers(1, 3), dtype=st.sampled_from(SW_DTYPES))
    def build(self, depth: int, dtype: torch.dtype) -> None:
        self.fake: FakeStream | None = None
        if self.device == "cpu":  # fake events: a fresh step clock per example (test_fuzz undoes it)
            self.fake = FakeStream()
            guard_mod.make_event = self.fake.event
            guard_mod._clocks = {}
        self.np_dtype = SW_NP[dtype]
        self.slots = max(2, depth)
        self.pools = [
            UvaBufferPool(8, torch.int32, max_concurrency=depth, device=self.device, guard="wait")
            for _ in range(2)
        ]
        self.stager = StepStager(device=self.device, capacity=128, max_concurrency=depth, guard="wait")
        self.swt = StagedWriteTensor((4, 8), dtype, self.device, max_concurrency=depth)
        self.m = StagedEdits(self.swt, self.np_dtype)
        self.windows: list[list[tuple[torch.Tensor, np.ndarray]]] = [[], []]
        self.steps: list[list[tuple[torch.Tensor, np.ndarray]]] = []
        self.uses = 0
        assert all(p._ring.active for p in self.pools) and self.stager._ring.active

    @rule(i=st.integers(0, 1), n=st.integers(0, 12), seed=seeds)
    def pool_copy(self, i: int, n: int, seed: int) -> None:
        self.count()
        a = rand_array(self.rng(seed), np.dtype(np.int32), (n,))
        t = self.pools[i].copy_to_uva(a)
        self.uses += 1
        self.windows[i] = (self.windows[i] + [(t, a)])[-self.slots :]
        self.consume(t, a, f"pool {i}")

    @rule(sizes=st.lists(st.integers(0, 40), max_size=3), seed=seeds)
    def stager_step(self, sizes: list[int], seed: int) -> None:
        self.count()
        rng = self.rng(seed)
        arrays = [rand_array(rng, np.dtype(np.int64), (n,)) for n in sizes]
        with self.stager.step() as s:
            out = [(s.stage(a), a) for a in arrays]
        self.uses += 1
        self.steps = (self.steps + [out])[-self.slots :]
        for t, a in out:
            self.consume(t, a, "stager step")

    @rule(data=st.data(), seed=seeds, bad=st.booleans())
    def write(self, data: st.DataObject, seed: int, bad: bool) -> None:
        """Stage a batch and a list edit, maybe a bad one, and apply: refused, or written."""
        self.count()
        rng = self.rng(seed)
        r, s, v, lens, edits = draw_batch(data, rng, 4, 8, self.np_dtype)
        self.swt.stage_writes(r, s, v, lens)
        for row, start, a in edits:
            self.m.add(row, start, a)
        a = rand_array(rng, self.np_dtype, (3,))
        row = int(rng.integers(0, 4))
        self.swt.stage_write(row, 5, a.tolist())
        self.m.add(row, 5, a)
        if bad:
            self.swt.stage_write(1, 7, bad_list("fraction", self.np_dtype)[:1])
            self.m.add(1, 7, bad_list("fraction", self.np_dtype)[:1], bad=True)
            with pytest.raises(StagedWriteError) as ei:
                self.swt.apply_write()
            self.m.refused(ei.value)
            self.m.restage_good()
        self.swt.apply_write()
        self.uses += 1
        self.m.apply()
        self.consume(self.swt.gpu, self.m.want(), "staged-write target")

    @precondition(lambda self: getattr(self, "fake", None) is not None)
    @rule(behind=st.integers(0, 3))
    def device_catches_up(self, behind: int) -> None:
        """The device finishes every event but the last ``behind``."""
        self.count()
        self.fake.catch_up(behind)

    @invariant()
    def results_hold(self) -> None:
        if not hasattr(self, "pools"):
            return
        if not self.lazy:
            for i, window in enumerate(self.windows):
                for t, a in window:  # the pool's last `slots` results
                    assert_same(t, a, f"pool {i} result")
            for out in self.steps:
                for t, a in out:
                    assert_same(t, a, "stager step")
            assert_same(self.swt.gpu, self.m.want(), "staged-write target")
        waits = sum(p.stats()["guard_waits"] for p in self.pools) + self.stager.stats()["guard_waits"]
        waits += self.swt.stats()["guard_waits"]
        if self.fake is not None:
            assert waits == self.fake.syncs
            assert self.fake.records <= self.uses


PT_FIELDS = {
    "temperature": np.float32,
    "top_k": np.int32,
    "seed": np.int64,
    "greedy": np.bool_,
    "penalty": np.float16,
    "tok": np.uint8,
}


class ParamTableMachine(TierMachine):
    """DeviceParamTable: random row updates, syncs (forced or not) and no-op syncs."""

    label = "param_table"

    @initialize(
        rows=st.integers(0, 20),
        names=st.lists(st.sampled_from(sorted(PT_FIELDS)), min_size=1, max_size=6, unique=True),
        depth=st.integers(1, 3),
    )
    def build(self, rows: int, names: list[str], depth: int) -> None:
        fields = {n: TORCH_OF[np.dtype(PT_FIELDS[n])] for n in names}
        self.table = DeviceParamTable(rows, fields, self.device, max_concurrency=depth)
        self.rows = rows
        self.host = {n: np.zeros(rows, PT_FIELDS[n]) for n in names}
        self.dev = {n: a.copy() for n, a in self.host.items()}
        self.transfers = 0

    @precondition(lambda self: self.rows > 0)
    @rule(data=st.data(), seed=seeds)
    def update(self, data: st.DataObject, seed: int) -> None:
        self.count()
        name = data.draw(st.sampled_from(sorted(self.host)))
        lo = data.draw(st.integers(0, self.rows - 1))
        hi = data.draw(st.integers(lo, self.rows))
        a = rand_array(self.rng(seed), self.host[name].dtype, (hi - lo,))
        self.table[name].np[lo:hi] = a
        self.host[name][lo:hi] = a

    @rule(force=st.booleans())
    def sync(self, force: bool) -> None:
        self.count()
        changed = any(self.host[n].tobytes() != self.dev[n].tobytes() for n in self.host)
        assert self.table.sync(force=force) == (changed or force)
        if changed or force:
            self.dev = {n: a.copy() for n, a in self.host.items()}
            for n in self.host:
                self.consume(self.table[n].gpu, self.dev[n], f"field {n} after sync")
            if self.tier is not Tier.HOST:
                self.transfers += 1

    @rule()
    def unknown_field(self) -> None:
        self.count()
        with pytest.raises(KeyError, match="no field 'nope'"):
            self.table["nope"]

    @invariant()
    def device_matches_model(self) -> None:
        if not hasattr(self, "table"):
            return
        for n in self.host:
            assert same(self.table[n].np, self.host[n])
            if not self.lazy:
                assert_same(self.table[n].gpu, self.dev[n], f"field {n}")
        assert self.table.stats()["transfers"] == self.transfers


def _lazy(cls: type[TierMachine]) -> type[TierMachine]:
    """The same machine with asynchronous consumers (see ``TierMachine.lazy``)."""
    return type(f"Async{cls.__name__}", (cls,), {"lazy": True, "label": f"{cls.label}_async"})


MACHINES: list[type[TierMachine]] = [PoolMachine, BackedMachine, StagerMachine]
if StagedWriteTensor is not None:
    MACHINES += [StagedWriteMachine, FusedWriterMachine, SharedGuardMachine]
if DeviceParamTable is not None:
    MACHINES.append(ParamTableMachine)
MACHINES += [_lazy(m) for m in MACHINES]


# --------------------------------------------------------------------------- running them


def _record(counts: Counter[tuple[str, str, str]]) -> None:
    """Add ``counts`` to the STAGEBUF_FUZZ_REPORT file, if one is named (after each test, so that
    a run stopped by a time limit still reports what it ran)."""
    report = os.environ.get("STAGEBUF_FUZZ_REPORT")
    if not report or not counts:
        return
    path = Path(report)
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    for (machine, tier, what), n in counts.items():
        entry = data.setdefault(machine, {}).setdefault(tier, {"examples": 0, "steps": 0})
        entry[what] += n
    data["_settings"] = {"max_examples": EXAMPLES, "stateful_step_count": STEPS}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.label)
@pytest.mark.parametrize("tier, device", TIER_PARAMS)
def test_fuzz(
    machine: type[TierMachine], tier: str, device: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    force_tier(monkeypatch, tier)
    if machine.label.startswith("shared_guard") and device == "cpu":
        # guards on the CPU: the machine installs fake events (undone here); staged writes wait too
        monkeypatch.setattr(guard_mod, "make_event", guard_mod.make_event)
        monkeypatch.setattr(guard_mod, "_clocks", guard_mod._clocks)
        guard_staged_writes(monkeypatch, "wait")
    cls = type(
        f"{machine.__name__}_{tier}_{device or 'cuda'}", (machine,), {"tier_name": tier, "device": device}
    )
    conf = FUZZ_SETTINGS
    if machine.lazy and device == "cpu":  # no asynchrony on the CPU: a few examples check the path
        conf = settings(FUZZ_SETTINGS, max_examples=max(3, EXAMPLES // 5))
    before = COUNTS.copy()
    try:
        run_state_machine_as_test(cls, settings=conf)
    finally:
        _record(COUNTS - before)
    key = (machine.label, cls.tier_id(), "examples")
    assert COUNTS[key] > before[key]
