"""Checkpoint loading: layouts (per-expert Hub keys, fused v5 3-D experts), shards, dtypes, tied
embeddings, and errors that name the offending tensor. All checkpoints are written by transformers."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_engine.checkpoint import CheckpointError, load_model
from moe_engine.models.decoder import reference_forward

from .hf_checkpoints import make_hf_model, save_hf_checkpoint

IDS = [5, 17, 200, 33, 9, 41, 120, 7, 64, 3, 250, 18]


def keys_of(path: Path) -> dict[str, list[int]]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = list(h.get_slice(k).get_shape())
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """arch -> {"per_expert": dir, "fused": dir, "sharded": dir}, all from the same HF model."""
    out = {}
    for arch in ("mixtral", "qwen2_moe"):
        hf = make_hf_model(arch, seed=7)
        base = tmp_path_factory.mktemp(arch)
        out[arch] = {
            "per_expert": save_hf_checkpoint(hf, base / "per_expert"),
            "fused": save_hf_checkpoint(hf, base / "fused", fused=True),
            "sharded": save_hf_checkpoint(hf, base / "sharded", max_shard_size="60KB"),
        }
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fused_and_per_expert_layouts_load_identically(arch, layouts):
    per_expert, fused = layouts[arch]["per_expert"], layouts[arch]["fused"]
    pk, fk = keys_of(per_expert), keys_of(fused)
    E = 8 if arch == "mixtral" else 60
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    gate_name = "w1" if arch == "mixtral" else "gate_proj"
    # What transformers 5.24 actually writes: Hub per-expert keys by default, fused 3-D with save_original_format=False.
    assert f"model.layers.0.{block}.experts.{E - 1}.{gate_name}.weight" in pk
    assert not any(k.endswith("experts.gate_up_proj") for k in pk)
    gate_up = fk["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up[0] == E and gate_up[2] == 64 and fk["model.layers.0.mlp.experts.down_proj"][:2] == [E, 64]
    assert "model.layers.0.mlp.gate.weight" in fk

    a, b = load_model(per_expert, progress=False), load_model(fused, progress=False)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    la, ra = reference_forward(a, IDS)
    lb, rb = reference_forward(b, IDS)
    assert torch.equal(la, lb) and torch.equal(ra, rb)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_sharded_checkpoint(arch, layouts):
    sharded = layouts[arch]["sharded"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and len(list(sharded.glob("*.safetensors"))) == len(files)
    la, ra = reference_forward(load_model(sharded, progress=False), IDS)
    lb, rb = reference_forward(load_model(layouts[arch]["per_expert"], progress=False), IDS)
    assert torch.equal(la, lb) and torch.equal(ra, rb)


def test_dtypes_and_auto(layouts):
    path = layouts["mixtral"]["per_expert"]  # float32 on disk
    assert load_model(path, progress=False).dtype == torch.float32  # auto = config's dtype
    m16 = load_model(path, dtype="bf16", progress=False)
    assert m16.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    assert load_model(path, dtype=torch.float16, progress=False).dtype == torch.float16
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(path, dtype="int8", progress=False)


def test_bf16_checkpoint_upcast_to_float32(tmp_path):
    hf = make_hf_model("olmoe", seed=1, dtype=torch.bfloat16)
    path = save_hf_checkpoint(hf, tmp_path / "olmoe")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    auto = load_model(path, progress=False)
    assert auto.dtype == torch.bfloat16
    f32 = load_model(path, dtype="float32", progress=False)
    assert torch.equal(f32.model.layers[0].mlp.experts.down_proj, auto.model.layers[0].mlp.experts.down_proj.float())


def test_tied_embeddings(tmp_path):
    hf = make_hf_model("olmoe", seed=2)  # tie_word_embeddings=True
    path = save_hf_checkpoint(hf, tmp_path / "olmoe")
    assert "lm_head.weight" not in keys_of(path)
    model = load_model(path, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


def _rewrite_without(src: Path, dst: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {}
    with safe_open(str(src / "model.safetensors"), "pt") as h:
        for k in h.keys():
            if k == drop:
                continue
            t = h.get_tensor(k)
            tensors[k] = t[:-1].contiguous() if k == reshape else t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_tensor_error_names_key(layouts, tmp_path):
    src = layouts["qwen2_moe"]["per_expert"]
    bad = _rewrite_without(src, tmp_path / "a", drop="model.layers.2.mlp.shared_expert_gate.weight")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.shared_expert_gate\.weight' \(expected shape \[1, 64\]\)"):
        load_model(bad, progress=False)
    bad = _rewrite_without(src, tmp_path / "b", drop="model.layers.0.mlp.experts.17.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.17\.up_proj\.weight.*\[16, 64\]"):
        load_model(bad, progress=False)


def test_misshaped_tensor_error_names_key_and_shapes(layouts, tmp_path):
    bad = _rewrite_without(layouts["mixtral"]["per_expert"], tmp_path / "c", reshape="model.layers.1.block_sparse_moe.gate.weight")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.block_sparse_moe\.gate\.weight'.*shape \[7, 64\], expected \[8, 64\]"):
        load_model(bad, progress=False)


def test_unused_tensors_warn_and_no_weights_error(layouts, tmp_path, caplog):
    src = layouts["mixtral"]["per_expert"]
    extra = _rewrite_without(src, tmp_path / "extra")
    with safe_open(str(extra / "model.safetensors"), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors["model.layers.99.mlp.gate.weight"] = torch.zeros(8, 64)  # e.g. an MTP layer HF also ignores
    save_file(tensors, str(extra / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="moe_engine.checkpoint"):
        load_model(extra, progress=False)
    assert "model.layers.99.mlp.gate.weight" in caplog.text

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((src / "config.json").read_text())
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        load_model(empty, progress=False)


def test_progress_bar_goes_to_stderr(layouts, capsys, monkeypatch):
    import tqdm

    real = tqdm.tqdm
    monkeypatch.setattr(tqdm, "tqdm", lambda *a, **kw: real(*a, **{**kw, "delay": 0}))  # show at once
    load_model(layouts["mixtral"]["per_expert"], progress=True)
    captured = capsys.readouterr()
    assert "Loading" in captured.err and captured.out == ""
