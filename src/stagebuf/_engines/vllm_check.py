"""What the vLLM plugin checks of a vLLM release before it patches: the buffer API both ways, and the
order of step mode's window in the release's own ``GPUModelRunner`` source.

The releases are data (:data:`RELEASES`): adding one is one entry, naming the calls its step window
gained after they were read (see docs/DESIGN.md, "vLLM releases").
"""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Release:
    """One tested vLLM release: the calls its step window (``execute_model`` up to ``prepare_inputs``'s
    ``async_tensor_h2d(..., out=...)``) adds to the reviewed set, each read and found to launch no kernel
    that reads a target step mode defers, after that target's write in vLLM's own order."""

    window_added: frozenset[str] = frozenset()
    v1_runner: bool = False
    """Whether ``VLLM_USE_V2_MODEL_RUNNER=0`` selects the V1 model runner (removed in 0.34: vLLM then
    refuses the setting at start-up)."""


_BASE_WINDOW = frozenset(
    {
        # the model runner's own steps (expanded into their bodies where they are GPUModelRunner methods)
        "self.update_pp_decode_requests", "self.finish_requests", "self.free_states", "self.add_requests",
        "self.update_requests", "self.gather_batch_req_state", "self.prepare_inputs", "self._remove_request",
        "self._merge_ec_connector_no_forward", "self.postprocess_sampled",
        # host bookkeeping and staging (deferred in step mode) of MRV2's state objects
        "self.req_states.add_request", "self.req_states.remove_request",
        "self.req_states.apply_staged_writes",
        "self.block_tables.append_block_ids", "self.block_tables.apply_staged_writes",
        "self.model_state.add_request", "self.model_state.remove_request",
        "self.model_state.apply_staged_writes",
        "self.model_state.postprocess_state", "self.sampler.add_request", "self.sampler.apply_staged_writes",
        "self.lora_state.add_request", "self.lora_state.remove_request", "self.encoder_cache.add_request",
        "self.encoder_cache.remove_request", "self.encoder_cache.free_encoder_cache",
        "self.pooling_runner.add_request", "self.pooling_runner.remove_request",
        "self.pooling_runner.on_requests_finished", "self.prompt_logprobs_worker.add_request",
        "self.prompt_logprobs_worker.remove_request", "self.adaptive_verification.add_request",
        "self.adaptive_verification.get_num_tokens", "adaptive_verification.compact_batch",
        "self.pp_handler.get_prev_sampled_outputs", "self.pp_handler.on_req_idx_freed",
        "self.pcp_manager.get_num_tokens_for_dispatch", "self.aux_output_connector.begin_step",
        "self.kv_connector.no_forward", "self.ec_connector.no_forward",
        "ModelRunnerOutput.with_ec_conn_output",
        # device work on memory step mode never defers into: KV blocks, fresh tensors, the padding mask
        "self.kv_block_zeroer.zero_block_ids", "copy_kv_cache_blocks_inplace", "torch.arange", "torch.zeros",
        "is_padding[:num_tokens].fill_", "is_padding[num_tokens:].fill_", "torch.inference_mode",
        # host-only helpers
        "BatchReqState", "dispatch_cg_and_sync_dp", "get_num_active_loras_for_dispatch",
        "get_uniform_decode_token_count", "make_cudagraph_stats", "sort_batch_req_ids", "post_update",
        "draft_tokens.get", "finished_req_ids.union", "scheduler_output.num_scheduled_tokens.keys",
        "scheduler_output.num_scheduled_tokens.values", "is_prefilling_np.any",
        "num_draft_tokens_per_req.sum",
        "(num_scheduled_tokens_np >= num_logits).all", "(prefill_runs_as_decode_np | ~is_prefilling_np).all",
        # the copies step mode itself stages
        "async_tensor_h2d",
    }
)  # fmt: skip

