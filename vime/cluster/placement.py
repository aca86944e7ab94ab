"""Ray start-up and placement: one placement group per role, one bundle per actor.

Trainer ranks (TP x CP) pack into one group (a TP group stays within a node); each rollout engine
gets one bundle sized for its TP degree (on GPUs: `tp` GPUs; vLLM places its TP workers itself).
Across nodes a role's bundles also ask for its node resource (`ray.trainer_resource` /
`ray.rollout_resource`, vime.config.layout), so they land only on the nodes that declare it; the nodes the
bundles landed on decide each engine's weight path (`weight_paths`).

Addresses: a local run binds loopback only (`loopback_node`, `single_node_env`, a FileStore rendezvous).
A multi-node run (`ray.address`) binds the trainer's TCPStore and the weight-push group's store to the
node's own address (`listen_socket`, `tcp_store`: never all interfaces, as torch's own store server
does) and puts gloo's / NCCL's sockets on the interface that holds that address (`bind_node_interface`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.config.layout import ROLE_MARK
from vime.config.schema import RayConfig
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
                    # Ray's raylet starts idle workers for the first driver, which a run's actors (each
                    # with its own options) never take: seconds of CPU while the engines start
                    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
                    # "local": a Ray of its own, also where `ray start` left a cluster on this host (which a
                    # plain ray.init() would join, and then refuses num_cpus)
                    ray.init(
                        address="local",
                        num_cpus=cfg.num_cpus,
                        num_gpus=cfg.num_gpus,
                        include_dashboard=False,
                        runtime_env=runtime_env,
                        log_to_driver=log_to_driver,
                        configure_logging=False,
                        _node_ip_address=cfg.bind_address,  # every Ray listener: loopback by default
                        object_store_memory=object_store_bytes(),
                    )
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its raylet starts slowly
            # Ray waits a fixed 30 s for a local raylet to register; on a busy machine it can take longer.
            if cfg.address or "timed out during startup" not in str(e):
                raise
            _stop_started_ray_processes()  # the failed start leaves its GCS, dashboard and monitors running
            if attempt == START_ATTEMPTS:
                raise
            log.warning(
                "ray: local node start timed out (busy machine?); retrying (%d/%d)", attempt + 1, START_ATTEMPTS
            )
    resources = {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}
    # a cluster's resources are what a user checks a run's placement against; a local Ray's are this machine's
    log.log(logging.INFO if cfg.address else logging.DEBUG, "ray: %s", resources)


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
    children = [c for c in psutil.Process().children(recursive=True) if any("ray" in part for part in _cmdline(c)[:3])]
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


def bundle(cfg: RayConfig, gpus: float, role_resource: str | None = None) -> dict[str, float]:
    """One actor's bundle: its CPUs and GPUs, and a mark of its role's node resource when one is set
    (a node that declares 1 unit holds any number of such bundles; CPUs and GPUs do the counting)."""
    b = {"CPU": cfg.cpus_per_actor}
    if gpus:
        b["GPU"] = gpus
    if role_resource:
        b[role_resource] = ROLE_MARK
    return b


def make_group(name: str, bundles: list[dict[str, float]], timeout_s: float = 120.0) -> PlacementGroup:
    """Reserve `bundles` (PACK); a clear error when the cluster cannot hold them."""
    pg = placement_group(bundles, strategy="PACK", name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        have = ray.available_resources()
        raise ConfigError(
            f"Ray cannot place the {name} actors {bundles} (available: {have}); lower "
            "ray.cpus_per_actor / ray.gpus_per_actor, trainer.tp / cp or rollout.num_engines, "
            "or raise ray.num_cpus / ray.num_gpus"
        )
    return pg


def in_group(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


# ---- nodes -----------------------------------------------------------------------------------------


def alive_nodes() -> dict[str, str]:
    """{node id: node address} of the cluster's alive nodes."""
    return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes() if n.get("Alive")}


