"""End to end: `python -m vime.audit` with the real engines (Ray, vLLM with the rl_kernel plugin,
Megatron-core on gloo).

1. The default model, strict: the base rung (rollout logprobs recorded while sampling vs the
   trainer's teacher forcing) has 0 bit mismatches on every token; re-scoring the fixed tokens by
   forced decoding reproduces the sampled logprobs' bits; the verdict names no configured boundary.
   Every other rung flips exactly one boundary on one side, and its evidence shows that boundary's
   ops ran natively. The trainer's native logprob (LM head GEMM rounded to bf16 before the fp32
   log-softmax, as Megatron does) differs from the strict one (fp32 logits) by construction, on
   every CPU, so the verdict must name it; the other native rungs report what this machine shows.
2. Sides differ: a checkpoint (`model.path=`, the one run 1 made), trainer CP2, and the trainer's
   logprob boundary native in the config: the base rung shows mismatches and the verdict names the
   configured native boundary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_kernel import BOUNDARIES, OP_BOUNDARY

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.vllm, pytest.mark.megatron]


def _audit(out: Path, *overrides: str) -> tuple[dict, str]:
    env = os.environ | {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "vime.audit", f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert (out / "audit.png").stat().st_size > 10_000
    return json.loads((out / "audit.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def strict_audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit") / "strict"
    report, stdout = _audit(out)
    print(stdout)
    return out, report, stdout


def test_strict_audit_keeps_parity_and_names_no_configured_boundary(strict_audit):
    _, report, stdout = strict_audit
    base, rescore = report["rungs"][0], report["rungs"][1]
    assert base["rung"] == "base" and base["tokens"] > 0
    assert base["mismatch_count"] == 0 and base["max_abs_diff"] == 0.0 and base["worst"] is None
    assert rescore["rung"] == "rollout re-score" and rescore["mismatch_count"] == 0
    assert rescore["tokens"] == base["tokens"]
    assert report["base_parity"] is True and report["verdict"].startswith("PARITY")
    assert report["configured_native"] == {"rollout": [], "trainer": []}
    assert base["contracts"].pop("gumbel_sample") == "sampling"  # the engine's sampler: picks tokens only
    assert set(base["contracts"].values()) <= {"same", "paired"}
    assert not [x for x in base["ran"] if ":native:" in x]
    assert "verdict: PARITY" in stdout and "trainer:logprob" in stdout


def test_every_rung_flips_one_boundary_on_one_side(strict_audit):
    _, report, _ = strict_audit
    rungs = {r["rung"]: r for r in report["rungs"][2:]}
    assert set(rungs) == {f"{side}:{b}" for side in ("rollout", "trainer") for b in BOUNDARIES}
    for name, r in rungs.items():
        side, b = name.split(":")
        modes = r[f"{side}_modes"]
        assert modes[b] == "native" and all(m == "strict" for k, m in modes.items() if k != b), name
        other = r["trainer_modes" if side == "rollout" else "rollout_modes"]
        assert set(other.values()) == {"strict"}, name
        native_ops = {x.split(":")[0] for x in r["ran"] if ":native:" in x}
        assert {OP_BOUNDARY[op] for op in native_ops} <= {b}, (name, native_ops)
        if b not in ("collective", "moe"):  # TP1: no collective runs at all; a dense model runs no MoE op
            assert native_ops, f"{name}: no native op ran"
        assert r["tokens"] == report["tokens"] and r["error"] is None, r


def test_strict_audit_names_the_trainer_logprob_boundary(strict_audit):
    _, report, _ = strict_audit
    r = next(r for r in report["rungs"] if r["rung"] == "trainer:logprob")
    assert r["mismatch_count"] > 0 and r["max_abs_diff"] > 0 and r["worst"] is not None
    assert "logprob" in report["breaking"]["trainer"]
    assert "trainer: " in report["verdict"] and "logprob" in report["verdict"].split("alone:")[1]


def test_sides_differ_on_a_checkpoint_with_trainer_cp2(strict_audit, tmp_path):
    out, _, _ = strict_audit
    report, stdout = _audit(
        tmp_path / "differ",
        f"model.path={out / 'model'}",
        "trainer.cp=2",
        "+trainer.boundary_modes.logprob=native",
        "audit.boundaries=[attention]",
    )
    base = report["rungs"][0]
    assert report["model_path"] == str(out / "model") and "cp=2" in report["trainer_engine"]
    assert base["mismatch_count"] > 0 and report["base_parity"] is False
    assert report["configured_native"] == {"rollout": [], "trainer": ["logprob"]}
    assert report["verdict"].startswith("BROKEN") and "configured native: trainer: logprob" in report["verdict"]
    assert base["contracts"]["logprobs"] == "native"
    assert [r["rung"] for r in report["rungs"]] == [
        "base",
        "rollout re-score",
        "rollout:attention",
        "trainer:attention",
    ]
    assert "verdict: BROKEN" in stdout
