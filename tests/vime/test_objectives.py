"""The RL objectives against hand-computed references on small tensors: advantage estimators, KL estimators,
loss aggregations (and their micro-batch sums), GSPO, clip-higher, dual clip, mini-batches / PPO epochs,
dynamic sampling's group selection, and the start-up checks of their settings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vime.config.schema import AlgoConfig, loss_fields, to_object, validate
from vime.engines import Sample
from vime.errors import ConfigError
from vime.loop import sampling
from vime.trainer.advantages import advantages
from vime.trainer.grpo import LossConfig, TrainBatch, policy_loss, score, train_step
from vime.trainer.losses import aggregation, kl_penalty, local_seq_mean

rewards_st = st.integers(1, 4).flatmap(
    lambda g: st.lists(
        st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=g + 1, max_size=g + 1), min_size=1, max_size=4
    )
)


# ---- advantages ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(rewards_st)
def test_advantage_estimators_match_their_definitions(rows):
    r = torch.tensor(rows, dtype=torch.float64)
    g = r.shape[1]
    for name in ("grpo", "drgrpo", "rloo"):
        adv = advantages(r, name, eps=1e-6)
        for i, row in enumerate(rows):
            m = sum(row) / g
            std = math.sqrt(sum((x - m) ** 2 for x in row) / (g - 1))
            for j, x in enumerate(row):
                others = (sum(row) - x) / (g - 1)
                want = {"grpo": (x - m) / (std + 1e-6), "drgrpo": x - m, "rloo": x - others}[name]
                if max(row) == min(row):
                    assert adv[i, j].item() == 0.0  # exactly: a tied group carries no signal
                else:
                    assert adv[i, j].item() == pytest.approx(want, rel=1e-5, abs=1e-6), (name, row)
    b = [x - sum(row) / g if max(row) != min(row) else 0.0 for row in rows for x in row]
    pp = advantages(r, "reinforce_pp", eps=1e-6).flatten().tolist()
    if max(b) == min(b):
        assert pp == [0.0] * len(b)
    else:
        mb = sum(b) / len(b)
        sb = math.sqrt(sum((x - mb) ** 2 for x in b) / (len(b) - 1))
        assert pp == pytest.approx([(x - mb) / (sb + 1e-6) for x in b], rel=1e-5, abs=1e-6)


def test_rloo_is_the_scaled_drgrpo_and_unknown_estimators_are_refused():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert advantages(r, "rloo")[0].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert advantages(r, "drgrpo")[0].tolist() == [0.75, -0.25, -0.25, -0.25]
    with pytest.raises(ValueError, match="adv_estimator 'ppo' does not exist"):
        advantages(r, "ppo")


def test_assign_advantages_takes_the_rewards_in_fp32_as_grpo_always_did():
    rewards = [0.1, 0.7, 0.2, 0.9, 0.35, 0.6]  # not fp32-exact
    samples = [_sample(i // 3, x) for i, x in enumerate(rewards)]
    sampling.assign_advantages(samples, AlgoConfig(group_size=3))
    assert [s.advantage for s in samples] == advantages(torch.tensor(rewards).reshape(2, 3)).flatten().tolist()
    fp64 = advantages(torch.tensor(rewards, dtype=torch.float64).reshape(2, 3)).flatten().tolist()
    assert [s.advantage for s in samples] != fp64  # the twin: the rewards' dtype shows in the bits


def test_assign_advantages_subtracts_the_kl_penalty_first():
    samples = [_sample(0, 1.0), _sample(0, 1.0)]
    sampling.assign_advantages(samples, AlgoConfig(group_size=2, adv_estimator="drgrpo", kl_coef=0.5), [0.0, 2.0])
    assert [s.advantage for s in samples] == [0.5, -0.5]  # rewards 1.0 and 1.0 - 0.5 x 2.0


# ---- KL and aggregation ------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    d = ref - lp  # -0.5, 1.0, 0
    assert torch.allclose(kl_penalty(lp, ref, "k1"), -d)
    assert torch.allclose(kl_penalty(lp, ref, "k2"), 0.5 * d * d)
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.exp(d) - d - 1)
    assert torch.equal(kl_penalty(lp, ref, "low_var_kl"), kl_penalty(lp, ref, "k3"))
    far = kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl")
    assert far.item() == 10.0 and kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() > 1e12
    with pytest.raises(ValueError, match="kl_estimator 'k4'"):
        kl_penalty(lp, ref, "k4")


def test_aggregations_by_hand():
    # two sequences: terms [1, 2, 3] and [4]
    terms = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ids = torch.tensor([0, 0, 0, 1])
    want = {
        "token_mean": 10 / 4,
        "seq_mean_token_mean": (2.0 + 4.0) / 2,
        "seq_mean_token_sum": (6.0 + 4.0) / 2,
        "seq_mean_token_sum_norm": (6.0 + 4.0) / 2 / 8,
    }
    for agg, value in want.items():
        scale, denom = aggregation([3, 1], agg, 8)
        per_token = torch.tensor(scale)[ids]
        assert float((terms * per_token).sum() / denom) == pytest.approx(value), agg
    with pytest.raises(ValueError, match="constant normaliser"):
        aggregation([3, 1], "seq_mean_token_sum_norm", None)


# ---- the policy loss ---------------------------------------------------------------------------------


def test_dual_clip_bounds_negative_advantage_terms():
    lp = torch.tensor([0.0, 0.0, 0.0])
    old = torch.tensor([-3.0, -3.0, 0.0])  # ratios e^3 = 20.1, e^3, 1
    adv = torch.tensor([-1.0, 1.0, -1.0])
    loss, _ = policy_loss(lp, old, adv, torch.ones(3), LossConfig(clip_c=3.0), normalizer=1.0)
    # token 0: max(20.1, 1.2) = 20.1 bounded by 3; token 1: max(-20.1, -1.2) = -1.2; token 2: 1
    assert float(loss) == pytest.approx(3.0 - 1.2 + 1.0)
    plain, _ = policy_loss(lp, old, adv, torch.ones(3), LossConfig(), normalizer=1.0)
    assert float(plain) == pytest.approx(math.exp(3.0) - 1.2 + 1.0)  # the twin: unbounded without clip_c


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=4),
    st.integers(0, 2**16),
    st.sampled_from([1e-3, 0.2]),
)
def test_gspo_token_form_has_the_sequence_objectives_value_and_gradient(lengths, seed, clip):
    """The token form sg[s_i] * exp(logp - sg[logp]) with seq_mean_token_mean equals GSPO's sequence-level
    objective (1/B) sum_i max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean_t(logp - old)), in value and gradient."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    lp0 = -torch.rand(n, generator=g, dtype=torch.float64)
    old = lp0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    seq_adv = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    cfg = LossConfig(policy_loss="gspo", gspo_clip_low=clip, gspo_clip_high=clip)
    scale, denom = aggregation(lengths, "seq_mean_token_mean")
    lp = lp0.clone().requires_grad_(True)
    loss, _ = policy_loss(
        lp, old, seq_adv[ids], torch.ones(n, dtype=torch.float64), cfg, None, denom,
        scale=torch.tensor(scale, dtype=torch.float64)[ids], seq_mean=local_seq_mean(ids),
    )  # fmt: skip
    loss.backward()
    direct_lp = lp0.clone().requires_grad_(True)
    terms = []
    for i in range(len(lengths)):
        s = torch.exp((direct_lp[ids == i] - old[ids == i]).mean())
        a = seq_adv[i]
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - clip, 1 + clip)))
    direct = torch.stack(terms).mean()
    direct.backward()
    assert float(loss.detach()) == pytest.approx(float(direct.detach()), rel=1e-9, abs=1e-12)
    assert torch.allclose(lp.grad, direct_lp.grad, rtol=1e-9, atol=1e-12)


