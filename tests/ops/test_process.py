"""Another process, with other settings, computes the same bits: a subprocess with 1 thread, the
backend pinned by env (RL_KERNEL_BACKEND=torch) and other batch layouts (rows one at a time, paged
decode instead of prefill) reproduces this process's strict outputs, loaded and saved with torch.save.
No native twin: torch's kernels give the same bits in another process with the same thread count, so no
input makes native differ here on every CPU (the thread and TP twins assert where native breaks).
Also: RL_KERNEL_BACKEND=triton on CPU tensors fails closed in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rl_kernel as rk
from rl_kernel.bits import max_abs_diff, same_bits
from rl_kernel.selftest.matrix import cu_seqlens, qkv

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import sys, torch, rl_kernel as rk
    from rl_kernel.selftest.matrix import paged_cache, paged_step
    torch.set_num_threads(1)
    inp = torch.load(sys.argv[1])
    rows = lambda fn, n: torch.cat([fn(slice(i, i + 1)) for i in range(n)])  # one row per call
    out = {
        "linear": rows(lambda s: rk.linear(inp["x"][s], inp["w"]), inp["x"].shape[0]),
        "rms_norm": rows(lambda s: rk.rms_norm(inp["xn"][s], inp["wn"], 1e-6), inp["xn"].shape[0]),
        "silu_and_mul": rows(lambda s: rk.silu_and_mul(inp["xs"][s]), inp["xs"].shape[0]),
        "rope": rows(lambda s: rk.rope(inp["xr"][s], inp["pos"][s], 1e6), inp["xr"].shape[0]),
        "logprobs": rows(lambda s: rk.logprobs(inp["h"][s], inp["wl"], inp["t"][s]), inp["h"].shape[0]),
    }
    q, k, v = inp["q"], inp["k"], inp["v"]
    n = q.shape[0]
    kc, vc, table = paged_cache(k, v, [n], 8, torch.Generator().manual_seed(5))
    out["attention"] = torch.cat([paged_step([q], kc, vc, table, 0.2, [(0, j, j + 1)]) for j in range(n)])
    out["evidence"] = sorted((r["op"], r["mode"], r["contract_id"], r["fingerprint"]) for r in rk.evidence.snapshot())
    torch.save(out, sys.argv[2])
""")


def _inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g).to(dtype)

    q, k, v = qkv(g, 90, torch.float32, "cpu")
    return {
        "x": r(7, 256),
        "w": r(80, 256),
        "xn": r(7, 1024, dtype=torch.bfloat16),
        "wn": r(1024, dtype=torch.bfloat16),
        "xs": r(7, 512, dtype=torch.bfloat16),
        "xr": r(7, 4, 64, dtype=torch.bfloat16),
        "pos": torch.randint(0, 30000, (7,), generator=g),
        "h": r(7, 64),
        "wl": r(500, 64),
        "t": torch.randint(0, 500, (7,), generator=g),
        "q": q,
        "k": k,
        "v": v,
    }


def _here(inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This process: 2 threads, whole batches, full prefill."""
    torch.set_num_threads(2)
    return {
        "linear": rk.linear(inp["x"], inp["w"]),
        "rms_norm": rk.rms_norm(inp["xn"], inp["wn"], 1e-6),
        "silu_and_mul": rk.silu_and_mul(inp["xs"]),
        "rope": rk.rope(inp["xr"], inp["pos"], 1e6),
        "logprobs": rk.logprobs(inp["h"], inp["wl"], inp["t"]),
        "attention": rk.attention_varlen(inp["q"], inp["k"], inp["v"], cu_seqlens([90], "cpu"), 0.2),
    }


def _run(tmp_path, inp, **env) -> dict[str, torch.Tensor]:
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(inp, src)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RL_KERNEL_BACKEND": "torch", **env}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(src), str(dst)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(dst)


def test_subprocess_same_bits_strict(tmp_path, gen):
    """... and reports the same contracts: the same ids and fingerprints (terms and kernel sources) on both sides."""
    inp = _inputs(gen)
    with rk.evidence.recording() as ran:
        here = _here(inp)
    there = _run(tmp_path, inp, RL_KERNEL_MODE="strict")
    for name, value in here.items():
        assert same_bits(value, there[name]), f"{name}: max |diff| {max_abs_diff(value, there[name])}"
    assert there["evidence"] == sorted((r["op"], r["mode"], r["contract_id"], r["fingerprint"]) for r in ran)


def test_env_pinned_triton_backend_fails_closed_on_cpu(tmp_path):
    code = (
        "import torch, rl_kernel as rk\n"
        "try:\n    rk.linear(torch.ones(2, 8), torch.ones(3, 8))\n"
        "except rk.StrictModeError as e:\n    print(e.op, e.backend, e.reason, sep='|')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "RL_KERNEL_BACKEND": "triton", "RL_KERNEL_MODE": "strict"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    op, backend, reason = done.stdout.strip().split("|")
    assert (op, backend) == ("gemm", "triton") and "cpu" in reason and "CUDA" in reason
