"""Pure logic: GRPO advantages and loss, the weight-version timeline, the generated data and rewards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rl_kernel.models.packing import pack
from vime.config.schema import DataConfig, Task
from vime.data import tasks
from vime.data.dataset import PromptSet, load_tokenizer
from vime.errors import DataError, WeightSyncError
from vime.loop.timeline import Timeline
from vime.trainer.grpo import LossConfig, group_advantages, policy_loss


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3], [0.0, 0.1, 0.2, 0.9]])
    adv = group_advantages(rewards, eps=0.0)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * (0.5 / torch.tensor([1.0, 0, 0, 1]).std()))
    assert torch.equal(adv[1], torch.zeros(4))  # a group with one reward carries no signal
    assert torch.allclose(adv[2].mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(adv[2].std(), torch.tensor(1.0), atol=1e-5)
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))


def test_policy_loss_clips_and_adds_k3_kl():
    lp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.0, -1.5, -0.5])  # ratios 1, e^0.5 (clipped for A > 0), e^-0.5
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, stats = policy_loss(lp, old, adv, torch.ones(3), LossConfig(clip_low=0.2, clip_high=0.2))
    expected = -(1.0 + 1.2 * 1.0 + torch.exp(torch.tensor(-0.5)).clamp(0.8, 1.2) * -1.0) / 3
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert float(stats["clipped"] / stats["tokens"]) == pytest.approx(2 / 3)  # clip_frac: tokens 1 and 2
    loss.backward()
    assert lp.grad[1] == 0.0 and lp.grad[0] != 0.0  # a clipped token has no gradient
    ref = torch.tensor([-1.0, -2.0, -1.0])
    with_kl, stats = policy_loss(lp.detach(), old, adv, torch.ones(3), LossConfig(0.2, 0.2, kl_coef=0.5), ref)
    k3 = (torch.exp(ref - lp.detach()) - (ref - lp.detach()) - 1).mean()
    assert float(with_kl) == pytest.approx(float(expected + 0.5 * k3), rel=1e-6) and stats["kl_sum"] > 0


def test_clip_frac_counts_tokens_whose_clipped_branch_is_active():
    """The standard (PPO / verl) clip fraction: a ratio outside [1 - eps, 1 + eps] counts only where the
    clipped term wins (A > 0 above the range, A < 0 below it), not wherever |ratio - 1| > eps."""
    lp = torch.zeros(4)
    old = torch.tensor([-0.5, -0.5, 0.5, 0.5])  # ratios e^0.5 (above 1.2) twice, e^-0.5 (below 0.8) twice
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])  # clipped branch active for tokens 0 (A > 0) and 3 (A < 0)
    _, stats = policy_loss(lp, old, adv, torch.ones(4), LossConfig(clip_low=0.2, clip_high=0.2))
    assert float(stats["clipped"]) == 2.0 and float(stats["tokens"]) == 4.0


def test_pack_rows_targets_and_per_row_values():
    p = pack([[5, 6, 7, 8], [9, 10, 11]], [2, 1])
    assert p.ids.tolist() == [5, 6, 7, 8, 9, 10, 11] and p.cu_seqlens.tolist() == [0, 4, 7]
    assert p.rows.tolist() == [1, 2, 4, 5] and p.counts == [2, 2] and p.positions == [[2, 3], [1, 2]]
    assert p.targets[p.rows].tolist() == [7, 8, 10, 11]  # row t predicts token t + 1
    assert p.per_row([0.5, 2.0]).tolist() == [0.5] * 4 + [2.0] * 3
    assert p.on_rows([torch.tensor([1.0, 2.0]), 3.0]).tolist() == [0, 1, 2, 0, 3, 3, 0]
    with pytest.raises(ValueError, match="prompt_len 4 must be in"):
        pack([[1, 2, 3]], [4])


def test_policy_loss_clipping_kl_and_normaliser():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-1.0, -2.5, -0.5, -1.0])
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    loss, m = policy_loss(lp, old, adv, mask, cfg)
    ratio = torch.exp(lp.detach() - old)
    # token 1: ratio e^0.5 = 1.65 > 1.28 with A > 0 -> clipped term -1.28 wins the max
    expected = (-1.0 * 1.0 + -1.0 * 1.28 + 1.0 * ratio[2]) / 3
    assert torch.allclose(loss, expected) and m["clipped"] == 1 and m["tokens"] == 3
    loss.backward()
    assert lp.grad[1] == 0 and lp.grad[3] == 0 and lp.grad[0] == pytest.approx(-1 / 3)
    loss2, _ = policy_loss(lp.detach(), old, adv, mask, cfg, normalizer=6.0)
    assert torch.allclose(loss2, expected / 2)
    ref = lp.detach() - 0.1
    loss3, m3 = policy_loss(lp.detach(), old, adv, mask, LossConfig(kl_coef=0.5), ref)
    kl = torch.exp(torch.tensor(-0.1)) + 0.1 - 1
    assert torch.allclose(m3["kl_sum"], 3 * kl)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        policy_loss(lp, old, adv, mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="must all be \\[N\\]"):
        policy_loss(lp, old[:2], adv, mask)


def test_timeline_versions_and_acknowledgements():
    t = Timeline(num_engines=2)
    assert t.check_ready_for_rollout() == 0
    assert t.trained() == 1
    with pytest.raises(WeightSyncError, match=r"\[\(0, 0\), \(1, 0\)\].*behind the trainer's version 1"):
        t.check_ready_for_rollout()
    t.acknowledged(0, 1)
    with pytest.raises(WeightSyncError, match=r"\[\(1, 0\)\]"):
        t.check_ready_for_rollout()
    with pytest.raises(WeightSyncError, match="engine 1 acknowledged weight version 0"):
        t.acknowledged(1, 0)
    t.acknowledged(1, 1)
    assert t.check_ready_for_rollout() == 1
    t.finish_step()
    assert t.step == 1 and t.trainer_version == 1


def test_tasks_are_seeded_and_rewards_verifiable():
    assert tasks.arithmetic(5, seed=1) == tasks.arithmetic(5, seed=1) != tasks.arithmetic(5, seed=2)
    p = tasks.Problem("12+7=", "19", tasks.DIGITS)
    assert tasks.reward(p, " 19") == 1.0
    assert tasks.reward(p, "18") == pytest.approx(0.5 * 0.5 + 0.1 * 1.0)
    assert tasks.reward(p, "xy") == 0.0 and tasks.reward(p, "") == 0.0
    r = tasks.reverse(3, seed=0)[0]
    assert r.prompt == f"rev {r.answer[::-1]}="


def test_prompt_set_tokenizes_and_rejects_a_tokenizer_larger_than_the_model(tiny_qwen3_path, tmp_path):
    tok = load_tokenizer(tiny_qwen3_path)
    ps = PromptSet(DataConfig(task=Task.reverse, num_prompts=6), tok, vocab_size=512)
    batch = ps.batch(step=1, n=4)
    assert [p.index for p in batch] == [4, 5, 0, 1]
    assert tok.decode(batch[0].token_ids) == batch[0].problem.prompt
    answer = tok(batch[0].problem.answer, add_special_tokens=False)["input_ids"]
    assert ps.reward(batch[0], answer + [tok.eos_token_id, 50]) == 1.0
    small = tmp_path / "small"
    shutil.copytree(tiny_qwen3_path, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(config | {"vocab_size": 256}))
    with pytest.raises(DataError, match="tokenizer has 512 tokens but the model vocab is 256"):
        load_tokenizer(small)
    with pytest.raises(DataError, match="no config.json"):
        load_tokenizer(tmp_path)
