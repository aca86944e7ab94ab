"""Bad data, reward and template inputs stop a run with one line, before any engine starts: `Driver.setup` raises
before Ray (in-process, every case), and `python -m vime.train` prints that one line and exits 1 (one case)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.config.schema import to_object, validate
from vime.data import examples
from vime.errors import ConfigError, DataError
from vime.loop.driver import Driver

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def data(tmp_path) -> Path:
    (tmp_path / "two.py").write_text("def score(prompt, response):\n    return 1.0\n")
    return examples.write_jsonl(examples.gsm8k_rows(8, 0), tmp_path / "train.jsonl")


def _cases(data: Path) -> dict[str, tuple[tuple[str, ...], type, str]]:
    keys = (f"data.path={data}", "data.prompt_key=question", "reward.fn=math")
    return {
        "missing file": ((f"data.path={data.parent / 'nope.jsonl'}", "reward.fn=math"), DataError, "no such file"),
        "missing key": ((f"data.path={data}", "reward.fn=math"), DataError, r"no column 'prompt' \(data.prompt_key\)"),
        "too long": ((*keys, "data.max_prompt_tokens=3"), DataError, "every prompt is longer than data.max_prompt"),
        "signature": (
            (*keys[:2], f"reward.fn={data.parent / 'two.py'}:score"),
            ConfigError,
            r"has signature \(prompt, response\); a reward function takes",
        ),
        "not importable": ((*keys[:2], "reward.fn=no_such_pkg.x:score"), ConfigError, "cannot import no_such_pkg.x"),
        "no template": ((*keys, "data.chat_template=true"), DataError, "has no chat template"),
        "eval file": ((*keys, f"eval.path={data.parent / 'none.jsonl'}"), DataError, r"eval.path=.*no such file"),
    }


@pytest.mark.parametrize(
    "case", ["missing file", "missing key", "too long", "signature", "not importable", "no template", "eval file"]
)
def test_bad_input_is_refused_before_ray_starts(compose_cfg, data, tmp_path, tiny_qwen3_path, case):
    import ray

    overrides, error, match = _cases(data)[case]
    run = (f"output_dir={tmp_path / 'run'}", f"model.path={tiny_qwen3_path}")  # a plain tokenizer: no chat template
    cfg = validate(to_object(compose_cfg(*overrides, *run)))
    with pytest.raises(error, match=match) as e:
        Driver(cfg, tmp_path / "run").setup()
    assert "\n" not in str(e.value) and not ray.is_initialized()


@pytest.mark.slow
def test_the_cli_prints_one_line_and_exits_1(data, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "vime.train", f"output_dir={tmp_path / 'run'}", f"data.path={data}", "reward.fn=math"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"},
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    lines = [line for line in text.splitlines() if "config error: " in line]
    assert len(lines) == 1, text[-3000:]
    assert "no column 'prompt' (data.prompt_key); the file has ['question', 'answer', 'id']" in lines[0]
    assert "Traceback" not in text and "rollout engine" not in text, text[-3000:]
