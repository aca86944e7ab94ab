"""Surviving a dead rollout engine.

A rollout engine whose Ray actor dies (its process killed, OOM, a crash in vLLM's engine core) is
replaced by a fresh actor in the same placement-group bundle, loaded with the trainer's current
weights and version, and its share of the step is redone. Sampling is seeded per (seed, step,
engine), so the redone share is the same samples: the step comes out as if nothing happened. Each
restart is logged and counted (`engine_restarts` in every metrics row); more than
`rollout.max_restarts` in a run ends it. A vLLM engine whose TP worker process dies (`rollout.tp > 1`)
counts as dead too: its actor reports "rollout engine i, TP rank r died" (`TPWorkerDiedError`, after
shutting the engine down and removing its temporary files), and the actor is replaced the same way.
A trainer rank that dies ends the run (the message says how
to resume from the last checkpoint): its state is not recoverable without one.

Across nodes: when a rollout node is lost (its raylet dies), its engines die with it and Ray places their
placement-group bundles again on a node that still has capacity (one that declares the rollout role's
resource). Each engine is restarted there once its bundle is placed, and its weight path follows its new
node (vime.config.layout.engine_transports). When no node takes the bundle within `ray.restart_wait_s`, the run
stops cleanly (the message names the engine, the lost node and what it needs) with the resume command. A
lost trainer node ends the run like a dead trainer rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import ray

from vime.errors import EngineDiedError, TPWorkerDiedError

log = logging.getLogger("vime")


def tp_worker_death(error: BaseException) -> TPWorkerDiedError | None:
    """The TP worker death a rollout actor reported, when `error` (from `driver.call`) is one."""
    inner = getattr(error.__cause__, "cause", None)  # the RayTaskError's original exception
    return inner if isinstance(inner, TPWorkerDiedError) else None


def died(error: BaseException) -> bool:
    """The error is an engine's death (its actor, or one of its TP worker processes), not an exception
    the engine raised and survived."""
    return isinstance(error, EngineDiedError) and (
        isinstance(error.__cause__, ray.exceptions.RayActorError) or tp_worker_death(error) is not None
    )


def _who(error: BaseException, engine: int) -> str:
    dead = tp_worker_death(error)
    return (
        f"rollout engine {engine}, TP rank {dead.tp_rank}"
        if dead and dead.engine == engine
        else f"rollout engine {engine}"
    )


def _alive(actor) -> bool:
    try:
        ray.get(actor.info.remote(), timeout=120)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    except ray.exceptions.RayTaskError as e:  # a TP worker of the engine died: the engine is gone
        if isinstance(e.cause, TPWorkerDiedError):
            return False
        raise


def load_current_weights(driver, engine: int) -> dict:
    """Bring restarted rollout engine `engine` to the trainer's current weights and version, over the run's
    configured transport (the same `sync_weights` as a step's sync; only the engines behind are loaded). An
    engine found dead by this push (a lost node takes all its engines, each seen dead at its own moment) is
    restarted too, as in a step's sync. Returns the push's sync stats (bytes, buckets, seconds)."""
    from vime.cluster.remote import BUCKET_BYTES, call
    from vime.weights.sync import sync_weights

    def push() -> dict:
        return sync_weights(
            driver.trainer,
            driver.engines,
            driver.timeline.trainer_version,
            BUCKET_BYTES,
            driver.timeline,
            call,
            driver.weight_paths,
            driver.cfg.rollout.engine,
        )

    return sync(driver, push)


def restart_engine(driver, engine: int, cause: str, who: str | None = None, reload: bool = True) -> dict | None:
    """Replace dead rollout engine `engine` by a fresh actor serving the trainer's current version (with
    `reload=False`, the checkpoint's weights: the caller's next step is a weight push to every engine behind);
    `who` names what died ("rollout engine 0, TP rank 1"; default: the engine). Returns the stats of the weights
    it loaded (None: none)."""
    from vime.cluster.remote import call

    limit = driver.cfg.rollout.max_restarts
    if driver.engine_restarts >= limit:
        raise EngineDiedError(
            f"rollout engine {engine} died and the run has restarted engines "
            f"{driver.engine_restarts} time(s) already (rollout.max_restarts={limit}): {cause}"
        )
    driver.engine_restarts += 1
    log.warning(
        "%s died; restarting it on weight version %d (restart %d of at most %d). Cause: %s",
        who or f"rollout engine {engine}",
        driver.timeline.trainer_version,
        driver.engine_restarts,
        limit,
        cause,
    )
    try:
        ray.kill(driver.engines[engine], no_restart=True)
    except Exception:  # noqa: BLE001 - it is dead already; kill only frees its name and bundle
        pass
    replace_on_capacity(driver, engine)
    driver.engines[engine] = driver.new_engine(engine)
    info = call([driver.engines[engine].info.remote()], "restart", [f"rollout engine {engine}"])[0]
    driver.timeline.engine_versions[engine] = info["version"]
    loaded = None
    if reload and info["version"] != driver.timeline.trainer_version:
        loaded = load_current_weights(driver, engine)
    log.warning(
        "rollout engine %d is back (pid %s), serving weight version %d",
        engine,
        info["pid"],
        driver.timeline.engine_versions[engine],
    )
    return loaded


def issue(driver, submit: Callable[[int], Any], engines: Iterable[int]) -> dict[int, tuple[Any, Any]]:
    """`submit(i)` (a Ray call on `driver.engines[i]`, returning its ref) for each engine i of `engines`, at once:
    {i: (the actor it went to, its ref)}, what `each_engine` awaits."""
    return {i: (driver.engines[i], submit(i)) for i in engines}


def each_engine(
    driver,
    submit: Callable[[int], Any],
    what: str,
    *,
    reload: bool = True,
    issued: dict[int, tuple[Any, Any]] | None = None,
    done: dict[int, Any] | None = None,
) -> list:
    """The result of `submit(i)` on every rollout engine i, in engine order: the one restart-and-retry loop.

    Every call not in `issued` (from `issue`) is issued before any is awaited. An engine that dies before its
    result is in is restarted (`restart_engine`; with `reload=False` without a weight reload: sleep and wake-up
    around a colocated train step, where the weight push after the wake-up brings every engine behind to the
    trainer's version) and `submit(i)` issued again on the fresh actor; so is a call whose actor was replaced
    meanwhile (another engine's restart found it dead). `issued` and `done` ({i: result}, results already in;
    they are not asked again) are updated in place, so a caller that keeps them (a rollout in flight) resumes
    where it left off."""
    from vime.cluster.remote import call

    n = len(driver.engines)
    issued = {} if issued is None else issued
    done = {} if done is None else done
    issued |= issue(driver, submit, [i for i in range(n) if i not in done and i not in issued])
    for i in range(n):
        while i not in done:
            actor, ref = issued[i]
            if driver.engines[i] is not actor:
                issued[i] = (driver.engines[i], submit(i))
                continue
            try:
                done[i] = call([ref], what, [f"rollout engine {i}"])[0]
            except EngineDiedError as e:
                if not died(e):
                    raise
                restart_engine(driver, i, str(e), _who(e, i), reload=reload)
    return [done[i] for i in range(n)]


def replace_on_capacity(driver, engine: int) -> None:
    """Wait until rollout engine `engine`'s bundle is placed on an alive node (at once unless its node was
    lost) and give the engine the weight path of that node; EngineDiedError when no node takes it within
    `ray.restart_wait_s` (the run then stops with the resume command)."""
    from vime.cluster import placement
    from vime.config.layout import engine_transports, role_resources

    pg = getattr(driver, "rollout_pg", None)
    if pg is None:  # an engine set up without a placement group (tests of the restart path)
        return
    cfg, before = driver.cfg, driver.engine_nodes[engine]
    index = getattr(driver, "engine_bundles", None)
    index = index[engine] if index else engine  # the bundle of the engine's actor (vime.cluster.groups)
    node = placement.wait_bundle_node(pg, index, cfg.ray.restart_wait_s)
    if node is None:
        mark = role_resources(cfg)["rollout"]
        bundle = pg.bundle_specs[index]
        fate = "is gone" if before not in placement.alive_nodes() else "has no room for it"
        raise EngineDiedError(
            f"rollout engine {engine} died, its node {placement.node_address(before)} {fate}, and no alive node "
            f"took its bundle {bundle} within ray.restart_wait_s={cfg.ray.restart_wait_s:g} s"
            + (f" (a node must declare '{mark}')" if mark else "")
            + "; add capacity to the cluster and resume"
        )
    if node != before:
        driver.engine_nodes[engine] = node
        driver.weight_paths[engine] = engine_transports(cfg, driver.trainer_node, [node])[0]
        log.warning(
            "rollout engine %d moves to node %s (weights over %s)",
            engine,
            placement.node_address(node),
            driver.weight_paths[engine],
        )


def sync(driver, sync_fn) -> dict:
    """`sync_fn()` (the weight sync to every engine); when an engine dies during it, restart the dead
    ones (they load the new version) and sync again (the engines that do not serve it yet). With the GPU
    transports the error comes from trainer rank 0, whose push met the dead engine: the engines'
    liveness, not the error's origin, decides."""
    try:
        return sync_fn()
    except EngineDiedError as e:
        dead = {i: actor for i, actor in enumerate(driver.engines) if not _alive(actor)}
        if not dead:
            raise
        # the push may have landed on the living engines before another was found dead (their acknowledgements
        # never came): the restarts' reloads and the retry must not offer them a version they already serve
        served_versions(driver, [i for i in range(len(driver.engines)) if i not in dead])
        reloads = []
        for i, actor in dead.items():
            if driver.engines[i] is not actor:  # already replaced: another engine's reload push found it dead too
                continue
            reloads.append(restart_engine(driver, i, str(e), _who(e, i)))
        served_versions(driver, range(len(driver.engines)))
        return with_reloads(sync_fn(), [r for r in reloads if r])


def with_reloads(stats: dict, reloads: list[dict]) -> dict:
    """A sync's stats with what restarted engines loaded meanwhile counted in: they loaded the new version
    themselves, so the retry pushes nothing to them, and the step's row would record 0 bytes for weights that
    moved. Bytes, buckets and seconds add up; the rate is taken over the sums."""
    if not reloads:
        return stats
    total = {k: stats[k] + sum(r[k] for r in reloads) for k in ("sync_s", "sync_bytes", "sync_buckets")}
    rate = total["sync_bytes"] / total["sync_s"] / 1e9 if total["sync_s"] > 0 else 0.0
    return stats | total | {"sync_gbps": rate}


def served_versions(driver, engines) -> None:
    """Set the timeline's versions of rollout engines `engines` (indices) to what each of them serves."""
    from vime.cluster.remote import call

    engines = list(engines)
    infos = call(
        [driver.engines[i].info.remote() for i in engines], "engine versions", [f"rollout engine {i}" for i in engines]
    )
    for i, info in zip(engines, infos):
        driver.timeline.engine_versions[i] = info["version"]
