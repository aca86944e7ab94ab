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


def wandb_exit_codes(out: Path) -> list[int | None]:
    """The exit code each offline W&B run under `<out>/wandb` recorded, oldest run first (None: the run has
    no exit record: it never finished). Read from the run's `.wandb` file (a LevelDB-style log of
    `wandb_internal_pb2.Record`s: 7-byte file header, 32 KiB blocks, 7-byte chunk headers), whose exit
    record is what `wandb sync` uploads as the run's exit code."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    codes = []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):  # names start with the start time
        data, pos, chunk, code = path.read_bytes(), 7, b"", None
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            size, kind = struct.unpack("<HB", data[pos + 4:pos + 7]) if left >= 7 else (0, 0)
            if left < 7 or (size == 0 and kind == 0):  # block trailer / zero padding
                pos += left
                continue
            chunk, pos = chunk + data[pos + 7:pos + 7 + size], pos + 7 + size
            if kind in (1, 4):  # a full record, or the last chunk of one
                record = pb.Record()
                record.ParseFromString(chunk)
                chunk = b""
                if record.WhichOneof("record_type") == "exit":
                    code = record.exit.exit_code
        codes.append(code)
    return codes
