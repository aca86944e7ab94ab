"""Bad MoE inputs fail in one line before any engine starts: top-k beyond the experts (in model.tiny and in a
checkpoint), an MoE option the strict model does not cover, tensor parallelism with MoE layers."""

from __future__ import annotations

import json
import shutil

import pytest

from vime.config.layout import check_model_tp
from vime.config.preflight import check_checkpoint, qwen3_parameters
from vime.config.schema import TinyModelConfig
from vime.errors import ConfigError, DataError


def test_tiny_top_k_beyond_the_experts():
    with pytest.raises(ConfigError, match=r"model.tiny.num_experts_per_tok=9 is outside \[1, num_experts=8\]"):
        TinyModelConfig(num_experts=8, num_experts_per_tok=9)
    TinyModelConfig(num_experts=0, num_experts_per_tok=9)  # dense: the MoE keys are unused


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_experts_per_tok": 12}, r"top-k \(num_experts_per_tok\) = 12 must lie in \[1, num_experts=8\]"),
        ({"shared_expert_intermediate_size": 32}, r"MoE options \['shared_expert_intermediate_size'\]"),
    ],
)
def test_checkpoint_the_strict_moe_model_does_not_cover(tiny_moe_path, tmp_path, changes, match):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_moe_path, bad)
    cfg = json.loads((bad / "config.json").read_text()) | changes
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError, match=match) as err:
        check_checkpoint(bad)
    assert "\n" not in str(err.value)


def test_moe_checkpoint_passes_and_counts_its_experts(tiny_moe_path):
    check_checkpoint(tiny_moe_path)
    cfg = json.loads((tiny_moe_path / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(tiny_moe_path / "model.safetensors"), "pt") as f:
        stored = sum(_n(f, k) for k in f.keys())
    assert qwen3_parameters(cfg) == stored


def _n(f, key: str) -> int:
    n = 1
    for d in f.get_slice(key).get_shape():
        n *= d
    return n


def test_moe_needs_tp_1():
    model = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256, "num_experts": 8}
    with pytest.raises(ConfigError, match="rollout.tp=2 with a Qwen3-MoE model: set rollout.tp=1"):
        check_model_tp(model, 2, "rollout")
    check_model_tp(model, 1, "rollout")
