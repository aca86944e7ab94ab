"""The asynchronous loop's pure logic: per-token lags and their metrics, the staleness bound, which samples
are re-scored, the off-policy corrections, and the config errors of bad input."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vime.config.schema import kept_versions, to_object, validate
from vime.engines import Sample
from vime.errors import ComparabilityError, ConfigError
from vime.loop.async_loop import checked_samples, lag_metrics, sample_kind, stale_groups, token_lags
from vime.trainer.grpo import LossConfig, behaviour_weight, policy_loss


def _sample(group: int, versions: list[int]) -> Sample:
    n = len(versions)
    return Sample(
        group=group,
        prompt_ids=[1, 2],
        response_ids=list(range(3, 3 + n)),
        logprobs=[-1.0] * n,
        versions=versions,
        engine=0,
        temperature=1.0,
    )


def test_lags_and_their_metrics():
    samples = [_sample(0, [3, 3, 4]), _sample(0, [4, 4]), _sample(1, [2])]
    assert token_lags(samples, 4) == [[1, 1, 0], [0, 0], [2]]
    m = lag_metrics(samples, 4, 2)
    assert m["staleness_max"] == 2 and m["staleness_mean"] == pytest.approx(4 / 6)
    assert (m["lag_share_0"], m["lag_share_1"], m["lag_share_2"]) == (0.5, pytest.approx(2 / 6), pytest.approx(1 / 6))
    assert lag_metrics(samples[1:2], 4, 0) == {"staleness_mean": 0.0, "staleness_max": 0, "lag_share_0": 1.0}
    with pytest.raises(ComparabilityError, match="newer than the trainer"):
        token_lags([_sample(0, [5])], 4)


def test_the_bound_takes_whole_groups():
    samples = [_sample(0, [3, 4]), _sample(0, [4]), _sample(1, [4]), _sample(2, [1, 2])]
    assert stale_groups(samples, 4, 1) == {2}
    assert stale_groups(samples, 4, 3) == set()
    assert stale_groups(samples, 4, 0) == {0, 2}
    assert [sample_kind(s, 4) for s in samples] == ["mixed", "fresh", "fresh", "mixed"]
    assert sample_kind(_sample(0, [3, 3]), 4) == "stale"


@given(st.lists(st.sampled_from([3, 4]), min_size=1, max_size=30), st.floats(0.01, 1.0))
def test_checked_samples_cover_all_or_a_seeded_share(versions, share):
    samples = [_sample(i, [v]) for i, v in enumerate(versions)]
    stale = [i for i, v in enumerate(versions) if v == 3]
    assert checked_samples(samples, 4, 1.0, random.Random(0)) == stale
    picked = checked_samples(samples, 4, share, random.Random(0))
    assert set(picked) <= set(stale) and (not stale or len(picked) >= 1)
    assert picked == checked_samples(samples, 4, share, random.Random(0))


def test_corrections_change_the_weight_as_named():
    w = torch.tensor([0.3, 0.9, 1.0, 1.5, 2.5, 7.0])
    tis, t_alt = behaviour_weight(w, LossConfig(correction="tis", is_cap=2.0))
    assert tis.tolist() == pytest.approx([0.3, 0.9, 1.0, 1.5, 2.0, 2.0]) and t_alt.tolist() == [0, 0, 0, 0, 1, 1]
    dec, d_alt = behaviour_weight(w, LossConfig(correction="decoupled", is_cap=2.0))
    assert dec.tolist() == pytest.approx([0.3, 0.9, 1.0, 1.5, 0.0, 0.0]) and d_alt.sum() == 2
    ice, i_alt = behaviour_weight(w, LossConfig(correction="icepop", icepop_low=0.5, icepop_high=2.0))
    assert ice.tolist() == pytest.approx([0.0, 0.9, 1.0, 1.5, 0.0, 0.0]) and i_alt.tolist() == [1, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="does not exist"):
        LossConfig(correction="vtrace")


@pytest.mark.parametrize("correction", ["decoupled", "tis", "icepop"])
def test_at_lag_0_every_correction_is_the_synchronous_loss_in_bits(correction):
    """w = 1.0 exactly when the behaviour logprobs are the trainer's own bits: each correction's loss and
    gradient equal the synchronous (no correction) ones in raw bits."""
    g = torch.Generator().manual_seed(0)
    base = -torch.rand(64, generator=g) * 3
    adv = torch.randn(64, generator=g)
    mask = (torch.rand(64, generator=g) > 0.1).float()
    out = {}
    for name in ("none", correction):
        lp = base.clone().requires_grad_(True)
        loss, m = policy_loss(lp, base.clone(), adv, mask, LossConfig(correction=name))
        loss.backward()
        out[name] = (loss.detach(), lp.grad, m)
    assert torch.equal(out["none"][0].view(torch.int32), out[correction][0].view(torch.int32))
    assert torch.equal(out["none"][1].view(torch.int32), out[correction][1].view(torch.int32))
    m = out[correction][2]
    assert float(m["lag0_ratio_off"]) == 0 and float(m["lag0_tokens"]) == float(mask.sum())
    assert float(m["is_ratio_max"]) == 1.0 and float(m["is_clipped"]) == 0


def test_stale_tokens_are_weighted_and_the_lag0_check_sees_a_wrong_bit():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    behaviour = torch.tensor([-1.0, -2.0 + 1e-3, -3.0])  # token 0 exact, token 1 one step off, token 2 stale
    fresh = torch.tensor([True, True, False])
    loss, m = policy_loss(
        lp, behaviour, torch.ones(3), torch.ones(3), LossConfig(correction="tis", is_cap=2.0), fresh=fresh
    )
    loss.backward()
    assert float(m["lag0_ratio_off"]) == 1 and float(m["lag0_tokens"]) == 2
    assert float(m["is_ratio_max"]) == pytest.approx(torch.exp(torch.tensor(2.5)).item())
    assert float(m["is_clipped"]) == 1  # token 2's w = e^2.5 truncated at 2
    assert lp.grad.tolist() == pytest.approx([-1 / 3, -torch.exp(torch.tensor(-1e-3)).item() / 3, -2 / 3])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.max_staleness=-1"], "algo.max_staleness=-1"),
        (["algo.max_staleness=1"], "without an off-policy correction.*decoupled, tis or icepop"),
        (["rollout.partial=true"], "rollout.partial=true with algo.max_staleness=0"),
        (["algo.max_staleness=1", "algo.correction=vtrace"], "'vtrace' does not exist.*none, decoupled, tis, icepop"),
        (
            ["algo.max_staleness=2", "algo.correction=tis", "trainer.kept_versions=2"],
            "cannot cover algo.max_staleness=2",
        ),
        (["algo.max_staleness=1", "algo.correction=tis", "algo.is_cap=0.5"], "algo.is_cap"),
        (["algo.max_staleness=1", "algo.correction=icepop", "algo.icepop_low=1.5"], "icepop_low"),
        (["algo.max_staleness=1", "algo.correction=tis", "algo.behaviour_check=0"], "behaviour_check"),
        (["algo.max_staleness=1", "algo.correction=tis", "trainer.scoring_pass=true"], "scoring_pass"),
        (
            ["+experiment=h200_vllm", "algo.max_staleness=1", "algo.correction=tis"],
            "rollout.sleep_level=1 with algo.max_staleness=1.*set rollout.sleep_level=0",
        ),
    ],
)
def test_bad_async_settings_get_one_line_errors(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        validate(to_object(compose_cfg(*overrides)))
    assert "\n" not in str(info.value)


def test_kept_versions_live_on_the_trainers_device_unless_host_is_asked(compose_cfg):
    from vime.config.schema import KeptOn

    assert validate(to_object(compose_cfg())).trainer.kept_on == KeptOn.device
    cfg = validate(to_object(compose_cfg("algo.max_staleness=1", "algo.correction=tis", "trainer.kept_on=host")))
    assert cfg.trainer.kept_on == KeptOn.host


def test_kept_versions_default_covers_the_bound(compose_cfg):
    assert kept_versions(validate(to_object(compose_cfg()))) == 0
    cfg = validate(to_object(compose_cfg("algo.max_staleness=2", "algo.correction=icepop")))
    assert kept_versions(cfg) == 3
    cfg = validate(
        to_object(
            compose_cfg(
                "algo.max_staleness=1", "algo.correction=tis", "rollout.partial=true", "trainer.kept_versions=4"
            )
        )
    )
    assert kept_versions(cfg) == 4


def test_the_h200_preset_takes_the_async_loop(compose_cfg):
    cfg = validate(
        to_object(
            compose_cfg(
                "+experiment=h200_8b_layers", "output_dir=/tmp/x", "algo.max_staleness=1", "algo.correction=tis"
            )
        )
    )
    assert cfg.device == "cuda" and cfg.algo.max_staleness == 1 and kept_versions(cfg) == 2
    with pytest.raises(ConfigError, match="weights.transport=ipc on cuda.*no staging buffer.*object_store or gloo"):
        validate(
            to_object(
                compose_cfg(
                    "+experiment=h200_8b_layers",
                    "output_dir=/tmp/x",
                    "algo.max_staleness=1",
                    "algo.correction=tis",
                    "rollout.partial=true",
                )
            )
        )


@pytest.mark.parametrize("transport", ["object_store", "gloo", "auto"])
def test_in_flight_updates_take_either_cpu_weight_path(compose_cfg, transport):
    cfg = validate(
        to_object(
            compose_cfg(
                "algo.max_staleness=1", "algo.correction=tis", "rollout.partial=true", f"weights.transport={transport}"
            )
        )
    )
    assert cfg.rollout.partial and str(cfg.weights.transport) == transport


def test_offpolicy_metrics_have_their_wandb_group():
    from vime.loop.record import StepRecord

    out = StepRecord.from_row(
        {
            "step": 0,
            "staleness_mean": 0.5,
            "lag_share_0": 0.5,
            "lag_share_3": 0.25,
            "is_ratio_max": 1.5,
            "lag0_ratio_off": 0,
            "behaviour_check_rate": 1.0,
        }
    ).wandb()
    offpolicy = {k: v for k, v in out.items() if k.startswith("offpolicy/")}
    assert offpolicy == {
        "offpolicy/staleness_mean": 0.5,
        "offpolicy/lag_share_0": 0.5,
        "offpolicy/lag_share_3": 0.25,
        "offpolicy/is_ratio_max": 1.5,
        "offpolicy/lag0_ratio_off": 0,
        "offpolicy/behaviour_check_rate": 1.0,
    }


def test_the_behaviour_gate_refuses_a_re_score_under_other_versions():
    from vime.engines import Scored
    from vime.loop.async_loop import check_behaviour_comparable

    s = _sample(0, [3, 4])
    good = Scored(
        token_ids=[3, 4],
        positions=[2, 3],
        logprobs=torch.zeros(2),
        version=4,
        temperature=1.0,
        vocab_size=0,
        versions=[3, 4],
    )
    check_behaviour_comparable([s], [good])
    for bad, message in [
        ({"versions": [4, 4]}, "re-scored under versions"),
        ({"positions": [1, 2]}, "positions"),
        ({"token_ids": [3, 5]}, "other token ids"),
        ({"temperature": 0.5}, "temperature"),
    ]:
        with pytest.raises(ComparabilityError, match=message):
            check_behaviour_comparable([s], [Scored(**{**good.__dict__, **bad})])


def test_a_checkpoint_must_hold_what_the_asynchronous_loop_continues_from(compose_cfg, tmp_path):
    """`resume=`: an asynchronous run needs the checkpoint's rollouts in flight, saved at its own bound, and the
    kept versions they are re-scored under; a synchronous run's checkpoint passes unchanged."""
    from vime.state.checkpoint import CheckpointError, check_resumable, kept_path

    lag1 = validate(to_object(compose_cfg("algo.max_staleness=1", "algo.correction=tis")))
    lag2 = validate(to_object(compose_cfg("algo.max_staleness=2", "algo.correction=tis")))
    sync = validate(to_object(compose_cfg()))
    saved = {"version": 3, "async": {"max_staleness": 1, "inflight": {}}}
    for cfg, state, message in [
        (lag1, {"version": 3}, "holds no rollouts in flight.*start a new run"),
        (
            lag2,
            saved,
            "saved by a run with algo.max_staleness=1, this run has "
            "algo.max_staleness=2.*set algo.max_staleness=1 back",
        ),
        (sync, saved, "algo.max_staleness=1, this run has algo.max_staleness=0"),
        (lag1, saved, r"lacks the kept weight versions \[2\]"),
    ]:
        with pytest.raises(CheckpointError, match=message) as info:
            check_resumable(cfg, state, tmp_path)
        assert "\n" not in str(info.value)
    kept_path(tmp_path, 2).parent.mkdir()
    torch.save({}, kept_path(tmp_path, 2))
    check_resumable(lag1, saved, tmp_path)  # version 2 kept beside the checkpoint's own 3
    check_resumable(sync, {"version": 3}, tmp_path)
    check_resumable(lag1, {"version": 0, "async": {"max_staleness": 1, "inflight": {}}}, tmp_path / "none")
