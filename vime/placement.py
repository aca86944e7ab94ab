"""Ray start-up and placement: one placement group per role, one bundle per actor.

Trainer ranks (TP x CP) pack into one group (a TP group stays within a node); each rollout engine
gets one bundle sized for its TP degree (on GPUs: `tp` GPUs; vLLM places its TP workers itself).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.config import RayConfig
from vime.errors import ConfigError

log = logging.getLogger("vime")
START_ATTEMPTS = 3  # local Ray start-ups tried before giving up


def start_ray(cfg: RayConfig, env: dict[str, str], log_to_driver: bool = True, log_file: str | None = None) -> None:
    """Connect to `cfg.address`, or start a local Ray with `cfg.num_cpus` logical CPUs; `env` is set
    in every actor (rl_kernel / vLLM settings). `log_to_driver=False` keeps actors' output off the
    driver's console, and Ray's own log lines go to `log_file` instead of the console."""
    if ray.is_initialized():
        return
    if not log_to_driver and log_file:
        ray_log = logging.getLogger("ray")
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        ray_log.handlers = [handler]  # in place of Ray's own console handler
        ray_log.propagate = False
    runtime_env = {"env_vars": env}
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            with _stderr_to(log_file if not log_to_driver else None):  # Ray's start-up notices (C++, Python)
                if cfg.address:
                    ray.init(address=cfg.address, runtime_env=runtime_env, log_to_driver=log_to_driver)
                else:
                    loopback_node(cfg.bind_address)
                    # "local": a Ray of its own, also where `ray start` left a cluster on this host (which a
                    # plain ray.init() would join, and then refuses num_cpus)
                    ray.init(address="local", num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, include_dashboard=False,
                             runtime_env=runtime_env, log_to_driver=log_to_driver, configure_logging=False,
                             _node_ip_address=cfg.bind_address,  # every Ray listener: loopback by default
                             object_store_memory=object_store_bytes())
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its raylet starts slowly
            # Ray waits a fixed 30 s for a local raylet to register; on a busy machine it can take longer.
            if cfg.address or "timed out during startup" not in str(e):
                raise
            _stop_started_ray_processes()  # the failed start leaves its GCS, dashboard and monitors running
            if attempt == START_ATTEMPTS:
                raise
            log.warning("ray: local node start timed out (busy machine?); retrying (%d/%d)", attempt + 1,
                        START_ATTEMPTS)
    log.info("ray: %s", {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")})


def object_store_bytes() -> int:
    """The object store of a local Ray: `VIME_OBJECT_STORE_BYTES`, default 1 GiB (CPU runs' weights are
    small; scripts/gpu_train.sh sets 8 GiB: room for the H200 preset's ~4 GB weight sync, no spilling)."""
    return int(os.environ.get("VIME_OBJECT_STORE_BYTES", 1 << 30))


LOOPBACK = ("127.0.0.1", "::1", "localhost")
RAY_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's single-node (loopback) mode


def loopback_node(bind_address: str) -> None:
    """Make a local Ray node's address the loopback address when `bind_address` is one.

    `ray.init(_node_ip_address="127.0.0.1")` alone is not enough: Ray replaces a loopback address by the
    host's routable one (`services.resolve_ip_for_localhost`), so its gRPC servers (GCS, raylet, every
    worker) would listen on all interfaces and its agents and metrics servers on the host address. Ray
    keeps the loopback address only in its single-node mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the
    default on macOS and Windows), which is read when `ray` is imported: set it for the processes Ray
    starts, and in this already imported one. Then every listener of the Ray node binds 127.0.0.1
    (`docs/vime.md`, "What listens where"). The flag does nothing else (it only picks the node address)."""
    if bind_address not in LOOPBACK:
        return
    import ray._private.ray_constants as ray_constants

    os.environ[RAY_SINGLE_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _stop_started_ray_processes() -> None:
    """Terminate the Ray processes this process started (its children running Ray's code), after a
    local start that failed half-way; `ray.shutdown()` does not know about them."""
    import psutil

    ray.shutdown()
    children = [c for c in psutil.Process().children(recursive=True)
                if any("ray" in part for part in _cmdline(c)[:3])]
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.terminate()
    _, alive = psutil.wait_procs(children, timeout=10)
    for c in alive:
        with contextlib.suppress(psutil.Error):
            c.kill()


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 - a process that just exited has no command line
        return []


@contextlib.contextmanager
def _stderr_to(path: str | None) -> Iterator[None]:
    """Append this process's stderr (file descriptor 2) to `path` inside the block (no-op for None)."""
    if not path:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


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
