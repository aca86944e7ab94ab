"""`consistency/routing_mismatch`: the share of (token, MoE layer) routes whose expert set differs between the
rollout and the trainer, over the positions both recorded; and the vLLM route records mapped to requests."""

from __future__ import annotations

import pytest
import torch

from rl_kernel.integrations.vllm.routes import routes_of
from vime.engines import Sample, Scored
from vime.errors import ComparabilityError
from vime.loop.consistency import routing_agreement


def _pair(rollout_routes, trainer_routes):
    s = Sample(0, [1, 2, 3], [4, 5], [-1.0, -1.0], [0, 0], 0, 1.0, routes=rollout_routes)
    t = Scored([4, 5], [3, 4], torch.zeros(2), 0, 1.0, 512, routes=trainer_routes)
    return s, t


def test_equal_routes_agree_and_one_differing_layer_counts_once():
    trainer = torch.tensor([[[0, 1], [2, 3]], [[1, 5], [0, 7]], [[3, 4], [4, 6]], [[0, 2], [1, 2]], [[5, 6], [6, 7]]])
    rollout = trainer[:4].clone()  # the last token is never fed to the rollout
    s, t = _pair(rollout, trainer)
    assert routing_agreement([s], [t]) == {"routing_mismatch": 0.0, "routes_compared": 8, "routing_mismatch_count": 0}
    rollout[2, 1] = torch.tensor([4, 7])  # another expert set at position 2, layer 1
    rollout[0] = -1  # position 0 a prefix-cache hit: not compared
    s, t = _pair(rollout, trainer)
    assert routing_agreement([s], [t]) == {"routing_mismatch": 1 / 6, "routes_compared": 6, "routing_mismatch_count": 1}


def test_no_routes_is_not_measured_and_other_models_are_errors():
    s, t = _pair(None, None)
    assert routing_agreement([s], [t]) is None
    s, t = _pair(torch.zeros(4, 2, 2, dtype=torch.int16), torch.zeros(5, 3, 2, dtype=torch.int16))
    with pytest.raises(ComparabilityError, match=r"rollout routes \(4, 2, 2\) vs trainer routes \(5, 3, 2\)"):
        routing_agreement([s], [t])


def test_vllm_records_map_to_the_request_and_its_positions():
    records = {
        "7-0a1b2c3d": {"positions": [2, 0, 1], "experts": [[[1, 2]], [[0, 3]], [[4, 5]]]},
        "17-99999999": {"positions": [0], "experts": [[[6, 7]]]},
    }
    got = routes_of(records, "7", 4)
    assert got.dtype == torch.int16 and got.shape == (4, 1, 2)
    assert got[:, 0].tolist() == [[0, 3], [4, 5], [1, 2], [-1, -1]]  # position 3: not computed by this request
    assert routes_of(records, "1", 4) is None
