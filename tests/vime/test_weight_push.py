"""The GPU weight transports' Ray wiring (`vime.weights.sync`: trainer rank 0 -> rollout actors), on CPU.

`weights.transport=nccl` broadcasts packed buckets in a process group of trainer rank 0 and the engines,
formed apart from the trainer's own world (`rl_kernel.weights.transfer.open_weight_group`): NCCL on
CUDA, gloo on CPU. Here the real actors (a reference trainer rank, two reference rollout engines) push a
trained version over gloo; the engines then score exactly as the trainer does, bit for bit, and a stale
version is refused. The CUDA data planes (IPC handles, NCCL) run in scripts/gpu_train.sh and
tests/gpu/gpu_path.py."""

from __future__ import annotations

import pytest
import ray
import torch

import rl_kernel as rk
from rl_kernel.bits import bit_mismatches
from vime.cluster.placement import loopback_node, single_node_env
from vime.config.schema import Mode, RayConfig, RolloutBackend, RolloutConfig, TrainerBackend, TrainerConfig
from vime.engines import Sample
from vime.loop.timeline import Timeline
from vime.rollout.actor import RolloutWorker
from vime.trainer.actor import TrainerWorker
from vime.weights.sync import sync_weights

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def _call(refs, what, names):
    return ray.get(refs)


@pytest.fixture(scope="module")
def actors(tiny_qwen3_path):
    loopback_node("127.0.0.1")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
        runtime_env={"env_vars": single_node_env(RayConfig())},
        log_to_driver=False,
    )
    try:
        strict = {b: "strict" for b in rk.BOUNDARIES}
        rcfg = RolloutConfig(engine=RolloutBackend.reference, mode=Mode.strict)
        tcfg = TrainerConfig(engine=TrainerBackend.reference, mode=Mode.strict, lr=1e-2)
        engines = [
            ray.remote(RolloutWorker)
            .options(num_cpus=0)
            .remote(i, rcfg, str(tiny_qwen3_path), "bfloat16", "cpu", strict, 0)
            for i in range(2)
        ]
        trainer = (
            ray.remote(TrainerWorker)
            .options(num_cpus=0)
            .remote(0, 1, tcfg, str(tiny_qwen3_path), "bfloat16", "cpu", strict, 0, 0.0, 0.2)
        )
        ray.get(trainer.start.remote("unused"))
        yield (
            trainer,
            engines,
            lambda i: (
                ray.remote(RolloutWorker)
                .options(num_cpus=0)
                .remote(i, rcfg, str(tiny_qwen3_path), "bfloat16", "cpu", strict, 0)
            ),
        )
    finally:
        ray.shutdown()


def _samples(engines) -> list[Sample]:
    prompts = [(g, [3 + g, 7, 11 + g, 5]) for g in range(2)]
    samples = ray.get(engines[0].generate.remote(prompts, 4, 6, 1.0, [], 0))
    for i, s in enumerate(samples):
        s.advantage = 1.0 if i % 2 else -1.0
    return samples


def _mismatches(a: list[list[float]], b) -> int:
    return sum(bit_mismatches(torch.tensor(x, dtype=torch.float32), y.logprobs) for x, y in zip(a, b))


def test_a_trained_version_pushed_over_the_nccl_transport_scores_like_the_trainer(actors):
    trainer, engines, _ = actors
    samples = _samples(engines)
    before = ray.get(engines[1].rescore.remote(samples))
    assert ray.get(trainer.train_step.remote(samples))["version"] == 1
    timeline = Timeline(num_engines=2)
    timeline.trained()
    stats = sync_weights([trainer], engines, 1, 1 << 20, timeline, _call, transport="nccl")
    assert stats["sync_bytes"] > 0 and stats["sync_buckets"] >= 1 and stats["sync_gbps"] > 0
    trained = ray.get(trainer.score.remote(samples))
    for engine in engines:  # both engines got every tensor of version 1: they score as the trainer does
        assert _mismatches(ray.get(engine.rescore.remote(samples)), trained) == 0
    # native twin of the claim: the engines' scores before the push differ (the push moved weights)
    assert _mismatches(before, trained) > 0
    # the same version again is refused by the engines, never loaded silently
    with pytest.raises(ray.exceptions.RayTaskError, match="weight version 1 offered to an engine serving 1"):
        ray.get(trainer.push_weights.remote(engines, 1, "nccl", 1 << 20))


