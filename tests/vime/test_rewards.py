"""Reward functions: built-ins, the user's (module / file, sync / async), value checks, on_error, overlong shaping,
and the Ray worker pool (slow: real Ray actors)."""

from __future__ import annotations

import math
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime.config.schema import DataConfig, EvalConfig, RewardConfig, VimeConfig, validate
from vime.data import rewards, tasks
from vime.data.dataset import Prompt
from vime.data.reward_pool import RewardError, Rewards, Scorer
from vime.engines import Sample
from vime.errors import ConfigError

# ---- built-ins -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("so 3+4=7\n#### 7", "3+4=7\n#### 7", 1.0),
        ("#### 1,234", "#### 1234", 1.0),
        ("#### 8", "#### 7", 0.0),
        ("the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("first \\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box counts
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("7", "7", 0.0),  # no final answer stated
        ("\\boxed{x^{2}}", "x^2", 1.0),  # nested braces
    ],
)
def test_math_reward(response, label, expected):
    assert rewards.math_reward("p", response, label, {}) == expected


def test_exact_regex_and_task_rewards():
    assert rewards.exact_reward("p", " 42 \n", 42, {}) == 1.0 and rewards.exact_reward("p", "420", 42, {}) == 0.0
    fn = rewards.resolve("regex", r"answer: (\d+)")
    assert fn("p", "answer: 12", "12", {}) == 1.0 and fn("p", "answer: 13", "12", {}) == 0.0
    assert fn("p", "no", "12", {}) == 0.0
    whole = rewards.resolve("regex", r"\b{label}\b")
    assert whole("p", "it is 12.", "12", {}) == 1.0 and whole("p", "it is 123", "12", {}) == 0.0
    p = tasks.Problem("12+7=", "19", tasks.DIGITS)
    for response in (" 19", "18", "xy", ""):
        meta = {"alphabet": p.alphabet, "format_weight": p.format_weight}
        assert rewards.task_reward(p.prompt, response, p.answer, meta) == tasks.reward(p, response)
    with pytest.raises(ConfigError, match=r"reward.pattern='\(' is not a regular expression"):
        rewards.resolve("regex", "(")