def test_gspo_ratio_is_one_on_policy_and_its_correction_weight_is_the_sequences():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ids = torch.tensor([0, 0, 1])
    mu = torch.tensor([-1.5, -1.5, -0.5])  # prox / mu per token: e^0.5, e^-0.5, 1; sequence 0's mean log 0
    cfg = LossConfig(policy_loss="gspo", correction="tis", is_cap=2.0)
    loss, m = policy_loss(lp, mu, torch.tensor([1.0, 1.0, -1.0]), torch.ones(3), cfg, seq_mean=local_seq_mean(ids))
    assert int(m["ratio_off"]) == 0  # the proximal ratio is exactly 1 (the step's first update)
    assert float(loss) == pytest.approx((-1.0 - 1.0 + 1.0) / 3)  # sequence weights exp(0) = 1 and 1
    ppo, _ = policy_loss(lp, mu, torch.tensor([1.0, 1.0, -1.0]), torch.ones(3), LossConfig(correction="tis"))
    assert float(ppo) == pytest.approx((-math.exp(0.5) - math.exp(-0.5) + 1.0) / 3)  # per-token weights
    with pytest.raises(ValueError, match="needs seq_mean"):
        policy_loss(lp, mu, torch.ones(3), torch.ones(3), LossConfig(policy_loss="gspo"))


