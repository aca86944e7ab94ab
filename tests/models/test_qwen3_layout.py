"""The Qwen3 weight-layout table: one vocab-padding rule, shard/unshard per HF name, KV replication."""

from __future__ import annotations

import pytest
import torch

from rl_kernel.models.qwen3 import Qwen3Config
from rl_kernel.models.qwen3_layout import TPShape, check_tp, padded_vocab, weight_layout


def _config(**kw) -> Qwen3Config:
    base = dict(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    return Qwen3Config(**(base | kw))


def test_padded_vocab():
    assert padded_vocab(500, 1) == 512 and padded_vocab(500, 2) == 512 and padded_vocab(500, 8) == 1024
    assert padded_vocab(151936, 1) == 151936 and padded_vocab(512, 2, multiple=1) == 512


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip(tp):
    """Every HF tensor: the ranks' shards reassemble to the same bits; kv heads replicated at tp 4 > 2."""
    config = _config()
    g = torch.Generator().manual_seed(0)
    for name, w in weight_layout(config).items():
        full = torch.randn(w.shape, generator=g)
        shards = [w.shard(full, r, tp) for r in range(tp)]
        assert all(s.shape == shards[0].shape for s in shards), name
        if w.dim is not None:
            assert shards[0].shape[w.dim] == w.local_size(tp), name
        assert torch.equal(w.unshard(shards), full), name
    k = weight_layout(config)["model.layers.0.self_attn.k_proj.weight"]
    full = torch.arange(32.0).repeat_interleave(64).view(32, 64)
    if tp == 4:  # ranks 0, 1 hold kv head 0; ranks 2, 3 kv head 1
        assert [int(k.shard(full, r, 4)[0, 0]) for r in range(4)] == [0, 0, 16, 16]
    vocab = weight_layout(config)["lm_head.weight"]
    last = vocab.shard(torch.ones(500, 64), tp - 1, tp)
    assert last.shape[0] == 512 // tp and not last[500 - 512 :].any()  # zero padding rows at the end


def test_tp_shape_and_checks():
    s = TPShape.of(_config(), 4)
    assert (s.heads, s.kv_heads, s.kv_replicas, s.inter, s.vocab) == (1, 1, 2, 32, 128)
    with pytest.raises(ValueError, match="tp=3 must divide or be a multiple of num_kv_heads=2"):
        check_tp(_config(), 3)
    with pytest.raises(ValueError, match="tp=4 must divide num_kv_heads=2"):
        check_tp(_config(), 4, kv_replication=False)