RELEASES: dict[str, Release] = {
    "0.32.0": Release(_BASE_WINDOW, v1_runner=True),
    "0.33.0": Release(
        frozenset({
            "self.encoder_cache.update_encoder_inputs", "scheduler_output.encoder_input_updates.items",
        }),
        v1_runner=True,
    ),
    # draft_tokens_handler's begin_step/discard and the suffix speculator's add_request keep host lists; the
    # speculator's on_requests_finished launches on its own corpus from host values, before any deferred write
    "0.34.0": Release(
        frozenset({
            "self.draft_tokens_handler.begin_step", "self.draft_tokens_handler.discard",
            "self.speculator.add_request", "self.speculator.on_requests_finished",
        })
    ),
}  # fmt: skip
"""The tested vLLM releases, oldest first; the newest is the one the bench compares with."""

TESTED = tuple(RELEASES)
NEWEST = TESTED[-1]
REVIEWED_WINDOW = frozenset().union(*(r.window_added for r in RELEASES.values()))
"""Every call reviewed for step mode's window, over all tested releases."""


def release(version: str | None) -> Release:
    """The table's entry for ``version``; an untested release is taken as the nearest older tested one
    (the newest for one past the table), and None or an unparsable one as the newest."""
    if version in RELEASES:
        return RELEASES[version]
    key = _key(version)
    if key is None:
        return RELEASES[NEWEST]
    older = [r for r in TESTED if (_key(r) or ()) <= key]
    return RELEASES[older[-1] if older else TESTED[0]]


def _key(version: str | None) -> tuple[int, ...] | None:
    parts = (version or "").split("+")[0].split(".")[:3]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        return None


_HOST_ONLY = frozenset(
    {"len", "int", "bool", "max", "min", "sum", "zip", "map", "list", "sorted", "tuple", "set"}
)
"""Builtins: never device work, left out of a window's calls (as are ``np.*`` calls)."""


# --- the buffer API, both ways ----------------------------------------------------------------------

