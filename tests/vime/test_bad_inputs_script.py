"""scripts/bad_inputs.py (the bad-input table of benchmarks/results/bad_inputs_cpu.md): its verdict per case and
its report, without running a case (the script itself runs them, minutes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bad_inputs", REPO / "scripts" / "bad_inputs.py")
bad_inputs = importlib.util.module_from_spec(spec)
sys.modules["bad_inputs"] = bad_inputs  # its dataclasses look their module up there
spec.loader.exec_module(bad_inputs)


def test_one_line_means_exit_1_and_a_single_config_error_line():
    assert bad_inputs.is_one_line(1, ["config error: steps=abc: ..."])
    assert bad_inputs.is_one_line(1, ["15:02:29 config error: model.path=x is not ..."])  # the logged form
    assert not bad_inputs.is_one_line(0, ["config error: x"])
    assert not bad_inputs.is_one_line(1, ["config error: x", "Set the environment variable HYDRA_FULL_ERROR=1"])
    assert not bad_inputs.is_one_line(1, ["Traceback (most recent call last):"])
    assert not bad_inputs.is_one_line(1, ["error: ConfigError: x"])  # the second format the issue found


def test_every_case_of_the_issue_is_listed_once(tmp_path):
    cases = bad_inputs.cases(tmp_path)
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    given = {o.split("=", 1)[0] for c in cases for o in c.overrides}
    for key in ("steps", "trainer.lr", "algo.group_size", "rollout.mode", "+experiment", "device", "output_dir"):
        assert key in given, key
    for key in ("wandb.mode", "model.path", "algo.max_new_tokens", "trainer.cp", "ray.num_cpus", "resume"):
        assert key in given, key
    assert [c.expect_ok for c in cases].count(True) == 1  # the command a refusal suggests, which must run


def test_the_report_counts_the_bad_inputs_and_shows_each_console():
    R = bad_inputs.Result
    results = [
        R("type: steps=abc", "steps=abc", 1, 0.7, 1, True, ["config error: steps=abc: ..."]),
        R("a traceback", "x=1", 1, 9.0, 3, False, ["Traceback", "  File", "ValueError: x"]),
        R("the command the complete run's line suggests", "resume=d steps=4", 0, 90.0, 40, True, ["done"]),
    ]
    text = bad_inputs.table(results, ["header"])
    assert "1 of 2 bad inputs refused in one `config error:` line" in text
    assert "| a traceback | `x=1` | 1 | 9.0 | 3 | NO |" in text
    assert "    ValueError: x" in text and "    config error: steps=abc: ..." in text
