"""Pure logic of what a person reads: the step record's W&B key groups, the no-signal warning, sample lines, the
end-of-run summary, the figure, the copy task, and the audit's verdict / ladder / run-evidence text."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from vime import audit
from vime.config.schema import modes_label
from vime.data import tasks
from vime.loop import record
from vime.loop.record import StepRecord
from vime.reporting import report


def _records(rows: list[dict]) -> list[StepRecord]:
    return [StepRecord.from_row(r) for r in rows]


def _rows(n: int, mismatch: int = 0, strict: bool = True) -> list[dict]:
    return [
        {
            "step": i,
            "version": i,
            "next_version": i + 1,
            "reward_mean": 0.1 + 0.8 * i / max(1, n - 1),
            "reward_std": 0.1,
            "tokens": 128,
            "mismatch_count": mismatch,
            "max_abs_diff": 1e-3 * mismatch,
            "step_s": 1.0 + i,
            "strict": strict,
            "loss": 0.0,
            "grad_norm": 0.5,
            **(
                {
                    "worst_sample": 3,
                    "worst_position": 4,
                    "worst_token_id": 77,
                    "worst_rollout": -1.25,
                    "worst_trainer": -1.5,
                }
                if mismatch
                else {}
            ),
        }
        for i in range(n)
    ]


def test_wandb_keys_are_grouped():
    row = _rows(1)[0] | {
        "sync_s": 0.2,
        "sync_bytes": 10.0,
        "rollout_s": 1.0,
        "contracts": {"gemm": "same"},
        "strict": True,
        "samples": [("a=", "a", 1.0)],
        "clip_frac": 0.0,
        "tied_groups": 2,
    }
    out = StepRecord.from_row(row).wandb()
    assert out["consistency/mismatch_count"] == 0 and out["consistency/max_abs_diff"] == 0.0
    assert out["rollout/reward_mean"] == row["reward_mean"] and out["rollout/tied_groups"] == 2
    assert out["train/loss"] == 0.0 and out["train/grad_norm"] == 0.5 and out["train/clip_frac"] == 0.0
    assert out["timing/step_s"] == 1.0 and out["timing/sync_s"] == 0.2 and out["timing/rollout_s"] == 1.0
    assert out["weights/version"] == 0 and out["weights/sync_bytes"] == 10.0
    assert all("/" in k for k in out)  # nothing ungrouped; bools, dicts and lists are not scalars
    assert not any(k.endswith(("strict", "contracts", "samples")) for k in out)


def test_no_signal_warning_only_when_every_group_is_tied():
    assert record.tied_groups([0.0, 0.0, 1.0, 0.0, 0.5, 0.5], 2) == 2
    assert report.no_signal_warning(3, [0.0, 0.0, 1.0, 0.0], 2) is None
    msg = report.no_signal_warning(3, [0.1, 0.1, 0.0, 0.0], 2)
    assert msg is not None and "step 3" in msg and "no learning signal" in msg and "2 groups" in msg
    assert report.no_signal_count([]) == ""
    assert report.no_signal_count(list(range(10))) == (
        "; no learning signal (every group tied) on 10 steps: 0, 1, 2, 3, 4, 5, 6, 7, ..."
    )


def test_completion_lines_take_one_sample_per_group():
    samples = [SimpleNamespace(group=g, prompt_ids=[g], response_ids=[g, 9], reward=0.5 * g) for g in (0, 0, 1, 2)]
    lines = record.completion_lines(samples, lambda ids: "".join(map(str, ids)), n=2)
    assert lines == [("0", "09", 0.0), ("1", "19", 0.5)]


def test_summary_says_what_zero_means_and_where_outputs_are(tmp_path):
    lines = "\n".join(report.summary_lines(_records(_rows(10)), tmp_path, tmp_path / "consistency.png", "/m"))
    assert "steps            10" in lines and "1280" in lines and "0 in total" in lines
    assert "the exact fp32 bits" in lines and "0.100 -> 0.900" in lines and "median" in lines
    assert str(tmp_path) in lines and "consistency.png" in lines and "/m" in lines and "no learning signal" not in lines
    tied = report.summary_lines(_records(_rows(10)), tmp_path, None, "/m", no_signal_steps=[0, 3])
    assert any(
        "0.100 -> 0.900" in line and "no learning signal (every group tied) on 2 steps: 0, 3" in line for line in tied
    )
    native = "\n".join(report.summary_lines(_records(_rows(4, mismatch=128, strict=False)), tmp_path, None, "/m"))
    assert "512 in total" in native and "differ in bits" in native


def test_summary_has_a_per_step_table_of_phase_timings_and_sync_rate(tmp_path):
    rows = [
        r | {"rollout_s": 1.5, "score_s": 0.25, "train_s": 0.5, "sync_s": 2.0, "sync_bytes": 4.0e9, "sync_gbps": 2.0}
        for r in _rows(3)
    ]
    table = report.step_table(_records(rows))
    assert table[0].split() == [
        "step",
        "tokens",
        "mismatch",
        "max|diff|",
        "rollout_s",
        "score_s",
        "train_s",
        "sync_s",
        "sync_GB",
        "sync_GB/s",
        "step_s",
    ]
    assert table[2].split() == ["1", "128", "0", "0.00e+00", "1.50", "0.25", "0.50", "2.00", "4.000", "2.00", "2.00"]
    assert "\n".join(table) in "\n".join(report.summary_lines(_records(rows), tmp_path, None, "/m"))
    long = report.step_table(_records(_rows(30)), max_rows=4)  # a long run's first and last steps; missing: '-'
    assert len(long) == 6 and long[3].strip() == "..." and long[-1].split()[0] == "29" and "-" in long[1].split()
    assert StepRecord.from_row({"step": 0, "sync_gbps": 2.5}).wandb()["weights/sync_gbps"] == 2.5


def _checkpointed(out, step: int):
    from vime.state import checkpoint

    path = checkpoint.step_dir(out, step)
    path.mkdir(parents=True)
    (path / checkpoint.STATE).write_bytes(b"x")
    (out / "checkpoints" / "latest").write_text(path.name)
    return path


def test_summary_of_a_complete_run_says_so_and_how_to_extend_it(tmp_path):
    last = _checkpointed(tmp_path, 9)
    lines = report.summary_lines(_records(_rows(10)), tmp_path, None, "/m", steps=10, last_checkpoint=last)
    text = "\n".join(lines)
    assert "run complete     all 10 steps done; to train further: " in text
    assert f"-m vime.train resume={tmp_path.resolve()} steps=20" in text and "continue with" not in text
    stopped = "\n".join(
        report.summary_lines(
            _records(_rows(10)),
            tmp_path,
            None,
            "/m",
            steps=40,  # stop_after
            last_checkpoint=last,
        )
    )
    assert f"(continue with: {report.python_command()} -m vime.train resume={tmp_path.resolve()})" in stopped
    assert "run complete" not in stopped


def test_summary_counts_engine_restarts_and_fits_the_console(tmp_path):
    rows = [r | {"engine_restarts": 1 if r["step"] >= 3 else 0} for r in _rows(6)]
    lines = report.summary_lines(_records(rows), tmp_path, None, "/m", steps=6)
    assert any(line.startswith("  engine restarts  1 ") for line in lines)
    assert not any("engine restarts" in line for line in report.summary_lines(_records(_rows(6)), tmp_path, None, "/m"))
    native = report.summary_lines(_records(_rows(4, mismatch=128, strict=False)), tmp_path, None, "/m")
    fixed = [line for line in lines + native if str(tmp_path) not in line]  # the outputs' paths are the user's
    assert max(len(line) for line in fixed) + len("12:00:00 ") <= 120, max(fixed, key=len)


def test_console_lines_are_short_and_carry_no_colour_codes():
    import logging

    fmt = report.ConsoleFormatter()
    info = logging.LogRecord("vime", logging.INFO, __file__, 1, "step \x1b[36mrow\x1b[39m", None, None)
    warn = logging.LogRecord("vime", logging.WARNING, __file__, 1, "rollout engine 0 died", None, None)
    assert re.fullmatch(r"\d\d:\d\d:\d\d step row", fmt.format(info))
    assert re.fullmatch(r"\d\d:\d\d:\d\d warning: rollout engine 0 died", fmt.format(warn))
    said = "config error: model.path=/m: no config.json"
    bad = logging.LogRecord("vime", logging.ERROR, __file__, 1, said, None, None)
    assert re.fullmatch(r"\d\d:\d\d:\d\d config error: model.path=/m: no config.json", fmt.format(bad))


RAY_INIT_FAILURE = "\n".join(
    [
        "The actor died because of an error raised in its creation task, "
        "\x1b[36mray::rollout-0:RolloutWorker.__init__()"
        "\x1b[39m (pid=20149, ip=127.0.0.1, actor_id=73d2, repr=<vime.rollout.actor.RolloutWorker object at 0x7f2d>)",
        '  File "/x/vllm/engine/arg_utils.py", line 1955, in create_model_config',
        "    return ModelConfig(",
        "           ^^^^^^^^^^^^",
        "TypeError: cannot pickle 'ArgsKwargs' object",
        '  File "/x/pydantic/_internal/_dataclasses.py", line 121, in __init__',
        "    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, User-specified max_model_len (8192) is greater than the derived max_model_len "
        "(max_position_embeddings=4096.0 or model_max_length=None in model's config.json). To allow overriding this "
        "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. [type=value_error]",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ]
)
RAY_PROCESS_DEATH = "\n".join(
    [
        "The actor died unexpectedly before finishing this task.",
        "\tclass_name: RolloutWorker",
        "\tactor_id: 8f3a",
        "\tpid: 4242",
        "\tname: rollout-0",
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of LOG stream is reached. The process may have "
        "been killed by SIGKILL by the OOM killer or by a user; check the raylet logs for more details.",
    ]
)


def test_an_actor_death_is_one_line_with_its_own_cause_first_and_the_log_last(tmp_path):
    cause = report.death_cause(RAY_INIT_FAILURE)
    assert cause.startswith(
        "ValidationError: 1 validation error for ModelConfig Value error, User-specified "
        "max_model_len (8192) is greater than the derived max_model_len"
    )
    assert len(cause) <= 300 and "\x1b" not in cause and "errors.pydantic.dev" not in cause
    assert report.death_cause(RAY_PROCESS_DEATH) == (
        "its process ended (exit detail: Worker unexpectedly exits with a connection error code 2)"
    )
    report.ENGINE_LOG[0] = tmp_path / "engines.log"
    try:
        msg = report.actor_died_message("rollout engine 0", "start", RuntimeError(RAY_INIT_FAILURE))
    finally:
        report.ENGINE_LOG[0] = None
    assert msg.startswith("rollout engine 0 died during 'start': ValidationError: ")
    assert msg.endswith(f"(its log: {tmp_path / 'engines.log'})") and "\n" not in msg


@pytest.mark.slow
def test_the_printed_python_command_runs_as_printed(monkeypatch, tmp_path):
    import os
    import subprocess
    import sys

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a shell where the project's environment is not activated
    monkeypatch.chdir(tmp_path)
    cmd = report.python_command()
    assert cmd == os.path.abspath(sys.executable) or cmd == "python"
    proc = subprocess.run(f"{cmd} -c 'import vime.train'", shell=True, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))))
    assert not report.python_command().startswith("/") or report.python_command() == os.path.abspath(sys.executable)


@pytest.mark.parametrize("compare", [False, True])
def test_plot_run_writes_one_figure(tmp_path, compare):
    twin = _records(_rows(6, mismatch=100, strict=False)) if compare else None
    path = report.plot_run(_records(_rows(6)), tmp_path / "c.png", twin, task="copy")
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
    return {
        "rung": name,
        "side": side,
        "boundary": boundary,
        "mismatch_count": mismatch,
        "tokens": tokens,
        "max_abs_diff": 0.01 * mismatch,
        "worst": None,
        "ran": ["gemm:strict:rl_kernel.gemm.torch.v1[ab]"],
        "error": None,
    }


def _report(base_mismatch: int) -> dict:
    rungs = [
        _rung("base", None, None, base_mismatch),
        _rung("rollout re-score", "rollout", None, 0),
        _rung("rollout:attention", "rollout", "attention", 3),
        _rung("trainer:logprob", "trainer", "logprob", 10),
        _rung("trainer:norm", "trainer", "norm", 0),
    ]
    modes = {"rollout": {"attention": "strict"}, "trainer": {"attention": "strict"}}
    breaking = {"rollout": ["attention"], "trainer": ["logprob"]}
    configured = {"rollout": [], "trainer": ["logprob"] if base_mismatch else []}
    return {
        "samples": 4,
        "tokens": 10,
        "version": 0,
        "model_path": "/m",
        "rollout_engine": "r",
        "trainer_engine": "t",
        "base_modes": modes,
        "base_parity": base_mismatch == 0,
        "breaking": breaking,
        "rungs": rungs,
        "verdict": audit.verdict_text(rungs[0], breaking, configured),
    }


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


def test_an_asynchronous_runs_summary_shows_staleness_and_does_not_say_ratios_are_1(tmp_path):
    """algo.max_staleness=1 algo.correction=tis: 0 mismatches still, but the importance ratios of stale tokens
    reached 6.4; the summary must not say they are exactly 1, and shows the staleness."""
    stale = [
        r
        | {
            "staleness_mean": 0.5,
            "staleness_max": 1,
            "is_ratio_max": 6.4 if r["step"] == 2 else 1.5,
            "is_clip_frac": 0.1,
        }
        for r in _rows(4)
    ]
    lines = "\n".join(report.summary_lines(_records(stale), tmp_path, None, "/m"))
    assert "exactly 1" not in lines and "not 1 where tokens came from older weights" in lines
    assert "  staleness        mean 0.50, max 1 weight version(s) behind; importance ratio max 6.4, clipped" in lines
    on_policy = "\n".join(report.summary_lines(_records(_rows(4)), tmp_path, None, "/m"))
    assert "ratios exactly 1" in on_policy and "staleness " not in on_policy


def test_the_console_row_shows_staleness():
    from vime.reporting.metrics_log import CONSOLE_COLUMNS

    header = report.table_header(CONSOLE_COLUMNS)
    row = report.table_row(CONSOLE_COLUMNS, _records([_rows(1)[0] | {"staleness_mean": 0.75}])[0])
    assert header.split().index("stale") == 7 and row.split()[7] == "0.75"
