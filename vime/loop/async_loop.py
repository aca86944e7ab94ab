"""Asynchronous GRPO with bounded staleness and exact behaviour logprobs (`algo.max_staleness` = N >= 1).

Versions. Every response token carries the weight version that computed its logprob (`Sample.versions`,
from vLLM's weight-version spans or rl_kernel's engine). At training step s the trainer holds version v;
a token of version u is `v - u` versions behind (its lag).

The loop. The rollouts of steps s+1 .. s+N are submitted to the engines (Ray calls queue on each engine
actor) before step s trains, so they run while the trainer trains and syncs. A rollout submitted at
step s runs on the weights the engines serve then; with whole-sample versions (the default) the weight
push waits for the engine's running rollout, and in steady state every token is exactly N versions
behind. With `rollout.partial=true` a push lands between engine steps of a running rollout (no waiting),
whose later tokens then carry the newer version (mixed-version samples). A GRPO group with a token more
than N versions behind is dropped or requeued (`algo.stale_samples`), and counted.

Exact behaviour logprobs. The trainer keeps the last `trainer.kept_versions` (N+1) weight versions (on its
device, or in host memory with `trainer.kept_on=host`). Before the step it re-scores every stale sample (or a
seeded share, `algo.behaviour_check`) under the version that produced it (the trainer's own Megatron forward
with that version's weights), and mixed-version samples over one paged KV cache whose earlier runs were computed
under their own versions (`rl_kernel.models.rollout.mixed_version_logprobs`), exactly as the engine computed them.
Fresh samples (every token of the current version) are compared with the step's own training forward, as in
the synchronous loop. `mismatch_count` covers all of them, at every lag; with strict ops it is 0, so the
importance weight pi_prox / pi_behaviour of the correction (`algo.correction`) is pure staleness, and
exactly 1.0 on every fresh token (`lag0_ratio_off` counts the tokens where it is not).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time

import torch

from vime.config.schema import StaleSamples
from vime.data.dataset import Prompt
from vime.engines import Sample, Scored
from vime.errors import ComparabilityError, TrainingError
from vime.faults import restart
from vime.loop import consistency
from vime.loop.record import StepRecord
from vime.trainer.advantages import advantages
from vime.weights.sync import push_transport, sync_weights

log = logging.getLogger("vime")


# ---- pure logic ------------------------------------------------------------------------------------


def token_lags(samples: list[Sample], version: int) -> list[list[int]]:
    """Per sample, how many versions behind `version` (the trainer's) each response token is; a token of
    a newer version than the trainer's is an error."""
    lags = [[version - v for v in s.versions] for s in samples]
    ahead = [(i, s.versions) for i, (s, lg) in enumerate(zip(samples, lags)) if any(x < 0 for x in lg)]
    if ahead:
        raise ComparabilityError(
            f"sample {ahead[0][0]} has tokens of weight versions {sorted(set(ahead[0][1]))}, "
            f"newer than the trainer's {version}"
        )
    return lags


def lag_metrics(samples: list[Sample], version: int, max_staleness: int) -> dict[str, float]:
    """staleness_mean / staleness_max over every response token of `samples` (in versions behind the
    trainer's `version`), and lag_share_<k>, the share of tokens k versions behind, k = 0 .. max_staleness."""
    lags = [x for lg in token_lags(samples, version) for x in lg]
    n = max(len(lags), 1)
    return {
        "staleness_mean": sum(lags) / n,
        "staleness_max": max(lags, default=0),
        **{f"lag_share_{k}": sum(x == k for x in lags) / n for k in range(max_staleness + 1)},
    }


def stale_groups(samples: list[Sample], version: int, max_staleness: int) -> set[int]:
    """The GRPO groups with a token more than `max_staleness` versions behind `version`."""
    return {s.group for s, lg in zip(samples, token_lags(samples, version)) if lg and max(lg) > max_staleness}


def sample_kind(sample: Sample, version: int) -> str:
    """'fresh' (every token of `version`), 'stale' (every token of one older version) or 'mixed'."""
    kinds = set(sample.versions)
    if len(kinds) > 1:
        return "mixed"
    return "fresh" if kinds == {version} or not kinds else "stale"


def checked_samples(samples: list[Sample], version: int, share: float, rng: random.Random) -> list[int]:
    """Indices of the non-fresh samples whose behaviour logprobs the trainer reproduces: all of them at
    `share` 1.0, else a seeded draw of ceil(share x count) of them (at least one when there are any)."""
    candidates = [i for i, s in enumerate(samples) if sample_kind(s, version) != "fresh"]
    if share >= 1.0 or not candidates:
        return candidates
    return sorted(rng.sample(candidates, min(len(candidates), max(1, math.ceil(share * len(candidates))))))


def check_behaviour_comparable(samples: list[Sample], scored: list[Scored]) -> None:
    """The gate of re-scored samples: the trainer scored each token under the version that produced it,
    the same token ids at the same positions, at the same temperature and vocab range."""
    for i, (s, t) in enumerate(zip(samples, scored)):
        where = f"sample {i} (group {s.group}, engine {s.engine})"
        if list(t.versions) != list(s.versions):
            raise ComparabilityError(
                f"{where}: the trainer re-scored under versions {t.versions}, the tokens "
                f"were produced under {s.versions}"
            )
        if list(t.token_ids) != list(s.response_ids):
            raise ComparabilityError(f"{where}: the trainer re-scored other token ids than the rollout sampled")
        expected = list(range(len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)))
        if list(t.positions) != expected:
            raise ComparabilityError(f"{where}: re-scored positions {list(t.positions)}, the tokens are at {expected}")
        if t.temperature != s.temperature or t.vocab_size != s.vocab_size:
            raise ComparabilityError(
                f"{where}: re-scored at temperature {t.temperature} / vocab {t.vocab_size}, "
                f"sampled at {s.temperature} / {s.vocab_size}"
            )
        if s.top_k not in (-1, 0) or s.top_p != 1.0:
            raise ComparabilityError(f"{where}: top_k={s.top_k}, top_p={s.top_p}: compare only full-softmax samples")


