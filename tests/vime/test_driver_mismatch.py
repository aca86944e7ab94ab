"""The driver's own comparison can report a mismatch (CI tier, no engines, no Ray): `Driver.step` runs in this
process over the reference rollout engine and the reference trainer (strict, the same rl_kernel ops on both
sides), once as it is (0 mismatches: the property) and once with one bit of one recorded rollout logprob
flipped (exactly 1 mismatch, located: the wiring from the engines' logprobs to the step's record can fail).
Every end-to-end twin that shows a non-zero count is opt-in; this one is not."""

from __future__ import annotations

import struct
import types
from pathlib import Path

import pytest

from vime.config.schema import RolloutBackend, TrainerBackend, VimeConfig, side_modes
from vime.engines import Sample
from vime.loop import driver as driver_mod
from vime.loop.driver import Driver, correction_fields
from vime.rollout.actor import RolloutWorker
from vime.trainer.actor import TrainerWorker


class _Here:
    """An actor handle whose calls run in this process: `handle.method.remote(*args)` returns the result itself
    (the driver's `call` below passes results through in place of `ray.get`)."""

    def __init__(self, obj: object):
        self._obj = obj

    def __getattr__(self, name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(remote=getattr(self._obj, name))


def _flip_low_bit(x: float) -> float:
    """The fp32 value whose bit pattern differs from fp32 `x` in the lowest mantissa bit."""
    (i,) = struct.unpack("<i", struct.pack("<f", x))
    return struct.unpack("<f", struct.pack("<i", i ^ 1))[0]


class _FlippingRollout(RolloutWorker):
    """The reference rollout engine, recording sample 0's first logprob with its lowest bit flipped."""

    flip = False

    def generate(self, *args, **kwargs) -> tuple[list[Sample], list[dict]]:
        samples, evidence = super().generate(*args, **kwargs)  # the driver asks for the evidence with them
        if self.flip:
            samples[0].logprobs[0] = _flip_low_bit(samples[0].logprobs[0])
        return samples, evidence


def _driver(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch, flip: bool) -> Driver:
    cfg = VimeConfig()
    cfg.rollout.engine, cfg.trainer.engine = RolloutBackend.reference, TrainerBackend.reference
    cfg.algo.prompts_per_step, cfg.algo.group_size, cfg.algo.max_new_tokens = 2, 2, 4
    cfg.data.task = "copy"
    monkeypatch.setattr(driver_mod, "call", lambda refs, what, names: list(refs))
    monkeypatch.setattr("vime.cluster.remote.call", lambda refs, what, names: list(refs))  # restart.each_engine's
    monkeypatch.setattr(driver_mod, "sync_weights", lambda *a, **k: {"sync_s": 0.0})
    d = Driver(cfg, tmp_path)
    rollout = _FlippingRollout(0, cfg.rollout, str(model), "bfloat16", "cpu", side_modes(cfg.rollout.mode, {}), 0)
    rollout.flip = flip
    trainer = TrainerWorker(
        0, 1, cfg.trainer, str(model), "bfloat16", "cpu", side_modes(cfg.trainer.mode, {}), 0, 0.0, 0.2,
        correction_fields(cfg),
    )  # fmt: skip
    trainer.start("")
    d.engines, d.trainer, d.weight_paths = [_Here(rollout)], [_Here(trainer)], ["object_store"]
    d.timeline.acknowledged(0, 0)
    d.model_path = str(model)
    d.load_data()
    d.labels = {"rollout_engine": "reference", "trainer_engine": "reference"}
    return d


def test_the_driver_step_counts_one_flipped_bit(tmp_path, tiny_qwen3_path, monkeypatch):
    same = _driver(tmp_path / "same", tiny_qwen3_path, monkeypatch, flip=False).step(0).consistency
    assert same.tokens > 0 and same.mismatch_count == 0 and same.max_abs_diff == 0.0  # strict: every bit agrees
    flipped = _driver(tmp_path / "flipped", tiny_qwen3_path, monkeypatch, flip=True).step(0).consistency
    assert flipped.tokens == same.tokens
    assert flipped.mismatch_count == 1  # the one flipped bit, found by the driver's own comparison
    assert (flipped.worst_sample, flipped.worst_index) == (0, 0)
    assert 0.0 < flipped.max_abs_diff < 1e-6  # one ulp of a logprob
