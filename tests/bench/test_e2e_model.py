"""The random-weight Qwen3 folder of the end-to-end benchmark (``benchmarks.e2e_model``), tiny, on the CPU:
nano-vllm's own model and loader take every tensor, the writer is deterministic and reuses a matching
folder, and the engine takes token ids with the config's EOS."""

from __future__ import annotations

import importlib
import json
import math
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

st = pytest.importorskip("safetensors.torch", reason="the model folder's weights are a safetensors file")

from benchmarks import e2e_model as E  # noqa: E402
from benchmarks import nanovllm_pkg as P  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return E.write_model(tmp_path_factory.mktemp("e2e") / "tiny", "tiny", seed=0)


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A gloo group of one: nano-vllm's layers ask ``torch.distributed`` for their rank as they are built."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", world_size=1, rank=0)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _nano() -> P.Nano:
    why = P.available()
    if why:
        pytest.skip(f"needs {P.DIST} {P.VERSION} from the package registry (pip download --no-deps): {why}")
    return P.load()


NANOVLLM_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "attention_bias",
    "hidden_act", "tie_word_embeddings", "torch_dtype",
)  # fmt: skip
"""The config.json fields nano-vllm 20260210 reads (``Config``, ``Qwen3ForCausalLM``, ``ModelRunner``); it
also reads ``rope_scaling``, which must be absent or null."""


def test_config_has_every_field_nanovllm_reads(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg == E.SHAPES["tiny"]
    assert set(NANOVLLM_FIELDS) <= set(cfg)
    assert cfg["rope_scaling"] is None and cfg["attention_bias"] is False and cfg["hidden_act"] == "silu"
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    big = E.SHAPES["qwen3-0.6b"]
    assert {k for k, v in cfg.items() if big[k] != v} <= {
        "bos_token_id", "eos_token_id", "head_dim", "hidden_size", "intermediate_size", "max_window_layers",
        "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "vocab_size",
    }  # fmt: skip


def test_nanovllm_config_reads_the_folder(tiny: Path) -> None:
    nano = _nano()
    c = nano.config.Config(str(tiny))
    assert c.hf_config.vocab_size == 1000 and c.hf_config.num_hidden_layers == 2
    assert c.max_model_len == 4096


def test_nanovllm_load_model_sets_every_parameter_from_the_file(
    tiny: Path, process_group: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _nano()
    qwen3 = importlib.import_module("nanovllm.models.qwen3")
    loader = importlib.import_module("nanovllm.utils.loader")
    # what AutoConfig.from_pretrained gives nano-vllm: config.json's fields as attributes
    hf = types.SimpleNamespace(**json.loads((tiny / "config.json").read_text()))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = qwen3.Qwen3ForCausalLM(hf)
    finally:
        torch.set_default_dtype(default)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    capsys.readouterr()
    loader.load_model(model, str(tiny))
    out = capsys.readouterr().out
    assert "[loader] Warning" not in out, out

    file = st.load_file(str(tiny / E.WEIGHTS))  # read back apart from nano-vllm's loader
    assert set(file) == set(E.parameter_shapes("tiny"))
    used: set[str] = set()

    def take(*names: str) -> torch.Tensor:
        used.update(names)
        return torch.cat([file[n] for n in names])

    for name, p in params.items():
        assert p.dtype == torch.bfloat16 and not p.isnan().any(), f"{name} left unset"
        base = name.removesuffix(".weight")
        if base.endswith("qkv_proj"):
            a = base.removesuffix("qkv_proj")
            want = take(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        elif base.endswith("gate_up_proj"):
            m = base.removesuffix("gate_up_proj")
            want = take(m + "gate_proj.weight", m + "up_proj.weight")
        elif name == "lm_head.weight":
            want = take("model.embed_tokens.weight")  # tied
        else:
            want = take(name)
        assert p.shape == want.shape and torch.equal(p.data, want), name
    assert used == set(file)
    q = E.SHAPES["tiny"]["num_attention_heads"] * E.SHAPES["tiny"]["head_dim"]
    kv = take("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight")
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[q:], kv)


def test_weights_are_bfloat16_with_the_chosen_scales(tiny: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny / E.WEIGHTS), "pt", "cpu") as f:
        assert f.metadata() == {"format": "pt"}
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    assert "lm_head.weight" not in tensors
    for name, shape in E.parameter_shapes("tiny").items():
        t = tensors[name]
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == shape
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t))
        else:
            assert torch.equal(t, E.draw_tensor(name, shape, 0))
    emb = tensors["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - E.INIT_STD) < 0.001 and abs(emb.mean().item()) < 0.001


def test_the_writer_is_deterministic_in_its_seed(tiny: Path, tmp_path: Path) -> None:
    again = E.write_model(tmp_path / "again", "tiny", seed=0)
    for name in ("config.json", E.WEIGHTS, E.MANIFEST):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    other = st.load_file(str(E.write_model(tmp_path / "other", "tiny", seed=1) / E.WEIGHTS))
    same = st.load_file(str(tiny / E.WEIGHTS))
    for name, t in other.items():
        assert torch.equal(t, same[name]) == name.endswith("norm.weight"), name


def test_a_matching_folder_is_reused_and_a_mismatched_one_rewritten(tmp_path: Path) -> None:
    folder = E.write_model(tmp_path / "m", "tiny", seed=3)
    weights = folder / E.WEIGHTS
    first = weights.stat()
    assert E.write_model(folder, "tiny", seed=3) == folder
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    manifest = json.loads((folder / E.MANIFEST).read_text())
    (folder / E.MANIFEST).write_text(json.dumps({**manifest, "seed": 4}))
    E.write_model(folder, "tiny", seed=3)
    assert weights.stat().st_ino != first.st_ino
    assert json.loads((folder / E.MANIFEST).read_text()) == manifest

    second = weights.stat()
    with open(weights, "r+b") as f:  # a cut-short file: its size no longer matches the manifest
        f.truncate(second.st_size - 2)
    E.write_model(folder, "tiny", seed=3)
    assert weights.stat().st_size == second.st_size and weights.stat().st_ino != second.st_ino
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary or replaced folder left

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        E.write_model(foreign, "tiny")
    assert (foreign / "notes.txt").read_text() == "mine"


def test_the_engine_takes_token_ids_and_the_configs_eos(tiny: Path) -> None:
    tok = E.TokenIds(tiny)
    assert tok.eos_token_id == E.SHAPES["tiny"]["eos_token_id"] and tok.decode([5, 17]) == "5 17"
    with pytest.raises(NotImplementedError, match="token ids"):
        tok.encode("some text")


def test_the_0_6b_shape_has_qwen3_0_6b_parameter_count() -> None:
    shapes = E.parameter_shapes("qwen3-0.6b")
    total = sum(math.prod(s) for s in shapes.values())
    embedding = math.prod(shapes["model.embed_tokens.weight"])
    assert total == 596_049_920 and embedding == 151936 * 1024  # Qwen3-0.6B: 0.6B, 0.44B non-embedding
    assert total - embedding == 440_467_456
    assert len(shapes) == 1 + 28 * 11 + 1 and "lm_head.weight" not in shapes
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (2048, 1024)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 1024)
    assert shapes["model.layers.27.mlp.down_proj.weight"] == (1024, 3072)
