"""Fixtures of the vime tests: configs composed by Hydra from the real `configs/` directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from vime.config import register_configs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> DictConfig, exactly as `python -m vime.train` builds it."""
    register_configs()

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    return _compose


REPO = CONFIGS.parent
TRAIN_ENV = {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}


def train_cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "vime.train", *overrides]


@pytest.fixture(scope="session")
def strict_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The default strict run, 2 steps, uninterrupted: (output_dir, the finished process). Shared by
    the e2e checks and the resume test (its uninterrupted twin), so the suite runs it once."""
    out = tmp_path_factory.mktemp("strict") / "run"
    proc = subprocess.run(train_cmd("steps=2", f"output_dir={out}"), cwd=REPO, env=os.environ | TRAIN_ENV,
                          capture_output=True, text=True, timeout=420)
    return out, proc
