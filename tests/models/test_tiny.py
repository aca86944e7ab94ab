"""The random checkpoint drawn on a device (`make_tiny_qwen3(device=...)`'s path for GPUs), written and read
back on CPU: transformers and rl_kernel's reference load it with every tensor as drawn."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl_kernel.models.qwen3 import Qwen3Reference, load_hf_state_dict
from rl_kernel.models.tiny import _save_random_on, make_tiny_qwen3


def test_checkpoint_drawn_on_a_device_loads_in_transformers_and_the_reference(tmp_path):
    path = make_tiny_qwen3(tmp_path / "made", num_layers=1, init_std=0.05)
    drawn = tmp_path / "drawn"
    drawn.mkdir()
    from transformers import AutoConfig

    _save_random_on(torch.device("cpu"), AutoConfig.from_pretrained(path), seed=3, dtype=torch.bfloat16, path=drawn)
    tensors = load_file(drawn / "model.safetensors")
    assert set(tensors) == set(load_hf_state_dict(path))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    norms = [t for n, t in tensors.items() if n.endswith("norm.weight")]
    assert norms and all(0.5 <= float(t.min()) and float(t.max()) <= 1.5 for t in norms)
    embed = tensors["model.embed_tokens.weight"].float()
    assert abs(float(embed.std()) - 0.05) < 0.005
    hf = AutoModelForCausalLM.from_pretrained(drawn, dtype=torch.bfloat16)
    assert torch.equal(hf.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    ref = Qwen3Reference.from_pretrained(drawn)
    assert torch.equal(ref.embed, tensors["model.embed_tokens.weight"])
