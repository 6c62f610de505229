"""A step's deferred writes into device tensors, as 32-bit words: one staged array and one launch.

:class:`StepBatch` keeps every write as rows of the staged-write kernel's metadata (target
address, first word, word count, source word) and its words, then at ``flush()`` writes the rows
and words into one reserved run of a :class:`StepStager` step (one transfer; none on UVA) and
runs one Triton launch per wave (a target written twice starts a new wave, so later writes win).
Without Triton (and on the CPU unless ``STAGEBUF_WRITE_KERNEL=triton``): a gather and an
``index_copy_`` per target; on HOST, numpy writes. vLLM's step mode (``vllm_step``) defers into it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .._bytes.buffers import tier_class
from .._common.tier import Tier
from .._rings.staged_write.kernel import MAX_BLOCK, launch_at, triton_usable
from .._rings.staged_write.launcher import WriteBatch
from .._rings.stager import Step, StepStager
from .._tiers.settings import Kernel, write_kernel

_BLOCK = MAX_BLOCK
"""The ``BLOCK`` of every launch, whatever its longest edit: the kernel is compiled once (a new
specialisation mid-run would load a module in the middle of a step)."""


class WordTarget:
    """A device tensor the batch writes, as 32-bit words."""

    __slots__ = ("tensor", "words", "words_np", "ptr", "factor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.words = tensor.view(-1).view(torch.int32)
        self.words_np = self.words.numpy() if tensor.device.type == "cpu" else None
        self.ptr = tensor.data_ptr()
        self.factor = tensor.element_size() // 4
        """32-bit words per element."""


class StepBatch:
    """One device's deferred writes and copies of the current step (see the module docstring).

    Rows of up to eight edits are kept as flat Python ints, longer ones as an array block;
    the step's rows and words are packed once, at the flush.
    """

    def __init__(self, device: torch.device, tier: Tier):
        self.device = device
        self.tier = tier
        self.host = device.type == "cpu" and not tier_class(tier).copies
        """Whether numpy writes the targets: CPU tensors whose staging needs no copy (their memory is the
        device's)."""
        # in place: vLLM's step enqueues no reader of the step's tensors before the flush
        self.stager = StepStager(device, capacity=1 << 16, in_place=True)
        # Triton on CUDA; on the CPU its interpreter only where STAGEBUF_WRITE_KERNEL=triton asks for it
        runs = device.type == "cuda" or write_kernel() == "triton"
        self.triton = not self.host and runs and triton_usable(device)
        self.kernel: Kernel = "triton" if self.triton else "host" if self.host else "scatter"
        """The kernel a flush runs."""
        self.step: Step | None = None
        self.targets: dict[int, WordTarget] = {}
        self.rows: list[int] = []
        """One-edit rows, flat (four ints each)."""
        self.blocks: list[np.ndarray] = []
        self.words: list[np.ndarray] = []
        self.nwords = 0
        self.longest = 0
        """The longest deferred edit, in words (the launch spreads it over ``programs_per_edit``)."""
        self.waves: list[tuple[list[int], list[np.ndarray]]] = []
        """Earlier waves of this batch (a target written twice starts a new one)."""
        self.in_wave: set[int] = set()
        self.launches = 0
        self.flushes = 0

    @property
    def pending(self) -> bool:
        return self.nwords > 0

    def open_step(self) -> Step:
        st = self.step
        if st is None:
            st = self.step = self.stager.step()
        return st

    def target(self, tensor: torch.Tensor) -> WordTarget:
        t = self.targets.get(tensor.data_ptr())
        if t is None or t.tensor is not tensor:
            t = self.targets[tensor.data_ptr()] = WordTarget(tensor)
        return t

    def _wave(self, ptr: int) -> None:
        if ptr in self.in_wave:  # written already in this wave: a later launch keeps staging order
            self.waves.append((self.rows, self.blocks))
            self.rows, self.blocks, self.in_wave = [], [], set()
        self.in_wave.add(ptr)

    def add_whole(self, target: WordTarget, words: np.ndarray) -> None:
        """Defer writing ``words`` (int32, flat) from the target's first word on."""
        ptr = target.ptr
        self._wave(ptr)
        n = words.shape[0]
        self.rows += (ptr, 0, n, self.nwords)
        self.words.append(words)
        self.nwords += n
        if n > self.longest:
            self.longest = n

    def add(self, target: WordTarget, dst: np.ndarray, lens: np.ndarray, vals: np.ndarray) -> None:
        """Defer writing ``vals`` (the target's dtype, flat) at element offsets ``dst``, ``lens`` each."""
        ptr = target.ptr
        self._wave(ptr)
        f = target.factor
        words = vals.view(np.int32) if vals.flags.c_contiguous else np.ascontiguousarray(vals).view(np.int32)
        e = dst.shape[0]
        src = self.nwords
        if e <= 8:  # a few edits: Python rows cost less than numpy's per-call overhead
            rows = self.rows
            longest = self.longest
            for d, n in zip(dst.tolist(), lens.tolist()):
                rows += (ptr, d * f, n * f, src)
                src += n * f
                if n * f > longest:
                    longest = n * f
            self.longest = longest
        else:
            blk = np.empty((e, 4), np.int64)
            blk[:, 0] = ptr
            if f == 1:
                blk[:, 1] = dst
                blk[:, 2] = lens
            else:
                np.multiply(dst, f, out=blk[:, 1])
                np.multiply(lens, f, out=blk[:, 2])
            np.cumsum(blk[:, 2], out=blk[:, 3])
            blk[:, 3] += src - blk[:, 2]
            self.blocks.append(blk)
            self.longest = max(self.longest, int(blk[:, 2].max()))
        self.words.append(words)
        self.nwords += words.shape[0]

    def add_batch(self, b: WriteBatch) -> None:
        """Defer writing a staged-write apply's checked batch (its edits write distinct elements)."""
        self.add(self.target(b.target.flat), b.first, b.lens, b.values)

    def flush(self) -> None:
        """Publish the step's staging and write every deferred edit (see the module docstring)."""
        if not self.nwords:
            st = self.step
            if st is not None:
                self.step = None
                st.flush()
            return
        self.flushes += 1
        waves = [*self.waves, (self.rows, self.blocks)]
        words = self.words
        nwords, longest = self.nwords, self.longest
        self.rows, self.blocks, self.words, self.nwords, self.waves, self.in_wave = [], [], [], 0, [], set()
        self.longest = 0
        if not self.triton:
            self._flush_plain(waves, words[0] if len(words) == 1 else np.concatenate(words))
            return
        # the rows (int64) and the words in one reserved run of the step's arena: one transfer
        counts = [len(rows) // 4 + sum(b.shape[0] for b in blocks) for rows, blocks in waves]
        head = 32 * sum(counts)
        st = self.open_step()
        self.step = None
        host, arena, off = st.reserve(head + 4 * nwords)
        h_meta = host[:head].view(np.int64)
        at = 0
        for rows, blocks in waves:
            if rows:
                h_meta[at : at + len(rows)] = rows
                at += len(rows)
            for blk in blocks:
                h_meta[at : at + blk.size] = blk.reshape(-1)
                at += blk.size
        h_words = host[head:].view(np.int32)
        if len(words) == 1:
            h_words[:] = words[0]
        else:
            np.concatenate(words, out=h_words)
        st.flush()
        addr = arena.data_ptr() + off
        row = 0
        for k in counts:  # in order: a later wave rewrites what an earlier one wrote
            launch_at(
                self.device,
                addr + 32 * row,
                addr + head,
                torch.int32,
                k,
                longest,
                self._tensors(arena, off, row, k, head, nwords),
                block=_BLOCK,
            )
            self.launches += 1
            row += k

    @staticmethod
    def _tensors(
        arena: torch.Tensor, off: int, row: int, k: int, head: int, nwords: int
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The launch's metadata and words as tensors (for a launch through Triton's dispatcher)."""

        def views() -> tuple[torch.Tensor, torch.Tensor]:
            meta = arena[off + 32 * row : off + 32 * (row + k)].view(torch.int64)
            return meta, arena[off + head : off + head + 4 * nwords].view(torch.int32)

        return views

    def _flush_plain(self, waves: list[tuple[list[int], list[np.ndarray]]], words: np.ndarray) -> None:
        """A flush without Triton: numpy on HOST, else a gather and an index_copy_ per target."""
        metas = []
        for rows, blocks in waves:
            parts = [np.array(rows, np.int64).reshape(-1, 4)] if rows else []
            metas.append(parts[0] if not blocks else np.concatenate([*parts, *blocks]))
        if self.host:  # numpy writes; the step's staged arrays (if any) published
            st_host, self.step = self.step, None
            if st_host is not None:
                st_host.flush()
            for meta in metas:
                self._write_host(meta, words)
            return
        st = self.open_step()
        self.step = None
        d_words = st.stage(words)
        staged = [self._scatter_plan(meta, st) for meta in metas]
        st.flush()
        for plan in staged:
            for target, d_dest, d_src in plan:
                target.words.index_copy_(0, d_dest, d_words[d_src])
                self.launches += 2

    def _per_target(self, meta: np.ndarray) -> list[tuple[WordTarget, np.ndarray, np.ndarray]]:
        """Each target of ``meta``'s rows with the word index of every element and of its source."""
        out = []
        for ptr in dict.fromkeys(meta[:, 0].tolist()):
            rows = meta[meta[:, 0] == ptr]
            lens = rows[:, 2]
            within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
            dest, src = np.repeat(rows[:, 1], lens) + within, np.repeat(rows[:, 3], lens) + within
            out.append((self.targets[ptr], dest, src))
        return out

    def _write_host(self, meta: np.ndarray, words: np.ndarray) -> None:
        for target, dest, src in self._per_target(meta):
            flat = target.words_np
            assert flat is not None
            flat[dest] = words[src]

    def _scatter_plan(
        self, meta: np.ndarray, st: Step
    ) -> list[tuple[WordTarget, torch.Tensor, torch.Tensor]]:
        return [(t, st.stage(dest), st.stage(src)) for t, dest, src in self._per_target(meta)]


_Plan = list[tuple[WordTarget, torch.Tensor, torch.Tensor]]
"""Per target: the word index of every element written, and of its source, staged."""

BATCHES: dict[tuple[str, Tier], StepBatch] = {}
"""Every device's batch, per (device, tier)."""


def batch(device: torch.device, tier: Tier) -> StepBatch:
    """The batch of the objects made for ``device`` on ``tier`` (one per process in an engine)."""
    b = BATCHES.get((str(device), tier))
    if b is None:
        b = BATCHES[(str(device), tier)] = StepBatch(device, tier)
    return b
