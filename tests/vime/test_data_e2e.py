"""Your own data, end to end with the real components (Ray, vLLM with the rl_kernel plugin, Megatron-core, Hydra,
W&B offline): `+experiment=gsm8k` on a checkpoint laid out exactly as the hub ships one (sharded safetensors with
their index, tokenizer.json, tokenizer_config.json holding the chat template and Qwen3's special tokens), the
generated GSM8K-format data, the chat template, `reward.fn=math` on the Ray reward pool and evaluation.

CI: that run trains with 0 mismatches on every step and logs eval pass@1. Extended: a run stopped after step 0
and resumed crosses an epoch boundary of the data and ends equal, in bits, to the uninterrupted run, eval on.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.vime.conftest import REPO, TRAIN_ENV, train_cmd, wandb_exit_codes
from vime.config.schema import DataConfig
from vime.data import examples
from vime.data.dataset import load_tokenizer, stop_token_ids
from vime.state.checkpoint import TIMING_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron]
QWEN3_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def hub_layout_checkpoint(out: Path) -> Path:
    """The tiny chat Qwen3 rewritten as the hub ships Qwen3: weights in safetensors shards with
    model.safetensors.index.json, tokenizer.json, and the chat template inside tokenizer_config.json (no
    chat_template.jinja)."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    from rl_kernel.models.tiny import make_tiny_qwen3

    path = make_tiny_qwen3(
        out, vocab_size=128, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=2, chat=True
    )
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    save_torch_state_dict(tensors, path, max_shard_size=40_000)  # several shards and their index
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = (path / "chat_template.jinja").read_text()
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    config["added_tokens_decoder"] = {  # as the hub's Qwen3 tokenizer_config.json lists its special tokens
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in added
    }
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def _data(out: Path, n_train: int = 64, n_test: int = 8) -> tuple[Path, Path]:
    return (
        examples.write_jsonl(examples.gsm8k_rows(n_train, 0), out / "train.jsonl"),
        examples.write_jsonl(examples.gsm8k_rows(n_test, 1), out / "test.jsonl"),
    )


