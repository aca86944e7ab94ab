"""The groups a synchronous step trains on, and their advantages.

Prompts come in batches of `algo.prompts_per_step` from the prompt set; batch b is `PromptSet.batch(b, n)`,
its rollout seeded by b, so without dynamic sampling batch b is step b's, as it always was. With
`algo.dynamic_sampling=true` (DAPO's) a group whose rewards all tie (advantage 0 under a group baseline: no
signal, and a smaller effective batch) is dropped, and further batches are sampled until the step has
`prompts_per_step` informative groups, at most `algo.max_sample_rounds` batches in all. Informative groups
beyond the step's count in its last batch are discarded; when the rounds run out first the step is filled
with tied groups, in the order sampled (a warning says so). The number of batches consumed is the data
position: a checkpoint saves it (`prompt_batches`) and a resumed run continues from it.
Advantages come after the selection, so reinforce_pp's batch normalisation is over the trained batch; with
`algo.kl_in_reward` each sample's reward is lowered by kl_coef x its summed KL to the reference first (the
task rewards, not the penalised ones, decide which groups tie).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from vime.config.schema import AlgoConfig
from vime.data.dataset import Prompt
from vime.engines import Sample
from vime.trainer.advantages import advantages

log = logging.getLogger("vime")


@dataclasses.dataclass
class StepGroups:
    """The groups of one step: samples (group g = `prompts[g]`, in group order), the batches of prompts it
    sampled (`rounds`), the tied groups it dropped and the rl_kernel evidence of its rollouts."""

    samples: list[Sample]
    prompts: list[Prompt]
    rounds: int
    dropped: int
    evidence: list[dict]


def tied(samples: list[Sample]) -> bool:
    """Do the rewards of one group's samples all tie?"""
    return max(s.reward for s in samples) == min(s.reward for s in samples)


def select_groups(
    rounds: list[tuple[list[Prompt], list[Sample]]], want: int, dynamic: bool
) -> tuple[list[Prompt], list[Sample], int]:
    """(prompts, samples renumbered to groups 0.., tied groups dropped) of the step from the batches it
    sampled, each (prompts, samples with rewards, `Sample.group` indexing the batch's prompts): without
    `dynamic` the first batch as it is; with it the first `want` informative groups in the order sampled,
    filled up with tied ones when there are fewer."""
    groups = []  # (prompt, samples) in the order sampled
    for prompts, samples in rounds:
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        groups += [(prompts[g], by_group[g]) for g in sorted(by_group)]
    if not dynamic:
        keep, dropped = list(range(min(want, len(groups)))), 0
    else:
        informative = [i for i, (_, g) in enumerate(groups) if not tied(g)]
        ties = [i for i, (_, g) in enumerate(groups) if tied(g)]
        fill = ties[: max(0, want - len(informative))]
        keep, dropped = sorted(informative[:want] + fill), len(ties) - len(fill)
    picked = [groups[i] for i in keep]
    out_prompts, out_samples = [], []
    for g, (prompt, samples) in enumerate(picked):
        out_prompts.append(prompt)
        out_samples += [dataclasses.replace(s, group=g) for s in samples]
    return out_prompts, out_samples, dropped


def sample_step(
    generate: Callable[[int], tuple[list[Prompt], list[Sample], list[dict]]], first_batch: int, algo: AlgoConfig
) -> StepGroups:
    """The step's groups: `generate(b)` rolls out prompt batch b (its prompts, samples with rewards, evidence);
    batches `first_batch`, `first_batch` + 1, ... as `algo.dynamic_sampling` needs them."""
    rounds, evidence = [], []
    limit = algo.max_sample_rounds if algo.dynamic_sampling else 1
    informative = 0
    while len(rounds) < limit and (not rounds or informative < algo.prompts_per_step):
        prompts, samples, ev = generate(first_batch + len(rounds))
        rounds.append((prompts, samples))
        evidence += ev
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        informative += sum(not tied(g) for g in by_group.values())
    prompts, samples, dropped = select_groups(rounds, algo.prompts_per_step, algo.dynamic_sampling)
    if algo.dynamic_sampling and informative < algo.prompts_per_step:
        log.warning(
            "dynamic sampling: %d informative group(s) of %d wanted after algo.max_sample_rounds=%d; "
            "the step is filled with tied groups",
            informative,
            algo.prompts_per_step,
            limit,
        )
    return StepGroups(samples, prompts, len(rounds), dropped, evidence)


def assign_advantages(samples: list[Sample], algo: AlgoConfig, kl_sums: list[float] | None = None) -> None:
    """Set each sample's advantage by `algo.adv_estimator` over its group (samples in group order, every group
    `algo.group_size` samples); `kl_sums` (with `algo.kl_in_reward`): each sample's summed KL to the reference,
    subtracted x `algo.kl_coef` from its reward first."""
    rewards = torch.tensor([s.reward for s in samples])  # fp32, as the advantages always took them
    if kl_sums is not None:
        rewards = rewards.double() - algo.kl_coef * torch.tensor(kl_sums, dtype=torch.float64)
    adv = advantages(rewards.reshape(-1, algo.group_size), algo.adv_estimator, algo.adv_eps)
    for s, a in zip(samples, adv.flatten().tolist()):
        s.advantage = a