def test_a_restarted_engine_joins_a_new_group_and_takes_the_next_push(actors):
    """After an engine restart (a fresh actor loaded through the object store path, `vime.faults.restart`), the
    next push forms a new group with the engines of now; both then score the new version as the trainer."""
    trainer, engines, new_engine = actors
    version = ray.get(trainer.info.remote())["version"]
    fresh = new_engine(1)
    for bucket in ray.get(trainer.export_buckets.remote(1 << 20)):
        ray.get(fresh.load_weights.remote(bucket, version))
    assert ray.get(fresh.set_version.remote(version)) == version
    ray.kill(engines[1])
    engines[1] = fresh
    samples = _samples(engines)
    assert ray.get(trainer.train_step.remote(samples))["version"] == version + 1
    timeline = Timeline(num_engines=2, trainer_version=version + 1)
    sync_weights([trainer], engines, version + 1, 1 << 20, timeline, _call, transport="nccl")
    trained = ray.get(trainer.score.remote(samples))
    for engine in engines:
        assert _mismatches(ray.get(engine.rescore.remote(samples)), trained) == 0
    assert timeline.engine_versions == [version + 1] * 2


def _trained_driver(actors):
    """(samples, the trained version, a driver stand-in for `vime.faults.restart`): the trainer trains once on the
    engines' samples; the engines still serve the version before, over the nccl weight path."""
    from types import SimpleNamespace

    from vime.config.schema import VimeConfig

    trainer, engines, new_engine = actors
    samples = _samples(engines)
    version = ray.get(trainer.train_step.remote(samples))["version"]
    driver = SimpleNamespace(
        engines=engines,
        new_engine=new_engine,
        cfg=VimeConfig(rollout=RolloutConfig(engine=RolloutBackend.reference)),  # the fixture's engines
        engine_restarts=0,
        timeline=Timeline(num_engines=2, trainer_version=version, engine_versions=[version - 1] * 2),
        trainer=[trainer],
        weight_paths=["nccl"] * 2,
    )
    return samples, version, driver


def test_an_engine_killed_before_a_push_is_restarted_and_the_sync_completes(actors, tmp_path):
    """With the GPU transports trainer rank 0's push is what meets a dead engine: `vime.faults.restart.sync`
    restarts the dead engine (loaded with the new version over the run's weight path, as a step's sync is)
    and pushes to the engines still behind; then every engine serves the new version and scores as the trainer does."""
    from vime.faults import restart
    from vime.loop.driver import call

    trainer = actors[0]
    samples, version, driver = _trained_driver(actors)
    timeline = driver.timeline
    ray.kill(driver.engines[0])
    restart.sync(
        driver,
        lambda: sync_weights(
            [trainer], driver.engines, version, 1 << 20, timeline, call, transport=driver.weight_paths
        ),
    )
    assert driver.engine_restarts == 1 and timeline.engine_versions == [version] * 2
    trained = ray.get(trainer.score.remote(samples))
    for engine in driver.engines:
        assert _mismatches(ray.get(engine.rescore.remote(samples)), trained) == 0


def test_a_restart_whose_reload_meets_another_dead_engine_restarts_that_one_too(actors):
    """A lost node takes every engine on it, and each is seen dead at its own moment: engine 0 during a
    rollout (restarted, then reloaded by a push to every engine behind), engine 1 only by that reload's push.
    The reload restarts engine 1 as a step's sync would, instead of ending the run."""
    from vime.faults import restart

    trainer = actors[0]
    samples, version, driver = _trained_driver(actors)
    timeline = driver.timeline
    for engine in driver.engines:
        ray.kill(engine)
    restart.restart_engine(driver, 0, "killed with its node")
    assert driver.engine_restarts == 2 and timeline.engine_versions == [version] * 2
    trained = ray.get(trainer.score.remote(samples))
    for engine in driver.engines:
        assert _mismatches(ray.get(engine.rescore.remote(samples)), trained) == 0


def test_an_engine_dead_at_sleep_or_wake_up_is_restarted_and_the_next_push_loads_it(actors):
    """A colocated engine killed while the trainer works is met by the sleep or wake-up call around the train step
    (`vime.faults.restart.each_engine` with `reload=False`; `info` stands in for them, which the reference engine
    lacks): it is
    restarted without a reload, the call is made on the fresh engine, and the step's weight push that follows
    brings it to the trainer's version, scoring as the trainer does."""
    from vime.faults import restart
    from vime.loop.driver import call

    trainer = actors[0]
    samples, version, driver = _trained_driver(actors)
    timeline = driver.timeline
    ray.kill(driver.engines[1])
    restart.each_engine(driver, lambda i: driver.engines[i].info.remote(), "wake up", reload=False)
    assert driver.engine_restarts == 1
    assert timeline.engine_versions == [version - 1, 0]  # the fresh engine serves its checkpoint until the push
    sync_weights([trainer], driver.engines, version, 1 << 20, timeline, call, transport=["nccl"] * 2)
    assert timeline.engine_versions == [version] * 2
    trained = ray.get(trainer.score.remote(samples))
    for engine in driver.engines:
        assert _mismatches(ray.get(engine.rescore.remote(samples)), trained) == 0