def _run(out: Path | None, *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m vime.train` into `out` (None: a `resume=` run, which keeps its own output_dir)."""
    return subprocess.run(
        train_cmd(*([f"output_dir={out}"] if out else []), *overrides),
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _rows(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines() if line]


def test_gsm8k_on_a_hub_layout_checkpoint_trains_with_zero_mismatches_and_evaluates(tmp_path):
    model = hub_layout_checkpoint(tmp_path / "Qwen3-tiny")
    shards = sorted(p.name for p in model.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and (model / "model.safetensors.index.json").is_file()
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"] and not (model / "chat_template.jinja").exists()
    added = {t["content"] for t in tok_cfg["added_tokens_decoder"].values()}
    assert set(QWEN3_SPECIAL) <= added and (model / "tokenizer.json").is_file()
    tok = load_tokenizer(model)
    assert tok.chat_template == tok_cfg["chat_template"] and tok.eos_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(DataConfig(chat_template=True), tok)

    train, test = _data(tmp_path)
    out = tmp_path / "run"
    proc = _run(
        out,
        "+experiment=gsm8k",
        f"model.path={model}",
        f"data.path={train}",
        f"eval.path={test}",
        "steps=2",
        "eval.every=1",
        "fail_on_mismatch=true",
        "checkpoint.final=false",
        "checkpoint.export_hf=false",
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-6000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["strict"] is True and r["tokens"] > 0
        assert r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0 and r["train_mismatch_count"] == 0, r
        assert r["reward_errors"] == 0 and 0.0 <= r["truncated_frac"] <= 1.0
    assert any(r["truncated_frac"] < 1.0 for r in rows)  # some responses ended at a stop token
    assert "data: 64 prompts from" in console and "(0 dropped longer than data.max_prompt_tokens=200)" in console
    assert "eval step 0: pass@1 " in console and "eval step 2: pass@1 " in console

    evals = _rows(out, "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2]  # step 0, every step, the end
    assert all(0.0 <= e["pass@1"] <= e["pass@n"] <= 1.0 and e["prompts"] == 8 and e["n"] == 2 for e in evals)
    done = _rows(out / "eval", "step_2.jsonl")
    assert len(done) == 16 and {d["row"] for d in done} == set(range(8))
    assert all(d["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for d in done)
    assert all("<|im_end|>" not in d["response"] for d in done)  # cut at the end-of-turn token
    stopped = [d for d in done if d["finish_reason"] == "stop"]
    assert all(d["response_len"] < 16 for d in stopped)
    assert wandb_exit_codes(out) == [0]
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"eval/pass@1" in run_file.read_bytes() and b"response/truncated_frac" in run_file.read_bytes()


@pytest.mark.extended
def test_resume_across_an_epoch_boundary_with_eval_equals_the_uninterrupted_run(tmp_path):
    """6 training rows, 4 prompts a step: step 1 draws the last 2 rows of epoch 0 and the first 2 of the reshuffled
    epoch 1. A run stopped after step 0 (`checkpoint.stop_after=0`) and resumed ends with the same metrics, eval
    rows and completions, and final weights, in bits, as the run that never stopped; and the same run with no eval
    has the same steps (eval samples with its own seeds)."""
    from safetensors.torch import load_file

    from rl_kernel.bits import same_bits

    train, test = _data(tmp_path, n_train=6, n_test=4)
    common = (
        "+experiment=gsm8k",
        f"data.path={train}",
        f"eval.path={test}",
        "steps=3",
        "eval.every=1",
        "checkpoint.every=1",
        "fail_on_mismatch=true",
    )
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    proc = _run(whole, *common)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    proc = _run(parts, *common, "checkpoint.stop_after=0")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert [r["step"] for r in _rows(parts)] == [0]
    proc = _run(None, f"resume={parts}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    def untimed(rows):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]

    assert untimed(_rows(parts)) == untimed(_rows(whole)) and len(_rows(whole)) == 3
    assert _rows(parts, "eval.jsonl") == _rows(whole, "eval.jsonl") and len(_rows(whole, "eval.jsonl")) == 4
    for s in range(4):
        assert (parts / "eval" / f"step_{s}.jsonl").read_text() == (whole / "eval" / f"step_{s}.jsonl").read_text()
    a, b = (load_file(str(run / "hf_model" / "model.safetensors")) for run in (parts, whole))
    assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    # eval does not perturb training: the same run without eval has the same steps, in bits
    quiet = tmp_path / "no_eval"
    proc = _run(quiet, *(o for o in common if not o.startswith("eval.")), "eval.path=null")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert not (quiet / "eval.jsonl").exists() and untimed(_rows(quiet)) == untimed(_rows(whole))


@pytest.mark.extended
def test_a_failing_reward_stops_the_run_naming_the_sample_or_counts_under_zero(tmp_path):
    """reward.fn raises on the real run: exit 1 with one line naming the step, the sample and the function (no
    traceback), W&B exit code 1; the same function returning NaN under reward.on_error=zero: the run finishes,
    every sample counted in reward_errors."""
    (tmp_path / "bad.py").write_text(
        "def boom(prompt, response, label, metadata):\n    raise ValueError('no verdict for ' + label)\n"
        "def nan(prompt, response, label, metadata):\n    return float('nan')\n"
    )
    train, _ = _data(tmp_path, n_train=8)
    common = (f"data.path={train}", "data.prompt_key=question", "steps=1", "checkpoint.final=false")
    common += ("checkpoint.export_hf=false", "algo.prompts_per_step=2", "algo.group_size=2", "algo.max_new_tokens=4")
    out = tmp_path / "boom"
    proc = _run(out, *common, f"reward.fn={tmp_path / 'bad.py'}:boom")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]
    lines = [line for line in text.splitlines() if "RewardError: reward.fn=" in line]
    assert len(lines) == 1 and "raised ValueError: no verdict for " in lines[0] and "on step 0, sample 0" in lines[0]
    assert "Traceback" not in text and wandb_exit_codes(out) == [1]
    out = tmp_path / "nan"
    proc = _run(out, *common, f"reward.fn={tmp_path / 'bad.py'}:nan", "reward.on_error=zero")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (row,) = _rows(out)
    assert row["reward_errors"] == 4 and row["reward_mean"] == 0.0 and row["mismatch_count"] == 0
