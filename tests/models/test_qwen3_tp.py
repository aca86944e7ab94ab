"""Tensor parallelism of the reference model: 2 ranks (torch.multiprocessing spawn), gloo on the
CPU and, where 2 GPUs are present, NCCL.

Strict TP2 teacher forcing equals strict TP1 bit for bit (row-parallel GEMMs are TP-invariant for
tp dividing 8; vocab-parallel logprobs are sharding-invariant), the TP2 rollout equals TP2 teacher
forcing and the TP1 rollout, and the gathered TP2 weights equal the checkpoint. Native TP2 (bf16
all-reduce of bf16 partials, as Megatron/vLLM do) moves the logprobs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import rl_kernel as rk
from rl_kernel.bits import bit_mismatches, same_bits
from rl_kernel.models import Qwen3Reference, make_tiny_qwen3
from rl_kernel.models.rollout import Request, RolloutEngine

pytestmark = pytest.mark.slow
WORLD = 2
VOCAB = 500  # padded to 512 = 2 x 256 rows: rank 1 holds 244 real rows and 12 zero rows


def _sequences() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 75, 20, 3)]
    return seqs, [1, 30, 7, 2]


def _requests() -> list[Request]:
    g = torch.Generator().manual_seed(6)
    return [
        Request(torch.randint(4, VOCAB, (n,), generator=g).tolist(), new, temp, arrival)
        for n, new, temp, arrival in ((7, 8, 1.0, 0), (66, 5, 0.8, 0), (12, 9, 1.2, 3))
    ]


def _run(model: Qwen3Reference) -> dict:
    """What both TP2 ranks and the TP1 reference compute."""
    seqs, prompt_lens = _sequences()
    reqs = _requests()
    with rk.evidence.recording() as strict_ops:
        out = {"tf": model.sequence_logprobs(seqs, prompt_lens)}
        engine = RolloutEngine(model, num_blocks=32, block_size=8, max_num_batched_tokens=11)
        rollouts = engine.generate(reqs, seed=2)
        out["rollout_tf"] = model.sequence_logprobs(
            [r.prompt_ids + o.token_ids for r, o in zip(reqs, rollouts)],
            [len(r.prompt_ids) for r in reqs],
            [r.temperature for r in reqs],
        )
    out["tokens"] = [o.token_ids for o in rollouts]
    out["rollout"] = [o.logprobs.cpu() for o in rollouts]
    with rk.mode("native"), rk.evidence.recording() as native_ops:
        out["native_tf"] = model.sequence_logprobs(seqs, prompt_lens)
    out["ops"] = {
        name: sorted({(r["op"], r["mode"]) for r in ran})
        for name, ran in (("strict", strict_ops), ("native", native_ops))
    }
    return out


def _device(backend: str, rank: int) -> str:
    return "cpu" if backend == "gloo" else f"cuda:{rank}"


def _worker(rank: int, backend: str, init_file: str, path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = Qwen3Reference.from_pretrained(path, group=dist.group.WORLD, device=_device(backend, rank))
        assert model.embed.shape[0] == 256 and model.layers[0]["o"].shape == (128, 64)  # really sharded
        ckpt = load_file(f"{path}/model.safetensors")
        gathered = model.state_dict_hf()
        assert gathered.keys() == ckpt.keys()
        assert all(same_bits(gathered[k].cpu(), v) for k, v in ckpt.items())
        torch.save(_run(model), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices"),
            ],
        ),
    ],
)
def test_tp2_equals_tp1_bitwise(backend, tmp_path):
    path = make_tiny_qwen3(tmp_path / "model", vocab_size=VOCAB, seed=1)
    args = (backend, str(tmp_path / "init"), str(path), str(tmp_path))
    mp.spawn(_worker, args=args, nprocs=WORLD, join=True)
    tp2 = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    tp1 = _run(Qwen3Reference.from_pretrained(path, device=_device(backend, 0)))
    ranks, ref = tp2[0], tp1
    n = sum(x.numel() for x in ref["tf"])
    # Both ranks hold the same bits; the strict runs used the deterministic all-reduce and no native op.
    for key in ("tf", "rollout", "rollout_tf", "native_tf"):
        assert same_bits(tp2[0][key], tp2[1][key]), key
    assert tp2[0]["tokens"] == tp2[1]["tokens"]
    assert ("all_reduce", "strict") in ranks["ops"]["strict"] and {m for _, m in ranks["ops"]["strict"]} == {"strict"}
    assert ("all_reduce", "native") in ranks["ops"]["native"] and {m for _, m in ranks["ops"]["native"]} == {"native"}
    # Strict: TP2 == TP1 (teacher forcing), TP2 rollout == TP2 teacher forcing == TP1 rollout.
    assert same_bits(ranks["tf"], ref["tf"]), f"{bit_mismatches(ranks['tf'], ref['tf'])} / {n} differ"
    assert same_bits(ranks["rollout"], ranks["rollout_tf"])
    assert ranks["tokens"] == ref["tokens"] and same_bits(ranks["rollout"], ref["rollout"])
    # Native twin: TP2 vs TP1 differ.
    bad = bit_mismatches(ranks["native_tf"], ref["native_tf"])
    print(f"{backend}: strict TP2 vs TP1: 0 / {n} tokens differ; native TP2 vs TP1: {bad} / {n}")
    assert bad > 0


def test_tp2_replicates_kv_heads(tmp_path):
    """tp > num_kv_heads: each rank holds a copy of the one kv head (the layout table's KV replication,
    as vLLM shards it); export keeps one copy, and strict TP2 still equals TP1 bit for bit."""
    path = make_tiny_qwen3(tmp_path / "model", vocab_size=VOCAB, seed=3, num_kv_heads=1)
    mp.spawn(_worker, args=("gloo", str(tmp_path / "init"), str(path), str(tmp_path)), nprocs=WORLD, join=True)
    tp2 = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    tp1 = _run(Qwen3Reference.from_pretrained(path))
    for key in ("tf", "rollout", "rollout_tf"):
        assert same_bits(tp2[0][key], tp1[key]) and same_bits(tp2[1][key], tp1[key]), key
    assert tp2[0]["tokens"] == tp1["tokens"]