# ---- the training step over a toy policy --------------------------------------------------------------


class ToyPolicy:
    """A differentiable bigram policy (logits = table[previous token]) with SGD: the `PolicyModel` interface
    over one process, for the step's pure logic."""

    def __init__(self, vocab: int = 8, seed: int = 0, lr: float = 0.5):
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
        self.lr = lr

    def forward_logprobs(self, ids, cu_seqlens, targets, temps, rows, entropy=False):
        logits = self.table[ids[rows]] / temps[rows].to(self.table.dtype).unsqueeze(1)  # fp32, as the engines
        full = torch.log_softmax(logits, dim=-1)
        lp = full.gather(1, targets[rows].unsqueeze(1)).squeeze(1)
        return (lp, rows, -(full.exp() * full).sum(-1)) if entropy else (lp, rows)

    def gather_logprobs(self, values, index, cu_seqlens):
        full = torch.zeros(int(cu_seqlens[-1]), dtype=torch.float32)
        full[index] = values.detach().float()
        return full

    def zero_grad(self):
        self.table.grad = None

    def reduce_metrics(self, sums, maxes):
        return sums | maxes

    def optimizer_step(self):
        norm = float(self.table.grad.norm())
        with torch.no_grad():
            self.table -= self.lr * self.table.grad
        return norm


SEQS = [[1, 2, 3, 4], [1, 5, 6], [2, 2, 7, 1, 3], [3, 4]]
PROMPTS = [1, 1, 2, 1]


def _batch(model: ToyPolicy, keep: bool = True, perturb: float = 0.0) -> TrainBatch:
    old = score(model, SEQS, PROMPTS)
    return TrainBatch(SEQS, PROMPTS, [1.0, -0.5, 0.25, -1.0], [o + perturb for o in old], keep_logprobs=keep)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_micro_batches_sum_to_the_batch_value_for_every_aggregation(agg, loss):
    cfg = LossConfig(loss_agg=agg, loss_norm_tokens=4, policy_loss=loss, kl_coef=0.1)
    results, grads = [], []
    for mbs in (None, 1, 3):
        model = ToyPolicy(lr=0.0)
        batch = _batch(model)
        batch.ref_logprobs = [o - 0.1 for o in batch.old_logprobs]
        results.append(train_step(model, batch, cfg, micro_batch_size=mbs))
        grads.append(model.table.grad.clone())
    lengths = [len(s) - p for s, p in zip(SEQS, PROMPTS)]
    scale, denom = aggregation(lengths, agg, 4)
    k3 = math.exp(-0.1) + 0.1 - 1
    want = sum(scale[i] * lengths[i] * (-a + 0.1 * k3) for i, a in enumerate([1.0, -0.5, 0.25, -1.0])) / denom
    for r, g in zip(results, grads):
        assert r["loss"] == pytest.approx(want, rel=1e-5)  # ratio exactly 1: the terms are -A (+ the KL)
        assert torch.allclose(g, grads[0], rtol=1e-5, atol=1e-7)
        assert r["mismatch_count"] == 0 and r["first_ratio_off"] == 0 and r["updates"] == 1


