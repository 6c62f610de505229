"""End to end: nano-vllm's real ``LLM`` generating tokens, on its own input preparation and on stagebuf's.

nano-vllm-fork runs as released (CUDA graphs) on a Qwen3 with random weights (:mod:`benchmarks.e2e_model`),
attention flash-attn's or a Triton stand-in's (:mod:`benchmarks.e2e_attention`); seeded prompts, near-greedy
sampling and a torch seed per run make equal inputs generate equal tokens. Per workload (:data:`WORKLOADS`),
the setups (:data:`SETUPS`) run back to back on one engine, rotated by round; then, without pinned memory
(:func:`refuse_pinning`), one engine started attached (``stagebuf_nopin``). Per setup and workload: tokens/s,
the step split (host preparation, forward, sampling, the rest) and whether every token equals ``own``'s.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import click
import numpy as np
import torch

from . import nanovllm_pkg as P
from . import report as R
from . import targets as T
from .harness import commit, stagebuf_tier

SETUPS = ("own", "stagebuf_uva", "stagebuf_pinned", "stagebuf_pageable")  # on one engine, rotated by round
NOPIN = "stagebuf_nopin"  # The setup on a machine without pinned memory (a second engine, started attached).
TEMPERATURE = 0.01


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt: tuple[int, int]  # Prompt length range (inclusive), tokens.
    output: tuple[int, int]  # New tokens range (inclusive).
    arrivals_per_step: int = 0  # Requests added before each engine step (0: all at the start).
    shared_prefix: float = 0.0  # The share of prompts behind one of four prefixes of ``prefix_len`` tokens.
    prefix_len: int = 512


WORKLOADS: dict[str, Workload] = {
    "decode": Workload(256, (128, 128), (256, 256)),
    "prefill": Workload(512, (1024, 1024), (4, 4)),
    "mixed": Workload(384, (64, 768), (16, 256), arrivals_per_step=8, shared_prefix=0.5),
}
SMALL: dict[str, Workload] = {
    "decode": Workload(32, (16, 16), (24, 24)),
    "prefill": Workload(32, (300, 300), (2, 2)),
    "mixed": Workload(48, (8, 200), (4, 24), arrivals_per_step=4, shared_prefix=0.5, prefix_len=256),
}  # Sizes for the tiny model (tests; ``--small``).


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_model_len: int = 2048
    max_num_batched_tokens: int = 16384
    gpu_memory_utilization: float = 0.8  # no preemption (nano-vllm 20260210's can fail its scheduler)
    enforce_eager: bool = False


def prompts(w: Workload, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """The workload's prompts (token ids) and output lengths, from ``seed``."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(1, vocab, size=(4, w.prefix_len)).tolist()
    out, lens = [], []
    for _ in range(w.requests):
        n = int(rng.integers(w.prompt[0], w.prompt[1] + 1))
        body = rng.integers(1, vocab, size=n).tolist()
        if w.shared_prefix and rng.random() < w.shared_prefix:
            body = prefixes[int(rng.integers(0, 4))] + body
        out.append(body)
        lens.append(int(rng.integers(w.output[0], w.output[1] + 1)))
    return out, lens


# --- a machine without pinned memory ---------------------------------------------------------------

NO_PIN = "CUDA error: out of memory (simulated: no pinned memory on this machine)"