API: dict[str, dict[str, tuple[str, ...]]] = {
    "UvaBuffer": {"__init__": ("size", "dtype"), "uva": ("n",)},
    "NonUvaBuffer": {"__init__": ("size", "dtype"), "uva": ("n",)},
    "UvaBufferPool": {
        "__init__": ("size", "dtype", "max_concurrency"),
        "copy_to_uva": ("x",),
        "copy_to_gpu": ("x", "out"),
        "copy_chunks_to_uva": ("chunks", "n"),
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
"""The call shapes stagebuf takes, as vLLM's tested releases spell them: a method vLLM has must have these
parameters (one a release lacks, such as ``copy_chunks_to_uva`` before 0.34, is no difference)."""

REPLACED = tuple(API)

INTERNAL: dict[str, frozenset[str]] = {
    "StagedWriteTensor": frozenset({"write_contents", "write_cu_lens", "write_indices", "write_starts"}),
    "FusedStagedWriter": frozenset({"contents", "cu_lens", "group_ids", "indices", "starts"}),
}
"""Public attributes of vLLM's classes that are its kernel's staging pools: read only inside vLLM's
``buffer_utils`` (no other module of the tested releases reads them); stagebuf packs edits its own way."""

ACCEPTED_DTYPES = frozenset({torch.int32, torch.int64, torch.float32})
"""The staged-write dtypes of vLLM 0.32 and 0.33 (a literal list in ``StagedWriteTensor.__init__``); 0.34
names them in ``TORCH_DTYPE_TO_ARRAY_TYPECODE``, which the check reads."""


def params_of(obj: Any) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(obj).parameters if p != "self")


def _class_tree(cls: type) -> ast.ClassDef | None:
    """``cls``'s class statement, parsed from the file its methods were compiled from."""
    for v in vars(cls).values():
        code = getattr(getattr(v, "fget", v), "__code__", None)
        if code is None:
            continue
        try:
            tree = ast.parse(Path(code.co_filename).read_text())
        except (OSError, SyntaxError, ValueError):
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                return node
        return None
    return None


def public_names(cls: type) -> set[str]:
    """The public methods, properties and class attributes of ``cls`` (and its bases), and the public
    attributes its methods assign on ``self``, read from its source."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    for c in cls.__mro__:
        if c is object or c.__module__ == "builtins":
            continue
        tree = _class_tree(c)
        if tree is None:
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                continue
            for t in targets:
                for x in ast.walk(t) if t is not None else ():
                    if (
                        isinstance(x, ast.Attribute)
                        and isinstance(x.value, ast.Name)
                        and x.value.id == "self"
                        and not x.attr.startswith("_")
                    ):
                        names.add(x.attr)
    return names


def api_differences(module: Any, mine: dict[str, Any]) -> list[str]:
    """What differs between vLLM's ``module`` and stagebuf's classes ``mine`` (empty: none), both ways:
    a name of :data:`API` vLLM lacks, a method of vLLM's whose parameters are not :data:`API`'s, and a
    public method, attribute or staged-write dtype vLLM has that stagebuf's class lacks."""
    diffs: list[str] = []
    for name, methods in API.items():
        theirs = getattr(module, name, None)
        if theirs is None:
            diffs.append(f"{name} is missing")
            continue
        if not inspect.isclass(theirs):
            got = params_of(theirs)
            if got != methods[""]:
                diffs.append(f"{name}({', '.join(got)}) instead of ({', '.join(methods[''])})")
            continue
        for m, params in methods.items():
            fn = getattr(theirs, m, None)
            if fn is None:
                continue  # stagebuf offers more than this release
            got = params_of(fn)
            if got != params:
                diffs.append(f"{name}.{m}({', '.join(got)}) instead of ({', '.join(params)})")
        lacking = public_names(theirs) - public_names(mine[name]) - INTERNAL.get(name, frozenset())
        diffs += [f"stagebuf's {name} lacks vLLM's {n}" for n in sorted(lacking)]
    dtypes = getattr(module, "TORCH_DTYPE_TO_ARRAY_TYPECODE", None)
    if isinstance(dtypes, dict):
        extra = set(dtypes) - ACCEPTED_DTYPES
        diffs += [f"stagebuf's StagedWriteTensor lacks vLLM's dtype {d}" for d in sorted(map(str, extra))]
    return diffs


# --- step mode's window, read from the release's own model runner ------------------------------------


def window_calls(source: str) -> tuple[list[str], bool]:
    """The calls of ``GPUModelRunner.execute_model`` in ``source``, in source order, up to and including
    the first ``async_tensor_h2d(..., out=...)``, following the runner's own methods into their bodies;
    and whether that closing copy was found. Builtins and ``np.*`` calls are left out."""
    tree = ast.parse(source)
    classes = (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
    cls = next(classes, None)
    if cls is None:
        return [], False
    methods = {m.name: m for m in cls.body if isinstance(m, ast.FunctionDef)}
    calls: list[str] = []
    closed = False

    def visit(fn: ast.FunctionDef, seen: frozenset[str]) -> None:
        nonlocal closed
        nodes = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        nodes.sort(key=lambda n: (n.lineno, n.col_offset))
        for node in nodes:
            if closed:
                return
            name = ast.unparse(node.func)
            if name.endswith("async_tensor_h2d") and any(k.arg == "out" for k in node.keywords):
                calls.append(f"{name}(out=...)")
                closed = True
                return
            if name not in _HOST_ONLY and not name.startswith("np."):
                calls.append(name)
            own = name[5:] if name.startswith("self.") and name.count(".") == 1 else None
            if own in methods and own not in seen:
                visit(methods[own], seen | {own})

    if "execute_model" in methods:
        visit(methods["execute_model"], frozenset({"execute_model"}))
    return calls, closed


def runner_source(runner: Any) -> str | None:
    """The source of the module that defines ``runner.GPUModelRunner`` (its file), or None."""
    cls = getattr(runner, "GPUModelRunner", None)
    mod = sys.modules.get(getattr(cls, "__module__", ""), runner)
    path = getattr(mod, "__file__", None)
    try:
        return Path(path).read_text() if path else inspect.getsource(mod)
    except (OSError, TypeError):
        return None


def window_differences(runner: Any) -> list[str]:
    """Why step mode's window would be wrong on this model runner (empty: its calls are all reviewed)."""
    source = runner_source(runner)
    if source is None:
        return ["the source of GPUModelRunner cannot be read"]
    calls, closed = window_calls(source)
    if not closed:
        return ["execute_model reaches no async_tensor_h2d(..., out=...) (the copy that closes the window)"]
    new = [c for c in dict.fromkeys(calls) if c not in REVIEWED_WINDOW and not c.endswith("(out=...)")]
    return [f"execute_model calls {c} before its inputs are complete, a call not reviewed" for c in new]