def test_mini_batches_and_epochs_update_several_times_from_the_rollout_logprobs():
    model = ToyPolicy()
    batch = _batch(model)
    start = [t.clone() for t in batch.old_logprobs]
    r = train_step(model, batch, LossConfig(mini_batches=2, ppo_epochs=2), micro_batch_size=1)
    assert r["updates"] == 4 and r["first_ratio_off"] == 0 and r["mismatch_count"] == 0
    assert all(torch.equal(a, b) for a, b in zip(r["logprobs"], start))  # the step's first forward
    assert r["lag0_tokens"] == sum(len(s) - p for s, p in zip(SEQS, PROMPTS))  # each token counted once
    assert r["ratio_mean"] != 1.0  # the later updates see moved weights
    after = score(model, SEQS, PROMPTS)
    assert any(not torch.equal(a, b) for a, b in zip(after, start))
    # the twin: logprobs that are not the trainer's own give a ratio off 1 on every token of the first update
    model = ToyPolicy()
    r = train_step(model, _batch(model, perturb=1e-3), LossConfig(mini_batches=2), micro_batch_size=2)
    first = sum(len(s) - p for s, p in zip(SEQS[:2], PROMPTS[:2]))
    assert r["first_ratio_off"] == first and r["mismatch_count"] == sum(len(s) - p for s, p in zip(SEQS, PROMPTS))


def test_correction_with_mini_batches_takes_the_step_start_as_the_proximal_policy():
    model = ToyPolicy()
    batch = _batch(model, perturb=-0.2)  # a stale behaviour policy: w = e^0.2 on every token
    r = train_step(model, batch, LossConfig(correction="tis", is_cap=2.0, mini_batches=2, ppo_epochs=2))
    assert r["is_ratio_mean"] == pytest.approx(math.exp(0.2), rel=1e-5) and r["first_ratio_off"] == 0
    assert r["ratio_mean"] != 1.0  # later updates: the ratio against the step-start policy moves


# ---- dynamic sampling --------------------------------------------------------------------------------


def _sample(group: int, reward: float) -> Sample:
    return Sample(group, [1], [2], [-0.1], [0], 0, 1.0, reward=reward)


def _rollout(per_batch: dict[int, list[list[float]]]):
    """A fake `Driver.generate`: batch b's groups have rewards per_batch[b]; prompts are (b, g)."""

    def generate(b: int):
        rewards = per_batch[b]
        return [(b, g) for g in range(len(rewards))], [_sample(g, x) for g, row in enumerate(rewards) for x in row], []

    return generate


def test_dynamic_sampling_drops_tied_groups_and_samples_more_batches():
    algo = AlgoConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True, max_sample_rounds=3)
    per_batch = {5: [[1, 1], [0, 1]], 6: [[0, 0], [0, 0]], 7: [[1, 0], [0, 1]]}
    got = sampling.sample_step(_rollout(per_batch), 5, algo)
    assert got.rounds == 3 and got.prompts == [(5, 1), (7, 0)]  # the surplus group (7, 1) is discarded
    assert got.dropped == 3 and [s.group for s in got.samples] == [0, 0, 1, 1]
    assert [s.reward for s in got.samples] == [0, 1, 1, 0]
    # the twin: without dynamic sampling the first batch is the step, ties and all
    plain = sampling.sample_step(_rollout(per_batch), 5, AlgoConfig(prompts_per_step=2, group_size=2))
    assert plain.rounds == 1 and plain.prompts == [(5, 0), (5, 1)] and plain.dropped == 0


def test_dynamic_sampling_fills_with_tied_groups_when_the_rounds_run_out(caplog):
    algo = AlgoConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True, max_sample_rounds=2)
    got = sampling.sample_step(_rollout({0: [[1, 1], [0, 0]], 1: [[0, 1], [1, 1]]}), 0, algo)
    assert got.rounds == 2 and got.prompts == [(0, 0), (1, 0)] and got.dropped == 2
    assert "filled with tied groups" in caplog.text


