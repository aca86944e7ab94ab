"""Evaluation's pure logic: pass@k, the schedule, the eval set's checks, the trim of a resumed run's rows; and the
step record's new reward / response fields."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime.config.schema import DataConfig, EvalConfig, RewardConfig, VimeConfig, validate
from vime.data import examples
from vime.errors import ConfigError, DataError
from vime.eval import Evaluator, pass_metrics, read_rows
from vime.loop.record import StepRecord


def test_pass_at_1_is_the_mean_over_samples_and_pass_at_n_any():
    m = pass_metrics([[True, False, False, False], [False] * 4, [True] * 4], [2, 4])
    assert m == {"pass@1": pytest.approx((0.25 + 0 + 1) / 3), "pass@n": pytest.approx(2 / 3), "response_len_mean": 3}
    with pytest.raises(ValueError, match="at least one sample for every prompt"):
        pass_metrics([[True], []], [1])


@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=6), min_size=1, max_size=8))
def test_pass_at_1_never_exceeds_pass_at_n(passed):
    m = pass_metrics(passed, [1])
    assert 0 <= m["pass@1"] <= m["pass@n"] <= 1


def test_schedule_step_0_every_n_and_the_end():
    cfg = SimpleNamespace(steps=7, eval=EvalConfig(path="x", every=3), algo=SimpleNamespace(max_new_tokens=4))
    ev = Evaluator(cfg, [], "/tmp")
    assert [s for s in range(8) if ev.due(s)] == [0, 3, 6, 7]
    cfg.eval = EvalConfig(path="x")
    assert [s for s in range(8) if Evaluator(cfg, [], "/tmp").due(s)] == [0, 7]


def test_eval_set_checks(tmp_path, tiny_qwen3_path):
    from vime.data.dataset import load_tokenizer

    tok = load_tokenizer(tiny_qwen3_path)
    path = examples.write_jsonl(examples.gsm8k_rows(6, 1), tmp_path / "test.jsonl")
    cfg = VimeConfig(
        data=DataConfig(prompt_key="question"), eval=EvalConfig(path=str(path), max_prompts=4, max_new_tokens=16)
    )
    ev = Evaluator.build(cfg, tok, 512, str(tiny_qwen3_path), tmp_path)
    assert len(ev.prompts) == 4 and ev.max_new_tokens == 16
    cfg.rollout.max_model_len = 40
    with pytest.raises(DataError, match=r"eval.path=.*longest prompt \(\d+ tokens\) \+ 16 new tokens > rollout"):
        Evaluator.build(cfg, tok, 512, str(tiny_qwen3_path), tmp_path)
    cfg.data.prompt_key = "prompt"
    with pytest.raises(DataError, match=r"eval.path=.*no column 'prompt' \(eval.prompt_key\)"):
        Evaluator.build(cfg, tok, 512, str(tiny_qwen3_path), tmp_path)
    assert Evaluator.build(VimeConfig(), tok, 512, "", tmp_path) is None
    with pytest.raises(ConfigError, match="eval.path with algo.max_staleness=1"):
        validate(_async_with_eval())


def _async_with_eval() -> VimeConfig:
    cfg = VimeConfig(eval=EvalConfig(path="x"), reward=RewardConfig(fn="math"))
    cfg.algo.max_staleness, cfg.algo.correction = 1, "tis"
    return cfg


def test_a_resumed_run_keeps_the_eval_rows_before_it(tmp_path):
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "pass@1": 0.1 * s}) + "\n" for s in (0, 2, 4)))
    cfg = SimpleNamespace(steps=6, eval=EvalConfig(path="x", every=2), algo=SimpleNamespace(max_new_tokens=4))
    Evaluator(cfg, [], tmp_path)._trim(4)
    assert [r["step"] for r in read_rows(tmp_path)] == [0, 2]


def test_step_record_carries_reward_errors_truncation_and_extras():
    row = {"step": 1, "reward_mean": 0.5, "reward_errors": 2, "truncated_frac": 0.25, "reward/format": 0.75}
    rec = StepRecord.from_row(row)
    assert rec.reward.reward_errors == 2 and rec.reward.extras == {"format": 0.75}
    assert rec.response.truncated_frac == 0.25
    assert StepRecord.from_row(rec.row()) == rec
    w = rec.wandb()
    assert w["reward/errors"] == 2 and w["reward/format"] == 0.75 and w["response/truncated_frac"] == 0.25
    assert "reward_errors" not in StepRecord.from_row({"step": 0}).row()  # a run that measured none has none


def test_run_scores_reports_and_writes_the_completions(tmp_path, monkeypatch):
    """Evaluator.run over stand-in engines (each `generate` answers right for even rows, wrong for odd ones, on its
    share): pass@1 / pass@n from the run's reward, the eval.jsonl row, step_<N>.jsonl, the W&B log."""
    from vime.cluster import remote
    from vime.config.schema import RewardConfig
    from vime.data.dataset import Prompt
    from vime.data.reward_pool import Rewards
    from vime.engines import Sample

    table = dict(enumerate("\x00\x01#0123456789 "))
    tok = SimpleNamespace(decode=lambda ids: "".join(table[i] for i in ids))
    ids = {c: i for i, c in table.items()}
    prompts = [Prompt(10 + g, None, [3], f"q{g}", f"#### {g}", {}) for g in range(4)]
    seeds = []

    class Engine:
        def __init__(self, e):
            self.e, self.generate = e, SimpleNamespace(remote=self.remote)

        def remote(self, share, n, max_new, temperature, stop_ids, seed_step):
            seeds.append(seed_step)
            out = []
            for g, _ in share:
                for k in range(n):
                    text = f"#### {g if g % 2 == 0 or k == 0 else g + 1}"
                    resp = [ids[c] for c in text] + [1]
                    out.append(Sample(g, [3], resp, [0.0] * len(resp), [0] * len(resp), self.e, temperature))
            return out

    logged = []
    cfg = VimeConfig(eval=EvalConfig(path="x", n=3), reward=RewardConfig(fn="math", num_workers=0))
    driver = SimpleNamespace(
        engines=[Engine(0), Engine(1)],
        stop_ids=[0, 1],
        tokenizer=tok,
        rewards=Rewards(cfg, tok, [0, 1], 8),
        logger=SimpleNamespace(run=SimpleNamespace(log=lambda d, step: logged.append((step, d)))),
    )
    monkeypatch.setattr(remote, "call", lambda refs, what, names: refs)
    row = Evaluator(cfg, prompts, tmp_path).run(driver, 5)
    # rows 0, 2: 3 of 3 right; rows 1, 3: only the first sample right
    assert row["pass@1"] == pytest.approx((1 + 1 / 3 + 1 + 1 / 3) / 4) and row["pass@n"] == 1.0
    assert row["step"] == 5 and row["prompts"] == 4 and row["n"] == 3 and row["reward_errors"] == 0
    assert seeds == [12345 * 1_000_000 + 5] * 2  # the eval's own sampling seed, on both engines
    assert read_rows(tmp_path) == [row]
    lines = [json.loads(line) for line in (tmp_path / "eval" / "step_5.jsonl").read_text().splitlines()]
    assert len(lines) == 12
    assert [(d["row"], d["sample"], d["passed"]) for d in lines[3:6]] == [(11, 0, True), (11, 1, False), (11, 2, False)]
    assert lines[3]["response"] == "#### 1" and lines[3]["label"] == "#### 1"
    assert logged == [(5, {f"eval/{k}": v for k, v in row.items() if k != "step"})]
