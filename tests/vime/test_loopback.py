"""Loopback by default: on one node the trainer's torch.distributed world rendezvous through
a FileStore (nothing listens) and gloo binds the loopback interface, so no trainer socket is reachable
from other hosts. Two real gloo ranks are started the way the driver configures them. And the real job
(the shared `default_run`, the default config): every listening socket of its process
tree, Ray's included, is on a loopback address."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vime.cluster import placement
from vime.config.schema import RayConfig

RANK = """
import sys, psutil, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == 2.0
listening = sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"})
dist.barrier()
print("LISTEN", ",".join(listening))
"""


@pytest.mark.slow
def test_single_node_trainer_world_listens_on_loopback_only():
    cfg = RayConfig()
    rendezvous = placement.rendezvous_file(cfg)
    env = os.environ | placement.single_node_env(cfg)
    assert rendezvous.startswith("/tmp/vime_rdzv_") and env["GLOO_SOCKET_IFNAME"] == "lo"
    try:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, f"file://{rendezvous}", str(r)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        if os.path.exists(rendezvous):
            os.unlink(rendezvous)
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err[-3000:]
        addrs = out.split("LISTEN", 1)[1].split()[0].split(",") if "LISTEN " in out else []
        assert addrs and set(addrs) <= {"127.0.0.1", "::1"}, out


def test_multi_node_opts_in():
    cfg = RayConfig(address="auto")
    assert placement.rendezvous_file(cfg) is None and placement.single_node_env(cfg) == {}


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback  # ::ffff:127.0.0.1: an IPv6 socket on loopback


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.megatron
def test_a_default_run_listens_on_loopback_only(default_run):
    """The real job (the shared `default_run`: the default config as a new user runs it): every
    listening socket of its process tree (driver, Ray's GCS, raylet, dashboard head, agents, monitor, workers
    and actors, vLLM, Megatron, W&B), sampled while it runs, is bound to a loopback address ("What listens
    where" in docs/vime.md)."""
    assert default_run.proc.returncode == 0, default_run.proc.stderr[-4000:]
    listeners = default_run.listeners
    names = {name for name, _, _ in listeners}
    assert {"gcs_server", "raylet"} <= names and any("RolloutWorker" in n for n in names), sorted(listeners)
    exposed = {k: v for k, v in listeners.items() if not _loopback(k[1])}
    assert not exposed, exposed
