"""Fixtures of the vime tests: configs composed by Hydra from the real `configs/` directory."""

from __future__ import annotations

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
