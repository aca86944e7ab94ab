"""Weight push protocol (`rl_kernel.weights.transfer`) on CPU: bucketing, packing, naming and the
version rules, through a loopback data plane (the IPC and NCCL data planes run in tests/gpu/gpu_path.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_kernel.bits import same_bits
from rl_kernel.models.qwen3 import Qwen3Reference
from rl_kernel.weights.transfer import (
    ALIGN,
    TensorMeta,
    WeightReceiver,
    WeightSender,
    WeightVersionError,
    pack,
    plan_buckets,
    receiver_for_model,
    unpack,
)


class LoopSender(WeightSender):
    """The bucket's buffer rides in the message (the IPC handle's place): a CPU data plane for tests."""

    def _ship(self, msg, buf):
        self._send({**msg, "loop": buf.clone()})


class LoopReceiver(WeightReceiver):
    def _fetch(self, msg, nbytes):
        assert msg["loop"].numel() == nbytes
        return msg["loop"]


def _wire(receiver: WeightReceiver, **kw) -> LoopSender:
    replies: list[dict] = []

    def send(msg: dict) -> None:
        ack = receiver.handle(msg)
        if ack is not None:
            replies.append(ack)

    return LoopSender("ipc", send, replies.pop, **kw)


def _tensors(gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    return [
        ("a", torch.randn(3, 5, generator=gen).to(torch.bfloat16)),
        ("b", torch.randn(7, generator=gen)),
        ("c", torch.randint(0, 9, (4, 4), generator=gen)),
        ("d", torch.randn(1000, generator=gen).half()),
    ]


def test_plan_buckets_covers_every_tensor_once_in_order():
    metas = [TensorMeta(f"t{i}", "bfloat16", (n,)) for i, n in enumerate([10, 200, 3000, 1, 128])]
    for size in (ALIGN, 1024, 4096, 1 << 20):
        plan = plan_buckets(metas, size)
        assert [i for b in plan for i in b] == list(range(len(metas)))
        for b in plan:  # a bucket over the limit holds exactly one (oversized) tensor
            assert sum(-(-metas[i].nbytes // ALIGN) * ALIGN for i in b) <= size or len(b) == 1
    assert len(plan_buckets(metas, 1 << 20)) == 1
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets(metas + metas[:1])


def test_pack_unpack_is_a_bit_copy():
    named = _tensors(torch.Generator().manual_seed(0))
    buf, sizes = pack([t for _, t in named])
    assert all(s % ALIGN == 0 for s in sizes)
    back = unpack(buf, [TensorMeta.of(n, t) for n, t in named], sizes)
    for (n, t), (m, u) in zip(named, back):
        assert n == m and u.dtype == t.dtype and u.shape == t.shape
        assert same_bits(u, t)


def test_push_roundtrip_versions_and_ack():
    got: dict[str, torch.Tensor] = {}
    named = _tensors(torch.Generator().manual_seed(1))
    expected = {n: TensorMeta.of(n, t) for n, t in named}
    rx = LoopReceiver(
        lambda pairs: got.update((n, t.clone()) for n, t in pairs), torch.device("cpu"), expected=expected
    )
    tx = _wire(rx, bucket_bytes=1024)
    ack = tx.push(named, 1)
    assert ack["version"] == 1 and ack["tensors"] == 4 and ack["buckets"] > 1 and rx.version == 1
    for n, t in named:
        assert same_bits(got[n], t)
    with pytest.raises(WeightVersionError, match="must grow"):
        tx.push(named, 1)
    tx.version = None  # a sender that lost track: the engine still refuses a stale version
    with pytest.raises(WeightVersionError, match="offered to an engine serving 1"):
        tx.push(named, 1)


def test_receiver_rejects_mismatches():
    named = _tensors(torch.Generator().manual_seed(2))
    expected = {n: TensorMeta.of(n, t) for n, t in named}
    loaded: list[str] = []
    rx = LoopReceiver(
        lambda pairs: loaded.extend(n for n, _ in pairs), torch.device("cpu"), expected=expected, version=3
    )
    tx = _wire(rx)
    with pytest.raises(WeightVersionError, match="lacks 1 weights"):
        tx.push(named[:3], 4)
    rx = LoopReceiver(lambda pairs: loaded.extend(n for n, _ in pairs), torch.device("cpu"), expected=expected)
    with pytest.raises(KeyError, match="no weight 'zz'"):
        _wire(rx).push([*named, ("zz", torch.zeros(2))], 1)
    assert loaded == []  # refused at `start`, before any bucket moved (an NCCL sender never broadcasts alone)
    rx = LoopReceiver(lambda pairs: None, torch.device("cpu"), expected=expected)
    with pytest.raises(ValueError, match="engine holds"):
        _wire(rx).push([("b", torch.zeros(8))], 1)
    rx = LoopReceiver(lambda pairs: None, torch.device("cpu"))
    start = {"names": [], "dtype_names": [], "shapes": []}
    rx.handle({"op": "start", "version": 5} | start)
    with pytest.raises(WeightVersionError, match="during the push of 5"):
        rx.handle({"op": "finish", "version": 6, "buckets": 0})
    with pytest.raises(WeightVersionError, match="still being received"):
        rx.handle({"op": "start", "version": 6} | start)
    with pytest.raises(WeightVersionError, match="without an int"):
        rx.handle({"op": "finish", "version": "5"})


def test_sender_rejects_a_wrong_ack():
    named = _tensors(torch.Generator().manual_seed(3))
    tx = LoopSender("ipc", lambda msg: None, lambda: {"version": 6, "tensors": 4, "bytes": 0})
    with pytest.raises(WeightVersionError, match="acknowledged weight version 6, pushed 7"):
        tx.push(named, 7)


def test_push_into_the_rollout_model(tiny_qwen3_path):
    """The GPU rollout engine's model loads a pushed state bit for bit (here over the loopback plane)."""
    src = load_file(tiny_qwen3_path / "model.safetensors")
    model = Qwen3Reference.from_pretrained(tiny_qwen3_path)
    with torch.no_grad():
        for s in model._shards.values():
            s.local.zero_()
    rx = receiver_for_model(model)
    rx.__class__ = LoopReceiver
    ack = _wire(rx, bucket_bytes=64 << 10).push(sorted(src.items()), 1)
    assert ack["tensors"] == len(src) and rx.version == 1
    for n, t in model.state_dict_hf().items():
        assert same_bits(t, src[n]), n


def test_the_old_module_name_is_the_moved_module():
    import rl_kernel.models.weight_transfer as old
    import rl_kernel.weights.transfer as moved
    from rl_kernel.models.weight_transfer import WeightSender as OldSender

    assert old is moved and OldSender is moved.WeightSender
