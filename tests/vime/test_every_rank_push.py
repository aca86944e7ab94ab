"""The multi-rank IPC push (`EnginePush.push(..., every_rank=True)`, vime/weights/sync.py) on two real gloo ranks
on CPU: every trainer rank packs its own copy of the weights, the buckets' handles are all-gathered over the
trainer's world, and trainer rank 0 sends them to stand-in engines, engine i colocated on rank i's "GPU". Each
engine (rl_kernel's WeightReceiver, its data plane replaced) opens only the handle of its own GPU and must find
there its own rank's copy, bucket after bucket; both ranks return the engines' acknowledgement.

What is a stand-in: the handle. CUDA IPC needs a GPU, so a rank's handle is {"gpu-<rank>": its bucket buffer}
(`rl_kernel.weights.transfer.ipc_handles` replaced), moved by value; Ray's calls are made in process
(rank 0 calls the stand-ins directly). The gather, the routing by GPU, the buckets and the acknowledgement are
the real code. Its twin: the same push from rank 0 alone (every_rank=False) leaves engine 1 without a handle
for its GPU, and the push fails naming it."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.inprocess_ray import Method, get

pytestmark = pytest.mark.slow
WORLD = 2


class StandInEngine:
    """An engine colocated on trainer rank `gpu`'s GPU: a WeightReceiver that opens its own GPU's handle."""

    def __init__(self, gpu: int):
        from rl_kernel.weights.transfer import WeightReceiver

        self.gpu, self.got, self.opened = gpu, {}, []
        engine = self

        class Receiver(WeightReceiver):
            def _fetch(self, msg: dict, nbytes: int) -> torch.Tensor:
                handles = msg["ipc_handle"]
                mine = f"gpu-{engine.gpu}"
                if mine not in handles:
                    raise ValueError(f"no IPC handle for GPU {mine}; handles for {sorted(handles)}")
                rank, buf = handles[mine]
                engine.opened.append(rank)
                assert buf.numel() == nbytes
                return buf

        self.receiver = Receiver(lambda pairs: self.got.update({n: t.clone() for n, t in pairs}), torch.device("cpu"))
        self.receive_weights = Method(self.receiver.handle)


def _weights(rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s copy: the same names and shapes on every rank, its own values (so an engine shows whose copy
    it opened)."""
    g = torch.Generator().manual_seed(rank)
    return {f"w{i}": torch.randn(16, 8 + i, generator=g).to(torch.bfloat16) for i in range(5)}


def _rank(rank: int, port: int, out: str) -> None:
    import ray

    import rl_kernel.weights.transfer as wt
    from vime.weights.sync import EnginePush

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    wt.ipc_handles = lambda buf: {f"gpu-{dist.get_rank()}": (dist.get_rank(), buf.clone())}
    ray.get = get  # the stand-ins answer in process
    engines = [StandInEngine(g) for g in range(WORLD)] if rank == 0 else []
    push = EnginePush(torch.device("cpu"))
    ack = push.push(engines, _weights(rank), 1, "ipc", bucket_bytes=600, every_rank=True)
    result = {"ack": ack, "got": [dict(e.got) for e in engines], "opened": [list(e.opened) for e in engines]}
    if rank == 0:  # the twin: rank 0 alone ships only its own GPU's handles
        try:
            EnginePush(torch.device("cpu")).push(engines, _weights(0), 2, "ipc", bucket_bytes=600)
            result["alone"] = "pushed"
        except Exception as e:  # noqa: BLE001 - its message is the result
            result["alone"] = str(e)
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_rank_push_gives_each_colocated_engine_its_own_ranks_handles():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        mp.spawn(_rank, args=(_port(), out), nprocs=WORLD, join=True)
        results = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    ack = results[0]["ack"]
    assert ack["version"] == 1 and ack["tensors"] == 5 and ack["buckets"] > 1, ack
    assert results[1]["ack"] == ack  # every rank returns once the engines have acknowledged
    for gpu, (got, opened) in enumerate(zip(results[0]["got"], results[0]["opened"])):
        assert opened == [gpu] * ack["buckets"]  # every bucket from its own GPU's handle
        mine = _weights(gpu)
        assert got.keys() == mine.keys()
        assert all(torch.equal(got[n].view(torch.int16), mine[n].view(torch.int16)) for n in mine)
        other = _weights(1 - gpu)
        assert not any(torch.equal(got[n], other[n]) for n in mine)  # the copies differ: the check can fail
    assert "no IPC handle for GPU gpu-1; handles for ['gpu-0']" in results[0]["alone"], results[0]["alone"]
