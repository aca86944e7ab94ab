"""Ray start-up and placement: one placement group per role, one bundle per actor.

Trainer ranks (TP x CP) pack into one group (a TP group stays within a node); each rollout engine
gets one bundle sized for its TP degree (on GPUs: `tp` GPUs; vLLM places its TP workers itself).
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.config import RayConfig
from vime.errors import ConfigError

log = logging.getLogger("vime")
START_ATTEMPTS = 3  # local Ray start-ups tried before giving up


def start_ray(cfg: RayConfig, env: dict[str, str]) -> None:
    """Connect to `cfg.address`, or start a local Ray with `cfg.num_cpus` logical CPUs; `env` is set
    in every actor (rl_kernel / vLLM settings)."""
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": env}
    if cfg.address:
        ray.init(address=cfg.address, runtime_env=runtime_env, log_to_driver=True)
    else:
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                ray.init(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, include_dashboard=False,
                         runtime_env=runtime_env, log_to_driver=True, configure_logging=False,
                         _node_ip_address=cfg.bind_address,  # GCS, raylet, object manager: loopback by default
                         object_store_memory=min(2 << 30, int(os.environ.get("VIME_OBJECT_STORE_BYTES", 1 << 30))))
                break
            except Exception as e:
                # Ray waits a fixed 30 s for its local raylet to register (ray/_private/node.py); on a loaded
                # machine that can run out. Only that failure is retried, on a fresh local Ray.
                if "timed out during startup" not in str(e) or attempt == START_ATTEMPTS:
                    raise
                log.warning("ray: local node start-up timed out (attempt %d of %d), starting again", attempt,
                            START_ATTEMPTS)
                ray.shutdown()
    log.info("ray: %s", {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")})


def single_node_env(cfg: RayConfig) -> dict[str, str]:
    """Actor environment of a local run: gloo's sockets (trainer ranks, vLLM TP workers) on the
    loopback interface when Ray binds 127.0.0.1. A multi-node run (`ray.address`) sets its own
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME."""
    if cfg.address or cfg.bind_address != "127.0.0.1" or "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    return {"GLOO_SOCKET_IFNAME": "lo"}


def rendezvous_file(cfg: RayConfig) -> str | None:
    """A local run's trainer rendezvous: a FileStore file (nothing listens; torch's TCPStore would
    listen on every interface). None for a multi-node run (TCP on the rank-0 node's address)."""
    if cfg.address:
        return None
    import uuid

    return f"/tmp/vime_rdzv_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def bundle(cfg: RayConfig, gpus: float) -> dict[str, float]:
    b = {"CPU": cfg.cpus_per_actor}
    if gpus:
        b["GPU"] = gpus
    return b


def make_group(name: str, bundles: list[dict[str, float]], timeout_s: float = 120.0) -> PlacementGroup:
    """Reserve `bundles` (PACK); a clear error when the cluster cannot hold them."""
    pg = placement_group(bundles, strategy="PACK", name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        have = ray.available_resources()
        raise ConfigError(f"Ray cannot place the {name} actors {bundles} (available: {have}); lower "
                          "ray.cpus_per_actor / ray.gpus_per_actor, trainer.tp / cp or rollout.num_engines, "
                          "or raise ray.num_cpus / ray.num_gpus")
    return pg


def in_group(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
