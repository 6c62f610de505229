"""A Qwen3 model folder for nano-vllm's end-to-end run, written at run time with random weights.

``write_model(folder, shape, seed)`` writes ``config.json`` (Qwen3-0.6B's, or the same architecture tiny) and
``model.safetensors``: each tensor drawn from a generator seeded by the seed and its name (the host path needs
the model's shapes and cost, not its answers), reused where its manifest matches. Its tokenizer is
:class:`TokenIds` (the run hands the engine token ids).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .fetch import put

WRITER_VERSION = 4  # Bumped whenever the files written for a (shape, seed) change.
INIT_STD = 0.02  # The std of every linear and embedding weight (Qwen3's ``initializer_range``); norms are 1.
MANIFEST = "stagebuf-model.json"
WEIGHTS = "model.safetensors"

_QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _QWEN3_0_6B,
    "tiny": {**_QWEN3_0_6B, "bos_token_id": 998, "eos_token_id": 999, "head_dim": 16, "hidden_size": 64,
             "intermediate_size": 128, "max_window_layers": 2, "num_attention_heads": 4,
             "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 1000},
}  # fmt: skip


def parameter_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``model.safetensors`` for ``shape``, by its Hugging Face name, in file order."""
    c = SHAPES[shape]
    if c.get("attention_bias"):
        raise ValueError(f"shape {shape!r}: attention_bias is not written (Qwen3 has none)")
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    layer = (
        ("input_layernorm", (hidden,)),
        ("self_attn.q_proj", (q, hidden)),
        ("self_attn.k_proj", (kv, hidden)),
        ("self_attn.v_proj", (kv, hidden)),
        ("self_attn.o_proj", (hidden, q)),
        ("self_attn.q_norm", (head,)),
        ("self_attn.k_norm", (head,)),
        ("post_attention_layernorm", (hidden,)),
        ("mlp.gate_proj", (inter, hidden)),
        ("mlp.up_proj", (inter, hidden)),
        ("mlp.down_proj", (hidden, inter)),
    )
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        out |= {f"model.layers.{i}.{name}.weight": s for name, s in layer}
    out["model.norm.weight"] = (hidden,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (vocab, hidden)
    return out


# --- the weights ----------------------------------------------------------------------------------


def draw_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One bfloat16 tensor: RMSNorm weights 1, others normal (``INIT_STD``) seeded by seed and name."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    digest = hashlib.sha256(f"stagebuf-e2e-model/{seed}/{name}".encode()).digest()
    g = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(shape, generator=g, dtype=torch.float32).mul_(INIT_STD).to(torch.bfloat16)


class TokenIds:
    """What nano-vllm's ``LLMEngine`` uses of a tokenizer when it is handed token ids."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.eos_token_id: int = json.loads((Path(folder) / "config.json").read_text())["eos_token_id"]

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("the end-to-end run hands nano-vllm token ids, not text")

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


# --- the folder -----------------------------------------------------------------------------------


def _matches(folder: Path, want: dict[str, Any]) -> bool:
    try:  # (a manifest that is not a dict, or whose files are not, is no match)
        have = json.loads((folder / MANIFEST).read_text())
        files = have.get("files") or {}
        sizes = all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, AttributeError):
        return False
    return {k: have.get(k) for k in want} == want and WEIGHTS in files and sizes


def write_model(folder: str | os.PathLike[str], shape: str = "qwen3-0.6b", seed: int = 0) -> Path:
    """The model folder: reused where its manifest matches, else written (a foreign one raises)."""
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    folder = Path(folder)
    want = {"writer": WRITER_VERSION, "shape": shape, "seed": seed, "config": SHAPES[shape]}
    if _matches(folder, want):
        return folder
    if folder.exists() and any(folder.iterdir()) and not (folder / MANIFEST).exists():
        raise FileExistsError(f"{folder} exists and is not a model folder written here (no {MANIFEST})")

    def fill(tmp: Path) -> None:
        c = SHAPES[shape]
        (tmp / "config.json").write_text(json.dumps(c, indent=2) + "\n")
        from safetensors.torch import save_file  # every tensor drawn (1.2 GB at 0.6B), then written

        weights = {name: draw_tensor(name, s, seed) for name, s in parameter_shapes(shape).items()}
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps({**want, "files": files}, indent=2) + "\n")

    return put(folder, fill)
