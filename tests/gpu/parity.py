"""Train-style vs rollout-style logprobs of the reference Qwen3, compared bit for bit.

    python tests/gpu/parity.py [--shape 8b|tiny] [--layers 2] [--requests 16] [--new-tokens 24] [--json PATH]

Builds a Qwen3 with random bf16 weights directly on the device (Qwen3-8B layer shapes by default:
hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288, vocab 151936; a few layers), generates
with the paged rollout engine (continuous batching, chunked prefill, shuffled KV blocks, requests
arriving over several steps), then recomputes the same tokens by teacher forcing over one packed
varlen batch, and compares the fp32 logprob bit patterns of every generated token. Runs once in
strict mode (expects 0 mismatches) and once in native mode (reports what it sees).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import rl_kernel as rk
from rl_kernel.bits import bits
from rl_kernel.models.qwen3 import Qwen3Config, Qwen3Reference
from rl_kernel.models.rollout import Request, RolloutEngine

SHAPES = {
    "8b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128
    ),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32),
}


def random_model(shape: str, layers: int, device: str, seed: int = 0) -> Qwen3Reference:
    """A Qwen3Reference with seeded random bf16 weights (std 0.02; norm weights in [0.5, 1.5])."""
    s = SHAPES[shape]
    config = Qwen3Config(
        num_layers=layers,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        **s,
    )
    model = Qwen3Reference(config, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = 0.02 if shape == "8b" else 0.1
    tensors = [("embed", model.embed), ("lm_head", model.lm_head), ("norm", model.norm)]
    tensors += [(name, t) for L in model.layers for name, t in L.items()]
    for name, t in tensors:
        if name.endswith("norm"):
            t.copy_(torch.rand(t.shape, generator=gen, device=device) + 0.5)
        else:
            t.copy_(torch.randn(t.shape, generator=gen, device=device) * std)
    return model


def requests(n: int, new_tokens: int, vocab: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen = int(torch.randint(5, 300, (1,), generator=g))
        prompt = torch.randint(0, vocab, (plen,), generator=g).tolist()
        out.append(Request(prompt, new_tokens, temperature=(0.7, 1.0, 1.3)[i % 3], arrival_step=i % 4))
    return out


def compare(model: Qwen3Reference, reqs: list[Request], budget: int, block_size: int) -> dict:
    need = sum(-(-(len(r.prompt_ids) + r.max_new_tokens) // block_size) for r in reqs)
    engine = RolloutEngine(model, num_blocks=need + 8, block_size=block_size, max_num_batched_tokens=budget)
    torch.cuda.synchronize() if model.device.type == "cuda" else None
    t0 = time.perf_counter()
    with rk.evidence.recording() as ran_rollout:
        done = engine.generate(reqs, seed=1)
    t1 = time.perf_counter()
    seqs = [r.prompt_ids + c.token_ids for r, c in zip(reqs, done)]
    with rk.evidence.recording() as ran_train:
        train = model.sequence_logprobs(seqs, [len(r.prompt_ids) for r in reqs], [r.temperature for r in reqs])
    t2 = time.perf_counter()
    roll = torch.cat([c.logprobs.cpu() for c in done])
    tf = torch.cat(train)
    differ = bits(roll) != bits(tf)
    worst = float((roll.double() - tf.double()).abs().max()) if roll.numel() else 0.0
    steps = len(engine.trace)
    mixed = sum(1 for st in engine.trace if any(n > 1 for _, _, n in st) and any(n == 1 for _, _, n in st))
    return {
        "tokens": int(roll.numel()),
        "mismatch_count": int(differ.sum()),
        "max_abs_diff": worst,
        "rollout_steps": steps,
        "mixed_prefill_decode_steps": mixed,
        "rollout_s": round(t1 - t0, 3),
        "teacher_forcing_s": round(t2 - t1, 3),
        "strict_backends": sorted({r["backend"] for r in ran_rollout + ran_train if r["mode"] == "strict"}),
        "native_ops": sorted({r["op"] for r in ran_rollout + ran_train if r["mode"] != "strict"}),
    }


def run(
    shape: str = "8b",
    layers: int = 2,
    n_requests: int = 16,
    new_tokens: int = 24,
    budget: int = 256,
    block_size: int = 16,
    device: str = "cuda",
) -> dict:
    model = random_model(shape, layers, device)
    reqs = requests(n_requests, new_tokens, model.config.vocab_size)
    out = {
        "shape": shape,
        "layers": layers,
        "requests": n_requests,
        "new_tokens": new_tokens,
        "budget": budget,
        "block_size": block_size,
        "backend": rk.get_backend(),
    }
    with rk.mode("strict"):
        out["strict"] = compare(model, reqs, budget, block_size)
    with rk.mode("native"):
        out["native"] = compare(model, reqs, budget, block_size)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = run(a.shape, a.layers, a.requests, a.new_tokens, a.budget)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    s = res["strict"]
    verdict = "PASS" if s["mismatch_count"] == 0 and s["tokens"] > 0 and not s["native_ops"] else "FAIL"
    print(
        f"PARITY {verdict}: strict {s['mismatch_count']}/{s['tokens']} mismatches "
        f"(max |diff| {s['max_abs_diff']:.3g}); "
        f"native {res['native']['mismatch_count']}/{res['native']['tokens']} "
        f"(max |diff| {res['native']['max_abs_diff']:.3g}); backends {s['strict_backends']}"
    )
    raise SystemExit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