# ---- the user's function ----------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A package `myrewards` on sys.path with sync, async, failing and wrongly-typed reward functions."""
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fns.py").write_text(
        textwrap.dedent(
            """
            import asyncio, time

            def score(prompt, response, label, metadata):
                return {"score": float(response == label), "length": len(response)}

            async def ascore(prompt, response, label, metadata):
                await asyncio.sleep(metadata.get("sleep", 0))
                return 1.0

            def slow(prompt, response, label, metadata):
                time.sleep(metadata.get("sleep", 0))
                return 0.5

            def boom(prompt, response, label, metadata):
                raise ValueError("no answer in " + response + "\\nof " + label)

            def nan(prompt, response, label, metadata):
                return float("nan")

            def text(prompt, response, label, metadata):
                return "1.0"

            def two(prompt, response):
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m.startswith("myrewards")]:
        del sys.modules[name]


def test_user_functions_resolve_by_module_or_file(user_module):
    fn = rewards.resolve("myrewards.fns:score")
    assert fn("p", "a", "a", {}) == {"score": 1.0, "length": 1}
    by_file = rewards.resolve(f"{user_module / 'fns.py'}:score")
    assert by_file("p", "a", "b", {}) == {"score": 0.0, "length": 1}
    assert rewards.import_paths("myrewards.fns:score") == [str(user_module.parent)]
    assert rewards.absolute("rel/fns.py:score") == f"{Path.cwd() / 'rel' / 'fns.py'}:score"  # what workers import
    assert rewards.absolute("myrewards.fns:score") == "myrewards.fns:score" and rewards.absolute(None) is None
    assert rewards.import_paths("math") == [] and rewards.import_paths(f"{user_module / 'fns.py'}:score") == []


@pytest.mark.parametrize(
    "spec, match",
    [
        ("nosuchmodule.x:score", r"reward.fn='nosuchmodule.x:score': cannot import nosuchmodule.x \(ModuleNotFound"),
        ("myrewards.fns:missing", r"myrewards.fns has no function 'missing'"),
        ("myrewards.fns:two", r"has signature \(prompt, response\); a reward function takes \(prompt: str, response"),
        ("/no/such/file.py:score", r"no file /no/such/file.py; give the path of the .py file"),
        ("banana", r"reward.fn='banana' is neither a built-in \(task, exact, math, regex\) nor module.path:function"),
    ],
)
def test_bad_reward_functions_are_one_line(user_module, spec, match):
    with pytest.raises(ConfigError, match=match) as e:
        rewards.resolve(spec)
    assert "\n" not in str(e.value)


def test_config_checks_of_the_reward():
    with pytest.raises(ConfigError, match="data.path=x.jsonl with reward.fn=null .* set reward.fn: math"):
        validate(VimeConfig(data=DataConfig(path="x.jsonl")))
    with pytest.raises(ConfigError, match="eval.path=t.jsonl with reward.fn=task .* set reward.fn: math"):
        validate(VimeConfig(eval=EvalConfig(path="t.jsonl"), reward=RewardConfig(fn="task")))
    with pytest.raises(ConfigError, match="reward.fn=regex without reward.pattern"):
        validate(VimeConfig(reward=RewardConfig(fn="regex")))
    with pytest.raises(ConfigError, match="reward.on_error='skip'; use one of raise, zero"):
        RewardConfig(on_error="skip")
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer=8 >= algo.max_new_tokens=8"):
        validate(VimeConfig(reward=RewardConfig(fn="math", overlong_buffer=8)))


# ---- values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, match",
    [
        (float("nan"), "returned nan, not a finite number"),
        (float("inf"), "returned inf, not a finite number"),
        ("1.0", r"returned '1.0' \(str\), not a number"),
        (None, r"returned None \(NoneType\), not a number"),
        (True, r"returned True \(bool\), not a number"),
        ({"acc": 1.0}, r"returned a dict without 'score' \(keys \['acc'\]\)"),
        ({"score": 1.0, "x": "a"}, r"returned x='a' \(str\), not a number"),
    ],
)
def test_bad_values(value, match):
    with pytest.raises(rewards.RewardValueError, match=match):
        rewards.check_value(value)


def test_good_values():
    import numpy as np

    assert rewards.check_value(1) == (1.0, {}) and rewards.check_value(np.float32(0.5)) == (0.5, {})
    assert rewards.check_value({"score": 0.25, "format": 1}) == (0.25, {"format": 1.0})


@given(length=st.integers(0, 64), max_new=st.integers(1, 64), buffer=st.integers(0, 63), penalty=st.floats(0, 4))
def test_overlong_penalty_is_dapos(length, max_new, buffer, penalty):
    length = min(length, max_new)
    p = rewards.overlong_penalty(length, max_new, buffer, penalty)
    if buffer == 0 or length <= max_new - buffer:
        assert p == 0.0
    else:
        assert math.isclose(p, -penalty * (length - (max_new - buffer)) / buffer, abs_tol=1e-12)
        assert -penalty <= p <= 0.0


# ---- scoring: timeouts, errors, metrics (in the driver, no workers) ------------------------------------


def _tok():
    """A stand-in tokenizer over a fixed id -> text table (ids 0 and 1 stop)."""
    table = {i: c for i, c in enumerate("\x00\x01abcdefghijklmnopqrstuvwxyz0123456789#= ")}
    return SimpleNamespace(decode=lambda ids: "".join(table[i] for i in ids), table=table)


def _ids(text: str) -> list[int]:
    inv = {c: i for i, c in _tok().table.items()}
    return [inv[c] for c in text]


def _step(responses: list[list[str]], label="7", meta=None, finish=None):
    batch = [Prompt(g, None, [5], f"q{g}", label, dict(meta or {})) for g in range(len(responses))]
    samples = [
        Sample(g, [5], _ids(r) + [1], [0.0] * (len(r) + 1), [0] * (len(r) + 1), 0, 1.0, finish_reason=finish or "stop")
        for g, group in enumerate(responses)
        for r in group
    ]
    return batch, samples


def _rewards(fn, **kw) -> Rewards:
    cfg = SimpleNamespace(reward=RewardConfig(fn=fn, num_workers=0, **kw))
    return Rewards(cfg, _tok(), [0, 1], max_new_tokens=8)


def test_scores_metrics_and_extras(user_module):
    r = _rewards("myrewards.fns:score")
    batch, samples = _step([["7", "8"], ["77", "7"]])
    metrics = r.score(batch, samples, step=3)
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.0]
    assert metrics == {"reward_errors": 0, "truncated_frac": 0.0, "reward/length": 1.25}


@pytest.mark.parametrize(
    "fn, meta, says",
    [
        ("boom", {}, r"raised ValueError: no answer in 7\\nof 7"),  # on one line
        ("nan", {}, "returned nan, not a finite number"),
        ("text", {}, r"returned '1.0' \(str\), not a number"),
        ("slow", {"sleep": 5}, "timed out after 0.2 s"),
        ("ascore", {"sleep": 5}, "timed out after 0.2 s"),
    ],
)
def test_a_failing_reward_stops_naming_the_sample_or_counts_as_zero(user_module, fn, meta, says):
    batch, samples = _step([["7", "7"]], meta=meta)
    with pytest.raises(RewardError, match=rf"reward.fn=myrewards.fns:{fn} {says} on step 2, sample 0 \(group 0") as e:
        _rewards(f"myrewards.fns:{fn}", timeout_s=0.2).score(batch, samples, step=2)
    assert "\n" not in str(e.value) and "reward.on_error=zero" in str(e.value)
    metrics = _rewards(f"myrewards.fns:{fn}", timeout_s=0.2, on_error="zero").score(batch, samples, step=2)
    assert metrics["reward_errors"] == 2 and [s.reward for s in samples] == [0.0, 0.0]


def test_async_rewards_run_concurrently(user_module):
    batch, samples = _step([["7"] * 8], meta={"sleep": 0.2})
    t0 = time.perf_counter()
    _rewards("myrewards.fns:ascore").score(batch, samples)
    assert time.perf_counter() - t0 < 1.0 and all(s.reward == 1.0 for s in samples)  # not 8 x 0.2 s


def test_overlong_shaping_and_truncated_frac():
    r = _rewards("exact", overlong_buffer=4, overlong_penalty=0.5)
    batch, samples = _step([["7", "abcdef7"]], finish="stop")  # responses of 2 and 8 tokens (the stop included)
    samples[1].finish_reason = "length"
    metrics = r.score(batch, samples)
    assert samples[0].reward == 1.0 and samples[1].reward == pytest.approx(0.0 - 0.5)  # 8 tokens: the full penalty
    assert metrics["truncated_frac"] == 0.5


def test_scorer_survives_a_hung_call(user_module):
    s = Scorer("myrewards.fns:slow", None, [])
    items = [(0, "p", "r", "l", {"sleep": 3}), (1, "p", "r", "l", {})]
    t0 = time.perf_counter()
    out = s.score(items, timeout_s=0.3)
    assert out == [(None, "timed out after 0.3 s"), (0.5, {})] and time.perf_counter() - t0 < 2.0


# ---- the Ray pool -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_ray_pool_scores_in_parallel_and_names_a_dead_worker(user_module, tmp_path):
    """num_workers=4 real Ray actors: a function in a file, found by path in the workers; 16 samples sleeping
    0.25 s each take about 1 s, not 4 s; a worker that dies is named."""
    import ray

    (tmp_path / "r.py").write_text(
        "import os, time\n"
        "def score(prompt, response, label, metadata):\n"
        "    if metadata.get('die'):\n"
        "        os._exit(3)\n"
        "    time.sleep(0.25)\n"
        "    return {'score': float(response == label), 'pid': os.getpid()}\n"
        "async def ascore(prompt, response, label, metadata):\n"
        "    import asyncio\n"
        "    await asyncio.sleep(0.25)\n"
        "    return float(response == label)\n"
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = SimpleNamespace(reward=RewardConfig(fn=f"{tmp_path / 'r.py'}:score", num_workers=4))
        r = Rewards(cfg, _tok(), [0, 1], max_new_tokens=8)
        r.start()
        batch, samples = _step([["7", "8"]] * 8)
        t0 = time.perf_counter()
        metrics = r.score(batch, samples)
        took = time.perf_counter() - t0
        assert [s.reward for s in samples] == [1.0, 0.0] * 8
        assert took < 3.0, took
        assert metrics["reward_errors"] == 0 and "reward/pid" in metrics  # an extra from the workers
        cfg = SimpleNamespace(reward=RewardConfig(fn=f"{tmp_path / 'r.py'}:ascore", num_workers=2))
        r_async = Rewards(cfg, _tok(), [0, 1], max_new_tokens=8)
        r_async.start()
        batch, samples = _step([["7", "8"]] * 8)
        t0 = time.perf_counter()
        r_async.score(batch, samples)  # concurrently inside each of the 2 workers
        assert [s.reward for s in samples] == [1.0, 0.0] * 8 and time.perf_counter() - t0 < 3.0
        batch, samples = _step([["7"]], meta={"die": True})
        with pytest.raises(RewardError, match=r"reward worker 0 died while scoring samples \[0\] with reward.fn="):
            r.score(batch, samples)
    finally:
        ray.shutdown()
