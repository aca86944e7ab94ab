"""Pure logic of what a person reads: W&B key groups, the no-signal warning, sample lines, the
end-of-run summary, the figure, the copy task, and the audit's verdict / ladder / run-evidence text."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vime import audit, report
from vime.config import modes_label
from vime.data import tasks


def _rows(n: int, mismatch: int = 0, strict: bool = True) -> list[dict]:
    return [{"step": i, "version": i, "next_version": i + 1, "reward_mean": 0.1 + 0.8 * i / max(1, n - 1),
             "reward_std": 0.1, "tokens": 128, "mismatch_count": mismatch, "max_abs_diff": 1e-3 * mismatch,
             "step_s": 1.0 + i, "strict": strict, "loss": 0.0, "grad_norm": 0.5,
             **({"worst_sample": 3, "worst_position": 4, "worst_token_id": 77, "worst_rollout": -1.25,
                 "worst_trainer": -1.5} if mismatch else {})} for i in range(n)]


def test_wandb_keys_are_grouped():
    row = _rows(1)[0] | {"sync_s": 0.2, "sync_bytes": 10.0, "rollout_s": 1.0, "contracts": {"gemm": "same"},
                         "strict": True, "samples": [("a=", "a", 1.0)], "clip_frac": 0.0, "tied_groups": 2}
    out = report.wandb_row(row)
    assert out["consistency/mismatch_count"] == 0 and out["consistency/max_abs_diff"] == 0.0
    assert out["rollout/reward_mean"] == row["reward_mean"] and out["rollout/tied_groups"] == 2
    assert out["train/loss"] == 0.0 and out["train/grad_norm"] == 0.5 and out["train/clip_frac"] == 0.0
    assert out["timing/step_s"] == 1.0 and out["timing/sync_s"] == 0.2 and out["timing/rollout_s"] == 1.0
    assert out["weights/version"] == 0 and out["weights/sync_bytes"] == 10.0
    assert all("/" in k for k in out)  # nothing ungrouped; bools, dicts and lists are not scalars
    assert not any(k.endswith(("strict", "contracts", "samples")) for k in out)


def test_no_signal_warning_only_when_every_group_is_tied():
    assert report.tied_groups([0.0, 0.0, 1.0, 0.0, 0.5, 0.5], 2) == 2
    assert report.no_signal_warning(3, [0.0, 0.0, 1.0, 0.0], 2) is None
    msg = report.no_signal_warning(3, [0.1, 0.1, 0.0, 0.0], 2)
    assert msg is not None and "step 3" in msg and "no learning signal" in msg and "2 groups" in msg


def test_completion_lines_take_one_sample_per_group():
    samples = [SimpleNamespace(group=g, prompt_ids=[g], response_ids=[g, 9], reward=0.5 * g) for g in (0, 0, 1, 2)]
    lines = report.completion_lines(samples, lambda ids: "".join(map(str, ids)), n=2)
    assert lines == [("0", "09", 0.0), ("1", "19", 0.5)]


def test_summary_says_what_zero_means_and_where_outputs_are(tmp_path):
    lines = "\n".join(report.summary_lines(_rows(10), tmp_path, tmp_path / "consistency.png", "/m"))
    assert "steps            10" in lines and "1280" in lines and "0 in total" in lines
    assert "exactly the fp32 bits" in lines and "0.100 -> 0.900" in lines and "median" in lines
    assert str(tmp_path) in lines and "consistency.png" in lines and "/m" in lines
    native = "\n".join(report.summary_lines(_rows(4, mismatch=128, strict=False), tmp_path, None, "/m"))
    assert "512 in total" in native and "differ in bits" in native


def test_summary_has_a_per_step_table_of_phase_timings_and_sync_rate(tmp_path):
    rows = [r | {"rollout_s": 1.5, "score_s": 0.25, "train_s": 0.5, "sync_s": 2.0, "sync_bytes": 4.0e9,
                 "sync_gbps": 2.0} for r in _rows(3)]
    table = report.step_table(rows)
    assert table[0].split() == ["step", "tokens", "mismatch", "max|diff|", "rollout_s", "score_s", "train_s",
                                "sync_s", "sync_GB", "sync_GB/s", "step_s"]
    assert table[2].split() == ["1", "128", "0", "0.00e+00", "1.50", "0.25", "0.50", "2.00", "4.000", "2.00", "2.00"]
    assert "\n".join(table) in "\n".join(report.summary_lines(rows, tmp_path, None, "/m"))
    long = report.step_table(_rows(30), max_rows=4)  # first and last steps of a long run; missing values as '-'
    assert len(long) == 6 and long[3].strip() == "..." and long[-1].split()[0] == "29" and "-" in long[1].split()
    assert report.wandb_row({"sync_gbps": 2.5}) == {"weights/sync_gbps": 2.5}


@pytest.mark.parametrize("compare", [False, True])
def test_plot_run_writes_one_figure(tmp_path, compare):
    path = report.plot_run(_rows(6), tmp_path / "c.png", _rows(6, mismatch=100, strict=False) if compare else None,
                           task="copy")
    assert path.stat().st_size > 10_000


def test_copy_task_and_its_reward():
    ps = tasks.copy(10, letters=4)
    assert [p.prompt for p in ps[:5]] == ["a=", "b=", "c=", "d=", "a="] and ps[2].answer == "c"
    assert tasks.reward(ps[2], "c") == 1.0 and tasks.reward(ps[2], "cz") == 1.0
    assert tasks.reward(ps[2], "d") == 0.0  # no format credit: a wrong letter earns nothing
    with pytest.raises(ValueError):
        tasks.copy(3, letters=0)


def test_modes_label():
    strict = {b: "strict" for b in ("norm", "gemm", "attention")}
    assert modes_label(strict) == "strict"
    assert modes_label(strict | {"attention": "native"}) == "strict except attention=native"


def _rung(name, side, boundary, mismatch, tokens=10):
    return {"rung": name, "side": side, "boundary": boundary, "mismatch_count": mismatch, "tokens": tokens,
            "max_abs_diff": 0.01 * mismatch, "worst": None, "ran": ["gemm:strict:rl_kernel.gemm.torch.v1[ab]"],
            "error": None}


def _report(base_mismatch: int) -> dict:
    rungs = [_rung("base", None, None, base_mismatch), _rung("rollout re-score", "rollout", None, 0),
             _rung("rollout:attention", "rollout", "attention", 3), _rung("trainer:logprob", "trainer", "logprob", 10),
             _rung("trainer:norm", "trainer", "norm", 0)]
    modes = {"rollout": {"attention": "strict"}, "trainer": {"attention": "strict"}}
    breaking = {"rollout": ["attention"], "trainer": ["logprob"]}
    configured = {"rollout": [], "trainer": ["logprob"] if base_mismatch else []}
    return {"samples": 4, "tokens": 10, "version": 0, "model_path": "/m", "rollout_engine": "r", "trainer_engine": "t",
            "base_modes": modes, "base_parity": base_mismatch == 0, "breaking": breaking, "rungs": rungs,
            "verdict": audit.verdict_text(rungs[0], breaking, configured)}


def test_audit_verdict_names_breaking_boundaries(tmp_path):
    ok = _report(0)
    assert ok["verdict"].startswith("PARITY") and "rollout: attention; trainer: logprob" in ok["verdict"]
    bad = _report(10)
    assert bad["verdict"].startswith("BROKEN") and "configured native: trainer: logprob" in bad["verdict"]
    text = audit.format_ladder(bad)
    assert "trainer:logprob" in text and "10 / 10" in text and "verdict: BROKEN" in text
    assert audit.plot_ladder(bad, tmp_path / "a.png").stat().st_size > 10_000


def test_audit_of_an_earlier_run_reads_its_evidence(tmp_path):
    rows = _rows(3)
    for r in rows:
        r["contracts"] = {"gemm": "same", "logprobs": "paired"}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = audit.audit_run(tmp_path)
    assert rep["total_mismatches"] == 0 and rep["tokens"] == 384 and len(rep["steps"]) == 3
    text = audit.format_run(rep)
    assert "gemm:same" in text and "3 steps, 0 mismatching tokens of 384" in text