def node_address(node_id: str | None) -> str:
    """The address of node `node_id`, alive or not (the id itself when Ray does not know it)."""
    return next((n.get("NodeManagerAddress", "?") for n in ray.nodes() if n["NodeID"] == node_id), str(node_id))


def bundle_nodes(pg: PlacementGroup) -> list[str | None]:
    """The node id that holds each bundle of `pg` (None: not placed)."""
    placed = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
    return [placed.get(i) for i in range(len(pg.bundle_specs))]


def wait_bundle_node(pg: PlacementGroup, index: int, timeout_s: float) -> str | None:
    """The alive node that holds bundle `index` of `pg`, waiting up to `timeout_s` for Ray to place it again
    after its node was lost (Ray reschedules a lost node's bundles where capacity remains); None when no
    node took it in that time."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if pg.wait(timeout_seconds=max(1, min(5, int(left)))):
            node = bundle_nodes(pg)[index]
            if node in alive_nodes():
                return node
        if left <= 0:
            return None
        time.sleep(0.5)


def node_interface(ip: str) -> str | None:
    """The network interface that holds `ip` (or whose subnet does: 127.0.0.2 is on `lo`), else None."""
    import ipaddress

    import psutil

    want = ipaddress.ip_address(ip.split("%")[0])
    inside = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or not a.netmask:
                continue
            try:
                iface = ipaddress.ip_interface(f"{a.address.split('%')[0]}/{a.netmask}")
            except ValueError:
                continue
            if iface.ip == want:
                return name
            if inside is None and want in iface.network:
                inside = name
    return inside


def bind_node_interface() -> str | None:
    """In an actor of a multi-node run: gloo's and NCCL's sockets on the interface of this node's Ray
    address (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), unless already set (a local run sets `lo`; a user's
    own choice wins). Returns the interface gloo uses."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = node_interface(ray.util.get_node_ip_address())
        if iface is None:
            log.warning(
                "no interface holds this node's address %s: gloo picks one from the host name",
                ray.util.get_node_ip_address(),
            )
            return None
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
    return os.environ["GLOO_SOCKET_IFNAME"]


def listen_socket(host: str) -> socket.socket:
    """A TCP socket listening on `host` only, on a free port (`.getsockname()[1]`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(128)
    return s


def tcp_store(host: str, port: int, world: int, listen: socket.socket | None = None, timeout_s: float = 600.0):
    """A torch TCPStore at `host:port` for `world` members: its server, on `listen` (from `listen_socket`,
    handed over to the store: torch's own server would listen on every interface), or a client (None)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        host,
        port,
        world,
        is_master=listen is not None,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen.detach() if listen is not None else None,
    )


def trainer_store(init_method: str, rank: int, world: int, listen: socket.socket | None):
    """The trainer world's store for `init_method`: None for `file://` (torch's FileStore rendezvous),
    else the TCPStore at `tcp://host:port`, served by rank 0 from its `listen` socket."""
    if not init_method.startswith("tcp://"):
        return None
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    return tcp_store(host.strip("[]"), int(port), world, listen if rank == 0 else None)


def tcp_url(host: str, port: int) -> str:
    """`tcp://host:port` (an IPv6 host in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def weight_paths(cfg, trainer_node: str | None, engine_nodes: list) -> tuple[str | None, list, list]:
    """(trainer rank 0's node, each engine's node, each engine's weight path), from the nodes Ray placed trainer
    rank 0 and each engine's actor on (vime.cluster.groups; vime.config.layout.engine_transports); logged for a
    run on a cluster (`ray.address`)."""
    from vime.config.layout import engine_transports

    engine_nodes = list(engine_nodes)
    paths = engine_transports(cfg, trainer_node, engine_nodes)
    if cfg.ray.address:
        log.info(
            "placement: trainer rank 0 on node %s; %s",
            node_address(trainer_node),
            "; ".join(
                f"rollout engine {i} on node {node_address(n)} (weights over {p})"
                for i, (n, p) in enumerate(zip(engine_nodes, paths))
            ),
        )
    return trainer_node, engine_nodes, paths