@contextlib.contextmanager
def refuse_pinning() -> Iterator[None]:
    """In the block, ``pin_memory=True`` and ``Tensor.pin_memory()`` raise, as without pinned memory."""

    def refusing(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def g(*a: Any, pin_memory: bool = False, **k: Any) -> torch.Tensor:
            if pin_memory:
                raise RuntimeError(NO_PIN)
            return f(*a, **k)

        return g

    def pin(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        raise RuntimeError(NO_PIN)

    refused = {n: refusing(getattr(torch, n)) for n in ("tensor", "zeros", "empty")}
    with mock.patch.multiple(torch, **refused), mock.patch.multiple(torch.Tensor, pin_memory=pin):
        yield


# --- timing an engine's steps ----------------------------------------------------------------------


@dataclass
class Step:
    prefill: bool
    tokens: int
    wall_s: float
    prep_s: float
    events: tuple[Any, Any, Any] | None


class Recorder:
    """Times one engine's steps: its ``prepare_*`` on the host, forward and sampling by CUDA events."""

    PREP = ("prepare_prefill", "prepare_decode", "prepare_sample")

    def __init__(self, runner: Any):
        self.steps: list[Step] = []
        self.prep_s, self.events = 0.0, []
        kind = lambda n: "prep" if n in self.PREP else n
        wrapped = {n: self._wrap(getattr(runner, n), kind(n)) for n in (*self.PREP, "run_model", "sampler")}
        self._patch = mock.patch.multiple(runner, **wrapped)

    def __enter__(self) -> Recorder:
        self._patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.stop()

    def _event(self) -> None:
        if torch.cuda.is_available():
            self.events.append(e := torch.cuda.Event(enable_timing=True))
            e.record()

    def _wrap(self, f: Callable[..., Any], kind: str) -> Callable[..., Any]:
        """``f`` timed on the host, or with CUDA events around it (forward) or after it (sampler)."""

        def wrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            if kind == "run_model":
                self._event()
            out = f(*a, **k)
            if kind == "prep":
                self.prep_s += time.perf_counter() - t
            else:
                self._event()
            return out

        return wrapped

    def step(self, engine: Any) -> tuple[list[tuple[int, list[int]]], int]:
        self.prep_s, self.events = 0.0, []
        t = time.perf_counter()
        out, num = engine.step()
        wall = time.perf_counter() - t
        ev = tuple(self.events) if len(self.events) == 3 else None
        self.steps.append(Step(num > 0, abs(num), wall, self.prep_s, ev))  # type: ignore[arg-type]
        return out, num


def parts(steps: list[Step]) -> dict[str, float]:
    """Tokens/s and the mean step split (ms) of some steps; device times read from their events."""
    if not steps:
        return {}
    wall, prep = sum(s.wall_s for s in steps), sum(s.prep_s for s in steps)
    timed = [s.events for s in steps if s.events is not None]
    fwd = sum(e0.elapsed_time(e1) for e0, e1, _ in timed) / 1e3  # s (elapsed_time: ms)
    smp = sum(e1.elapsed_time(e2) for _, e1, e2 in timed) / 1e3
    n, tokens = len(steps), sum(s.tokens for s in steps)
    rates = {"tokens_per_s": tokens / wall if wall else 0.0, "prep_share": prep / wall if wall else 0.0}
    split = {"step": wall, "prep": prep, "forward": fwd, "sample": smp, "rest": wall - prep - fwd - smp}
    return {"steps": n, "tokens": tokens, **rates, **{f"{k}_ms": 1e3 * v / n for k, v in split.items()}}


# --- running an engine -----------------------------------------------------------------------------


def generate(engine: Any, w: Workload, seed: int, vocab: int, rec: Recorder | None) -> tuple[list, float]:
    """The workload on ``engine``: (token ids per request, wall seconds)."""
    nano = P.load()
    ps, lens = prompts(w, vocab, seed)
    torch.manual_seed(seed)
    pending = list(range(len(ps)))
    index: dict[int, int] = {}
    outputs: dict[int, list[int]] = {}
    t = time.perf_counter()
    while pending or not engine.is_finished():
        n = w.arrivals_per_step or len(pending)
        for i in pending[:n]:
            sp = nano.sampling_params.SamplingParams
            engine.add_request(ps[i], sp(temperature=TEMPERATURE, max_tokens=lens[i], ignore_eos=True))
            index[engine.scheduler.waiting[-1].seq_id] = i
        del pending[:n]
        out, _ = rec.step(engine) if rec is not None else engine.step()
        for sid, toks in out:
            outputs[index[sid]] = list(toks)
    wall = time.perf_counter() - t
    return [outputs[i] for i in range(len(ps))], wall


def start(model_dir: Path, cfg: EngineConfig, tokenizer: Any) -> Any:
    """nano-vllm's ``LLM`` on ``model_dir`` (its exit is ours to call: :func:`stop`)."""
    llm = P.load().nanovllm.LLM(str(model_dir), **asdict(cfg), tokenizer=tokenizer)
    atexit.unregister(llm.exit)
    return llm


def stop(llm: Any) -> None:
    llm.exit()
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def as_setup(llm: Any, setup: str) -> Iterator[None]:
    """``llm`` prepared as ``setup`` for the block: own (detached) or attached on the setup's tier."""
    import stagebuf.nanovllm as sn

    if setup == "own":
        sn.detach(llm)
        yield
        return
    with stagebuf_tier(setup.split("_", 1)[1]):
        sn.attach(llm)
        try:
            yield
        finally:
            sn.detach(llm)


def run_one(
    llm: Any, setup: str, name: str, w: Workload, seed: int, vocab: int, rnd: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """Round ``rnd`` of workload ``name`` on ``setup``: its record, and the token ids generated."""
    import stagebuf.nanovllm as sn

    warm = replace(w, requests=min(8, w.requests), output=(2, 2))
    generate(llm, warm, seed + 1, vocab, None)  # the setup's first steps (allocations) out of the timing
    torch.cuda.synchronize()
    with Recorder(llm.model_runner) as rec:
        toks, wall = generate(llm, w, seed, vocab, rec)
        torch.cuda.synchronize()
    tier = (sn.stats(llm) if sn.is_attached(llm) else {}).get("tier")
    steps = lambda prefill: parts([s for s in rec.steps if s.prefill == prefill])
    run = {"setup": setup, "workload": name, "round": rnd, "wall_s": wall, "generated": sum(map(len, toks))}
    return run | {"decode": steps(False), "prefill": steps(True), "identical": None, "tier": tier}, toks


def _said(r: dict[str, Any]) -> str:
    d, p = r["decode"], r["prefill"]
    return (
        f"  {r['setup']:18} {r['workload']:8} round {r['round']}: decode {d.get('tokens_per_s', 0):9.0f} "
        f"tok/s, prefill {p.get('tokens_per_s', 0):9.0f} tok/s, identical={r['identical']}, decode step "
        f"ms {d.get('step_ms', 0):.2f} (prep {d.get('prep_ms', 0):.2f}, forward "
        f"{d.get('forward_ms', 0):.2f}, sample {d.get('sample_ms', 0):.2f})"
    )


def measure(
    model_dir: Path,
    workloads: dict[str, Workload],
    rounds: int,
    seed: int = 0,
    cfg: EngineConfig = EngineConfig(),
    nopin: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every setup's runs (:func:`run_one`'s records) and the no-pin start."""
    import stagebuf
    import stagebuf.nanovllm as sn

    from . import e2e_attention as A
    from . import e2e_model as M

    nano = P.load()
    attention = A.install(sys.modules["nanovllm.layers.attention"])
    nano.config.AutoConfig = P.AutoConfig  # as written (transformers 5's rope_scaling breaks nano-vllm)
    tok = M.TokenIds(model_dir)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    runs: list[dict[str, Any]] = []
    ref: dict[str, list[list[int]]] = {}
    started: dict[str, float] = {}
    blocks: dict[str, int] = {}

    def engine(key: str, setups: Callable[[int], tuple[str, ...]]) -> None:
        """An engine started, every round of every workload on each of its setups, the engine stopped."""
        t0 = time.perf_counter()
        llm = start(model_dir, cfg, tok)
        started[key] = round(time.perf_counter() - t0, 1)
        blocks[key] = llm.model_runner.config.num_kvcache_blocks
        log(f"engine started in {started[key]} s, {blocks[key]} KV-cache blocks; attention: {attention}")
        try:
            for rnd in range(rounds):
                for name, w in workloads.items():
                    for setup in setups(rnd):
                        with as_setup(llm, setup) if setup != NOPIN else contextlib.nullcontext():
                            r, toks = run_one(llm, setup, name, w, seed, vocab, rnd)
                        r["identical"] = toks == ref.setdefault(name, toks)  # the first run: the reference
                        log(_said(r))
                        runs.append(r)
        finally:
            stop(llm)

    # a workload's setups back to back (the GPU's speed drifts over tens of seconds), rotated by round
    engine("own", lambda rnd: SETUPS[rnd % len(SETUPS) :] + SETUPS[: rnd % len(SETUPS)])
    no_pin: dict[str, Any] = {}
    if nopin:
        with refuse_pinning():
            stagebuf.reset_capabilities()
            try:
                stop(start(model_dir, cfg, tok))
                no_pin["own_error"] = None
            except Exception as e:  # the expected outcome: its own buffers are pinned
                no_pin["own_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()
                gc.collect()
                torch.cuda.empty_cache()
            sn.attach(nano.model_runner.ModelRunner)  # started attached, as the README says
            try:
                engine(NOPIN, lambda rnd: (NOPIN,))
            finally:
                sn.detach(nano.model_runner.ModelRunner)
                stagebuf.reset_capabilities()
    return {
        "attention": attention, "engine": asdict(cfg),
        "workloads": {k: asdict(w) for k, w in workloads.items()},
        "rounds": rounds, "seed": seed, "started_s": started, "kv_cache_blocks": blocks, "no_pin": no_pin,
        "runs": runs,
    }  # fmt: skip


# --- the report ------------------------------------------------------------------------------------

GOALS: dict[str, tuple[str, float]] = {  # name: (op, goal)
    "e2e_nanovllm_decode_uva_vs_own": (">=", 1.7), "e2e_nanovllm_decode_pageable_vs_own": (">=", 1.6),
    "e2e_nanovllm_decode_nopin_vs_own": (">=", 1.5), "e2e_nanovllm_prefill_uva_vs_own": (">=", 1.05),
    "e2e_nanovllm_prep_share_uva": ("<=", 0.1), "e2e_nanovllm_tokens_identical": (">=", 1.0),
}  # fmt: skip
WHAT = {
    "e2e_nanovllm_decode_uva_vs_own": "decode tok/s, attached UVA / own",
    "e2e_nanovllm_decode_pageable_vs_own": "decode tok/s, attached PAGEABLE / own with pinned memory",
    "e2e_nanovllm_decode_nopin_vs_own": "decode tok/s, attached on a machine without pinned memory / own "
    "with pinned memory",
    "e2e_nanovllm_prefill_uva_vs_own": "prefill tok/s, attached UVA / own",
    "e2e_nanovllm_prep_share_uva": "attached UVA: input preparation (prepare_decode + prepare_sample) / the "
    "whole decode step",
    "e2e_nanovllm_tokens_identical": "runs whose generated token ids equal the own engine's first round, "
    "every setup (share)",
}
WHY = {
    "e2e_nanovllm_decode_uva_vs_own": "attaching stagebuf gains less decode throughput than claimed: the own "
    "engine's host preparation is a smaller share of its step on this machine",
    "e2e_nanovllm_decode_pageable_vs_own": "without pinned memory the attached engine decodes slower, "
    "relative to the own engine with pinned memory, than claimed",
    "e2e_nanovllm_decode_nopin_vs_own": "on a machine without pinned memory the attached engine decodes "
    "slower than claimed, relative to the own engine where pinning works",
    "e2e_nanovllm_prefill_uva_vs_own": "prefill gains less than claimed from attaching stagebuf",
    "e2e_nanovllm_prep_share_uva": "input preparation is a larger share of the attached decode step than "
    "claimed",
    "e2e_nanovllm_tokens_identical": "a setup generated other token ids than nano-vllm's own engine: its "
    "inputs differ",
}
KEYS = ("tokens_per_s", "step_ms", "prep_ms", "forward_ms", "sample_ms", "rest_ms", "prep_share")


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Medians per setup and workload, and the targets of :data:`GOALS` (``ratios``, the bench's form)."""
    runs = measured["runs"]
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for w in measured["workloads"]:
        table[w] = {}
        for s in (*SETUPS, NOPIN):
            mine = [r for r in runs if r["setup"] == s and r["workload"] == w]
            if not mine:
                continue
            row = table[w][s] = {
                "rounds": len(mine), "identical": all(r["identical"] for r in mine),
                "tier": next((r["tier"] for r in mine if r["tier"]), None),
                "generated_tokens_per_s": statistics.median(r["generated"] / r["wall_s"] for r in mine),
            }  # fmt: skip
            got = {
                f"{k}_{key}": [r[k][key] for r in mine if r[k]] for k in ("decode", "prefill") for key in KEYS
            }
            row |= {k: float(statistics.median(v)) for k, v in got.items() if v}

    row = lambda w, s: table.get(w, {}).get(s, {})
    same = [bool(r["identical"]) for r in runs]

    def ratio(w: str, num: str) -> float | None:
        x, y = (row(w, s).get(f"{w}_tokens_per_s") for s in (num, "own"))
        return x / y if x and y else None

    values = {
        "e2e_nanovllm_decode_uva_vs_own": ratio("decode", "stagebuf_uva"),
        "e2e_nanovllm_decode_pageable_vs_own": ratio("decode", "stagebuf_pageable"),
        "e2e_nanovllm_decode_nopin_vs_own": ratio("decode", NOPIN),
        "e2e_nanovllm_prefill_uva_vs_own": ratio("prefill", "stagebuf_uva"),
        "e2e_nanovllm_prep_share_uva": row("decode", "stagebuf_uva").get("decode_prep_share"),
        "e2e_nanovllm_tokens_identical": sum(same) / len(same) if same else None,
    }  # fmt: skip
    ratios = {}
    for name, (op, goal) in GOALS.items():
        w = "all" if name.endswith("identical") else "prefill" if "prefill" in name else "decode"
        r = ratios[name] = T.target(WHAT[name], f"e2e {w}", values[name], op, goal, why=WHY[name])
        r["status"] = T.status(r)
        r.pop("skipped", None)
    return {
        "table": table,
        "ratios": ratios,
        "own_decode_prep_share": row("decode", "own").get("decode_prep_share"),
        "own_fails_without_pinning": measured.get("no_pin", {}).get("own_error"),
    }


PATH = click.Path(path_type=Path)


@click.command("e2e")
@click.option("--shape", default="qwen3-0.6b", show_default=True, help="The model (e2e_model.SHAPES).")
@click.option("--small", is_flag=True, help="The small workloads (for the tiny shape).")
@click.option("--workload", "names", multiple=True, type=click.Choice(list(WORKLOADS)), help="Only these.")
@click.option("--rounds", type=click.IntRange(1, 50), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-nopin", is_flag=True, help="Leave out the machine without pinned memory.")
@click.option("--json", "json_path", type=PATH)
@click.option("--markdown", "md_path", type=PATH)
@click.option("--plot", "plot_path", type=PATH)
@click.option("--from-json", type=click.Path(exists=True, path_type=Path), help="Render an earlier report.")
def main(
    shape: str,
    small: bool,
    names: tuple[str, ...],
    rounds: int,
    seed: int,
    no_nopin: bool,
    json_path: Path | None,
    md_path: Path | None,
    plot_path: Path | None,
    from_json: Path | None,
) -> None:
    """nano-vllm's real engine generating tokens, on its own input preparation and on stagebuf's."""
    from . import e2e_model as M
    from .bench import command_line
    from .fetch import cache_root

    if from_json is not None:
        report = json.loads(from_json.read_text())
    else:
        if not torch.cuda.is_available():
            raise click.UsageError("the end-to-end workload runs nano-vllm's engine: it needs a CUDA device")
        if P.available():
            raise click.UsageError(f"nano-vllm-fork {P.VERSION} is not available here: {P.available()}")
        workloads = {k: v for k, v in (SMALL if small else WORKLOADS).items() if not names or k in names}
        folder = M.write_model(cache_root() / f"model-{shape}-{seed}", shape, seed)
        t = time.perf_counter()
        measured = measure(folder, workloads, rounds, seed, nopin=not no_nopin)
        report = {
            "command": command_line().replace("-m benchmarks ", "-m benchmarks.e2e ", 1), "commit": commit(),
            "nanovllm": f"{P.DIST} {P.VERSION}", "device_name": torch.cuda.get_device_name(),
            "versions": {"torch": torch.__version__, "python": sys.version.split()[0]}, "shape": shape,
            "measured": measured, "elapsed_s": round(time.perf_counter() - t, 1),
        }  # fmt: skip
        report["summary"] = summarize(measured)
    text = R.e2e_markdown(report)
    print(text.rstrip("\n"), *(f"missed: {line}" for line in T.misses(report["summary"])), sep="\n")
    print(T.verdict(report["summary"], strict=False))
    if json_path:
        json_path.write_text(json.dumps(report, indent=1) + "\n")
    if md_path:
        md_path.write_text(text)
    if plot_path:
        R.e2e_plot(report, plot_path)


if __name__ == "__main__":
    main(prog_name="python -m benchmarks.e2e")