# ---- start-up checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.adv_estimator=ppo"], "algo.adv_estimator='ppo' does not exist; use one of grpo, drgrpo"),
        (["algo.loss_agg=sum"], "algo.loss_agg='sum' does not exist"),
        (["algo.policy_loss=dpo"], "algo.policy_loss='dpo' does not exist; use one of ppo, gspo"),
        (["algo.kl_estimator=k4"], "algo.kl_estimator='k4' does not exist"),
        (["algo.clip_low=-0.1"], "algo.clip_low=-0.1; use a finite clip range >= 0"),
        (["algo.gspo_clip_low=1.5"], "algo.gspo_clip_low=1.5; use a value < 1"),
        (["algo.clip_c=1.0"], "algo.clip_c=1.0; the dual-clip bound is a ratio > 1"),
        (["algo.loss_agg=seq_mean_token_sum_norm"], "with algo.loss_norm_tokens=None; set algo.loss_norm_tokens"),
        (["algo.kl_in_reward=true"], "algo.kl_in_reward=true with algo.kl_coef=0.0; .*set algo.kl_coef > 0"),
        (["algo.mini_batches=3"], "algo.mini_batches=3 does not divide the 128 samples"),
        (["algo.ppo_epochs=0"], "algo.ppo_epochs=0"),
        (["algo.max_sample_rounds=0"], "algo.max_sample_rounds=0"),
        (
            ["algo.dynamic_sampling=true", "algo.max_staleness=1", "algo.correction=tis"],
            "algo.dynamic_sampling=true with algo.max_staleness=1; it runs in the synchronous loop only",
        ),
    ],
)
def test_bad_objective_settings_are_one_line_at_start_up(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(to_object(compose_cfg(*overrides)))
    assert "\n" not in str(e.value)


def test_loss_fields_default_the_clip_range_to_clip_eps(compose_cfg):
    cfg = validate(to_object(compose_cfg("algo.clip_eps=0.1", "algo.clip_high=0.28", "algo.policy_loss=gspo")))
    fields = loss_fields(cfg)
    assert (fields["clip_low"], fields["clip_high"], fields["policy_loss"]) == (0.1, 0.28, "gspo")
    LossConfig(**fields)  # every field is the trainer's


class _EveryRowPolicy(ToyPolicy):
    """Computes every packed row, as the Megatron engine does, with the prompt rows' targets outside a truncated
    support (-inf), as an exact top-k / top-p gives them."""

    def forward_logprobs(self, ids, cu_seqlens, targets, temps, rows, entropy=False):
        every = torch.arange(ids.numel())
        out = super().forward_logprobs(ids, cu_seqlens, targets, temps, every, entropy)
        outside = torch.ones(ids.numel(), dtype=torch.bool)
        outside[rows] = False
        lp = torch.where(outside, torch.full_like(out[0], float("-inf")), out[0])
        return (lp, every, out[2]) if entropy else (lp, every)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_rows_outside_the_responses_leave_the_loss_finite(policy_loss):
    """-inf logprobs of prompt rows (not trained on) must not reach the loss: GSPO's token form would turn them
    into NaN (lp - lp.detach()); the loss and gradient are those of a policy that computes the responses alone."""
    config = LossConfig(policy_loss=policy_loss, loss_agg="seq_mean_token_mean")
    plen = [1] * len(SEQS)
    results = []
    for model in (_EveryRowPolicy(), ToyPolicy()):
        old = score(ToyPolicy(), SEQS, plen)
        batch = TrainBatch(SEQS, plen, [0.5, -0.5, 1.0, -1.0], old)
        results.append(train_step(model, batch, config))
    every, alone = results
    assert math.isfinite(every["loss"]) and math.isfinite(every["grad_norm"])
    # the same values up to the summation order of the longer packed rows
    assert every["loss"] == pytest.approx(alone["loss"], abs=1e-6)
    assert every["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)
