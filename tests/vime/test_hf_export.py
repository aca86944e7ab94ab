"""The final-weights export (`vime.state.checkpoint.export_hf`) is a Hugging Face checkpoint: one
`model.safetensors`, or shards with `model.safetensors.index.json` above the shard size. transformers
loads it with every weight's bits and the same logits, and vLLM's weight loader picks the same files and
reads the same bits (its file selection and safetensors reader, without starting an engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_kernel.bits import same_bits
from vime.state.checkpoint import HF_DIR, export_hf, hf_exported


def _source(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def sharded(tiny_qwen3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny checkpoint's tensors exported in shards of at most a third of their bytes."""
    tensors = _source(tiny_qwen3_path)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    out = export_hf(tensors, str(tiny_qwen3_path), tmp_path_factory.mktemp("run"), max_shard_size=size // 3)
    return out, tensors


def test_a_small_export_is_one_file(tiny_qwen3_path, tmp_path):
    tensors = _source(tiny_qwen3_path)
    out = export_hf(tensors, str(tiny_qwen3_path), tmp_path)
    assert out == tmp_path / HF_DIR and hf_exported(tmp_path)
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == tensors.keys() and all(same_bits(loaded[k], t) for k, t in tensors.items())
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_a_large_export_is_sharded_with_an_index(sharded):
    out, tensors = sharded
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists() and hf_exported(out.parent)
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(shards)
    loaded = {k: t for name in shards for k, t in load_file(str(out / name)).items()}
    assert loaded.keys() == tensors.keys() and all(same_bits(loaded[k], t) for k, t in tensors.items())


def test_transformers_loads_the_sharded_export_bit_for_bit(sharded, tiny_qwen3_path):
    from transformers import AutoModelForCausalLM

    out, tensors = sharded
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    source = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.bfloat16)
    params = exported.state_dict()
    assert all(same_bits(params[k], t) for k, t in tensors.items())
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        assert same_bits(exported(ids).logits, source(ids).logits)


def test_vllms_loader_reads_the_sharded_export_bit_for_bit(sharded):
    pytest.importorskip("vllm")
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    out, tensors = sharded
    _, files, use_safetensors, _ = DefaultModelLoader(LoadConfig())._prepare_weights(str(out), None, None, False, None)
    assert use_safetensors and sorted(Path(f).name for f in files) == sorted(p.name for p in out.glob("model-*"))
    loaded = dict(safetensors_weights_iterator(files, use_tqdm_on_load=False))
    assert loaded.keys() == tensors.keys() and all(same_bits(loaded[k], t) for k, t in tensors.items())