# ---- the loop --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Submitted:
    """A step's rollout in flight: its prompts (group g is `batch[g]`), each engine's share and its call
    ((actor, Ray ref), `vime.faults.restart.issue`), and the (samples, rl_kernel evidence) of each engine whose
    share is in (`AsyncLoop.outputs`)."""

    batch: list[Prompt]
    per_engine: list[list[tuple[int, list[int]]]]
    refs: dict[int, tuple[object, object]]
    results: dict[int, tuple[list[Sample], list[dict]]] = dataclasses.field(default_factory=dict)


class AsyncLoop:
    """Runs the steps of a started `vime.loop.driver.Driver` asynchronously (`algo.max_staleness` >= 1)."""

    def __init__(self, driver):
        self.d, self.cfg = driver, driver.cfg
        self.n = self.cfg.algo.max_staleness
        self.inflight: dict[int, Submitted] = {}
        self.next_submit = driver.timeline.step
        self.requeued: list[Prompt] = []
        self.rng = random.Random(self.cfg.seed)
        driver.async_loop = self  # `vime.state.checkpoint.save` saves what is in flight
        if driver.resumed is not None and driver.resumed.get("async") is not None:
            self.restore(driver.resumed["async"])

    # ---- checkpoint --------------------------------------------------------------------------------

    def state(self) -> dict:
        """What a checkpoint after a step needs to continue this loop exactly: every rollout in flight,
        finished (it waits for them: their content does not depend on when they are collected) with its
        samples and evidence, the next step to submit, the requeued prompts and the re-scoring draw's RNG.
        The trainer's kept weight versions are saved by the trainer (`vime.state.checkpoint.save_kept`)."""
        for step in sorted(self.inflight):
            self.outputs(step)
        return {
            "max_staleness": self.n,
            "next_submit": self.next_submit,
            "requeued": list(self.requeued),
            "rng": self.rng.getstate(),
            "inflight": {
                step: {"batch": sub.batch, "per_engine": sub.per_engine, "results": dict(sub.results)}
                for step, sub in sorted(self.inflight.items())
            },
        }

    def restore(self, state: dict) -> None:
        """Continue from `state()`: the saved rollouts are collected as if they had just finished (a step at
        or beyond `steps`, which a resume may lower, is not run)."""
        self.next_submit = min(int(state["next_submit"]), self.cfg.steps)
        self.requeued = list(state["requeued"])
        self.rng.setstate(state["rng"])
        self.inflight = {
            int(step): Submitted(sub["batch"], sub["per_engine"], {}, dict(sub["results"]))
            for step, sub in state["inflight"].items()
            if int(step) < self.cfg.steps
        }

    # ---- rollout -----------------------------------------------------------------------------------

    def _generate(self, engine: int, share: list[tuple[int, list[int]]], step: int):
        a, wait = self.cfg.algo, 0
        if self.cfg.rollout.partial and self.cfg.rollout.partial_wait:
            wait = max(0, step - self.n + 1)  # the version pushed after the step that runs beside this rollout
        return self.d.engines[engine].generate.remote(
            share, a.group_size, a.max_new_tokens, a.temperature, self.d.stop_ids, step, wait, True
        )

    def submit(self, step: int) -> None:
        """Queue step `step`'s rollout on the engines (requeued prompts first); returns at once."""
        batch = self.requeued + self.d.prompts.batch(step, self.cfg.algo.prompts_per_step)
        self.requeued = []
        n = len(self.d.engines)
        per_engine = [[(g, p.token_ids) for g, p in enumerate(batch) if g % n == e] for e in range(n)]
        refs = restart.issue(self.d, lambda i: self._generate(i, per_engine[i], step), range(n))
        self.inflight[step] = Submitted(batch, per_engine, refs)

    def outputs(self, step: int) -> list[tuple[list[Sample], list[dict]]]:
        """(samples, evidence) of each engine's share of step `step`'s rollout, waiting for those not in yet;
        a dead engine is restarted and its share generated again (at the version the engines serve now)."""
        sub = self.inflight[step]
        submit = lambda i: self._generate(i, sub.per_engine[i], step)  # noqa: E731
        return restart.each_engine(self.d, submit, "generate", issued=sub.refs, done=sub.results)

    def collect(self, step: int) -> tuple[list[Sample], list[Prompt]]:
        """Step `step`'s samples with rewards and group advantages (`outputs`)."""
        shares = self.outputs(step)
        sub = self.inflight.pop(step)
        outs = [out for out, _ in shares]
        self.d.rollout_evidence = [e for _, ev in shares for e in ev]
        samples = sorted((s for out in outs for s in out), key=lambda s: s.group)
        self.d.reward_metrics = self.d.rewards.score(sub.batch, samples, step)
        a = self.cfg.algo
        rewards = torch.tensor([s.reward for s in samples]).reshape(len(sub.batch), a.group_size)
        for s, adv in zip(samples, advantages(rewards, a.adv_estimator, a.adv_eps).flatten().tolist()):
            s.advantage = adv
        return samples, sub.batch

    # ---- one step ----------------------------------------------------------------------------------

    def step(self, step: int) -> StepRecord:
        d, cfg, t0 = self.d, self.cfg, time.perf_counter()
        while self.next_submit <= min(step + self.n, cfg.steps - 1):
            self.submit(self.next_submit)
            self.next_submit += 1
        samples, batch = self.collect(step)
        t1 = time.perf_counter()
        version = d.timeline.trainer_version
        lag_all = lag_metrics(samples, version, self.n)  # before the bound: what the rollout delivered
        stale = stale_groups(samples, version, self.n)
        if stale:
            log.warning(
                "step %d: %d group(s) more than %d versions behind the trainer: %s",
                step,
                len(stale),
                self.n,
                "requeued" if cfg.algo.stale_samples == StaleSamples.requeue else "dropped",
            )
            if cfg.algo.stale_samples == StaleSamples.requeue:
                self.requeued += [batch[g] for g in sorted(stale)]
            samples = [s for s in samples if s.group not in stale]
        if not samples:
            raise TrainingError(
                f"step {step}: every group is more than algo.max_staleness={self.n} versions behind "
                "the trainer; raise algo.max_staleness"
            )
        kinds = [sample_kind(s, version) for s in samples]
        checked = checked_samples(samples, version, cfg.algo.behaviour_check, self.rng)
        behaviour = (
            d._call(
                d.trainer,
                "score_behaviour",
                "re-score under behaviour versions",
                [samples[i] for i in checked],
                trainer=True,
            )[0]
            if checked
            else []
        )
        t2 = time.perf_counter()
        fresh = [k == "fresh" for k in kinds]
        stats = d._call(d.trainer, "train_step", "train step", samples, True, fresh, trainer=True)[0]
        trained = stats.pop("scored")
        reported = stats.pop("version")
        expected = d.timeline.trained()
        if reported != expected:
            raise TrainingError(f"trainer reports version {reported}, driver expects {expected}")
        t3 = time.perf_counter()
        result, verdict = self._consistency(samples, fresh, checked, behaviour, trained, version)
        sync = self._sync()
        checked_tokens = sum(len(samples[i].response_ids) for i in checked)
        stale_tokens = sum(len(s.response_ids) for s, k in zip(samples, kinds) if k != "fresh")
        fields = {
            **result.metrics(),
            **stats,
            **sync,
            **lag_metrics(samples, version, self.n),
            **d.reward_metrics,
            "rollout_staleness_max": lag_all["staleness_max"],
            "stale_groups": len(stale),
            "requeued_groups": len(stale) * (cfg.algo.stale_samples == "requeue"),
            "mixed_samples": kinds.count("mixed"),
            "stale_samples": kinds.count("stale"),
            "behaviour_checked_tokens": checked_tokens,
            "behaviour_check_rate": checked_tokens / stale_tokens if stale_tokens else 1.0,
            "contracts": verdict,
        }
        return d.record(step, version, samples, (t0, t1, t2, t3), fields)

    def _sync(self) -> dict:
        """Push the trainer's new version to every engine (the push waits for a running rollout unless
        `rollout.partial`, where it lands between the rollout's engine steps)."""
        from vime.cluster.remote import BUCKET_BYTES, call

        d = self.d
        if self.cfg.rollout.partial:
            return restart.sync(d, lambda: self._stage(BUCKET_BYTES, call))
        return restart.sync(
            d,
            lambda: sync_weights(
                d.trainer,
                d.engines,
                d.timeline.trainer_version,
                BUCKET_BYTES,
                d.timeline,
                call,
                d.weight_paths,
                self.cfg.rollout.engine,
            ),
        )

    def _stage(self, bucket_bytes: int, call) -> dict:
        """In-flight update: every engine stages the trainer's new version in its actor's "weights" concurrency
        group, to land at the next step boundary of a running rollout; over each engine's weight path: from
        Ray's object store (`object_store`), or received from trainer rank 0's broadcast in rl_kernel's push
        group (`gloo`: `vime.weights.sync.GroupReceiver`). Returns when every engine serves the version."""
        from rl_kernel.weights.transfer import DEFAULT_BUCKET_BYTES

        d, t0 = self.d, time.perf_counter()
        version = d.timeline.trainer_version
        ranks = [f"trainer rank {i}" for i in range(len(d.trainer))]
        paths = [str(p) for p in d.weight_paths]
        store = [i for i, p in enumerate(paths) if p == "object_store"]
        pushed = [i for i, p in enumerate(paths) if p != "object_store"]
        nbytes = nbuckets = 0
        if store:
            exports = call([r.export_to_store.remote(bucket_bytes) for r in d.trainer], "export weights", ranks)
            ref, nbytes, nbuckets = exports[0]["buckets"][0], exports[0]["bytes"], exports[0]["count"]
            acks = call(
                [d.engines[i].stage_weights.options(concurrency_group="weights").remote(ref, version) for i in store],
                "stage weights",
                [f"rollout engine {i}" for i in store],
            )
            for i, v in zip(store, acks):
                d.timeline.acknowledged(i, v)
        if pushed:
            wire = push_transport(paths[pushed[0]], self.cfg.rollout.engine)
            ack = call(
                [
                    r.push_weights.remote([d.engines[i] for i in pushed], version, wire, DEFAULT_BUCKET_BYTES, True)
                    for r in d.trainer
                ],
                "push weights",
                ranks,
            )[0]
            nbytes, nbuckets = max(nbytes, ack["bytes"]), max(nbuckets, ack["buckets"])
            for i in pushed:  # each engine acknowledged the push once it had landed and it served the version
                d.timeline.acknowledged(i, ack["version"])
        seconds = time.perf_counter() - t0
        return {
            "sync_s": seconds,
            "sync_bytes": float(nbytes),
            "sync_buckets": float(nbuckets),
            "sync_gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            "sync_transports": paths,
        }

    def _consistency(self, samples, fresh, checked, behaviour, trained, version):
        """Compare every checked token: fresh samples against the training forward (version `version`),
        the others against the trainer's re-scoring under their own versions. Returns (Consistency,
        contract verdicts)."""
        d = self.d
        fresh_idx = [i for i, f in enumerate(fresh) if f]
        consistency.check_comparable([samples[i] for i in fresh_idx], [trained[i] for i in fresh_idx], version)
        check_behaviour_comparable([samples[i] for i in checked], behaviour)
        trainer_ev = d._call(d.trainer, "evidence", "evidence", trainer=True)[0]
        verdict = consistency.check_contracts(d.rollout_evidence, trainer_ev, d.rollout_modes, d.trainer_modes)
        by_index = {i: trained[i] for i in fresh_idx} | dict(zip(checked, behaviour))
        order = sorted(by_index)
        result = consistency.compare(
            [consistency.rollout_tensor(samples[i].logprobs) for i in order],
            [by_index[i].logprobs for i in order],
            [by_index[i].positions for i in order],
            [by_index[i].token_ids for i in order],
        )
        if result.worst is not None:
            result.worst["sample"] = order[result.worst["sample"]]
        return result, verdict
