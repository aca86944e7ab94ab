"""The typed step record: metrics.jsonl's flat row and back without loss, every key declared once."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime.loop.record import StepRecord

ROW = {
    "step": 3,
    "version": 3,
    "next_version": 4,
    "reward_mean": 0.5,
    "tokens": 255,
    "mismatch_count": 0,
    "max_abs_diff": 0.0,
    "mean_abs_diff": 0.0,
    "loss": 1e-9,
    "grad_norm": 0.5,
    "sync_s": 0.1,
    "sync_transports": ["object_store"],
    "staleness_mean": 0.25,
    "staleness_max": 1,
    "lag_share_0": 0.75,
    "lag_share_1": 0.25,
    "rollout_s": 1.0,
    "step_s": 2.0,
    "contracts": {"gemm": "same"},
    "strict": True,
    "engine_restarts": 0,
    "rollout_engine": "vllm",
    "trainer_engine": "megatron",
    "samples": [["a=", "a", 1.0]],
}


def test_a_row_reads_back_into_the_same_row_through_json():
    record = StepRecord.from_row(ROW)
    assert record.consistency.tokens == 255 and record.offpolicy.lag_share == {0: 0.75, 1: 0.25}
    assert record.weights.sync_transports == ["object_store"] and record.timing.step_s == 2.0
    back = json.loads(json.dumps(record.row()))
    assert StepRecord.from_row(back) == record
    assert {k: v for k, v in back.items() if k in ROW} == ROW  # the file keeps every key and value
    assert "score_s" not in back  # a metric the step did not measure stays out of the row


def test_the_parity_metrics_of_a_mismatching_step_are_all_declared():
    import torch

    from vime.loop import consistency

    result = consistency.compare([torch.tensor([-1.0, -2.0])], [torch.tensor([-1.0, -2.5])])
    record = StepRecord.from_row({"step": 0, **result.metrics()})
    assert record.consistency.mismatch_count == 1 and record.consistency.worst_index == 1
    assert record.consistency.worst_trainer == -2.5


def test_an_undeclared_metric_is_refused_by_name():
    with pytest.raises(ValueError, match="'reward_meen' is not a field of vime.loop.record.StepRecord"):
        StepRecord.from_row(ROW | {"reward_meen": 0.5})


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=False, allow_infinity=True, width=32))
def test_non_finite_values_survive_the_json_row(loss, max_abs_diff):
    back = StepRecord.from_row(
        json.loads(json.dumps(StepRecord.from_row(ROW | {"loss": loss, "max_abs_diff": max_abs_diff}).row()))
    )
    assert math.isnan(back.train.loss) if math.isnan(loss) else back.train.loss == loss
    assert back.consistency.max_abs_diff == max_abs_diff


def test_one_builder_makes_the_step_record_of_either_loop():
    from types import SimpleNamespace

    from vime.loop.record import RunFacts, step_record

    samples = [
        SimpleNamespace(group=g, reward=r, prompt_ids=[g], response_ids=[1] * (g + 1))
        for g, r in [(0, 1.0), (0, 0.0), (1, 0.5), (1, 0.5)]
    ]
    run = RunFacts(2, lambda ids: ",".join(map(str, ids)), True, {"rollout_engine": "vllm", "trainer_engine": "mc"})
    measured = {"mismatch_count": 0, "tokens": 6, "sync_bytes": 8.0, "contracts": {"gemm": "same"}}
    rec = step_record(5, (5, 6), samples, (0.0, 1.0, 1.5, 3.5), run, 2, measured)
    r = rec.rollout
    assert (r.reward_mean, r.reward_min, r.reward_max, r.tied_groups, r.correct_frac) == (0.5, 0.0, 1.0, 1, 0.25)
    assert r.reward_std == pytest.approx(math.sqrt(1 / 6)) and r.response_len_mean == 1.5
    assert (rec.weights.version, rec.weights.next_version, rec.weights.sync_bytes) == (5, 6, 8.0)
    assert (rec.timing.rollout_s, rec.timing.score_s, rec.timing.train_s) == (1.0, 0.5, 2.0)
    assert rec.timing.step_s > 3.5 and rec.strict and rec.engine_restarts == 2 and rec.trainer_engine == "mc"
    assert rec.samples == [("1", "1,1", 0.5), ("0", "1", 1.0)]  # from group step mod 2 = 1 onwards
    with pytest.raises(ValueError, match="'sync_byte' is not a field"):
        step_record(5, (5, 6), samples, (0.0, 1.0, 1.5, 3.5), run, 2, {"sync_byte": 8.0})


def test_the_trainers_cuda_memory_metrics_are_declared(monkeypatch):
    """What a CUDA trainer's start and train step add (release_cached_memory) is a field of the record: a key
    it adds that no group declares stops every GPU run at its first step (as on the H200 at 6bfe2d0)."""
    import torch

    from vime.trainer.actor import release_cached_memory

    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 2 * gib)
    measured = release_cached_memory(torch.device("cuda"))
    assert measured, "release_cached_memory reports nothing on CUDA"
    row = StepRecord.from_row({"step": 0, **measured}).row()
    assert {k: row[k] for k in measured} == {"trainer_gpu_peak_gib": 3.0, "trainer_gpu_held_gib": 2.0}
    assert release_cached_memory(torch.device("cpu")) == {}
