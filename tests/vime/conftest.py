"""Fixtures of the vime tests: configs composed by Hydra from the real `configs/` directory."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import pytest
from hydra import compose, initialize_config_dir

from vime.config.schema import register_configs

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


Listener = tuple[str, str, int]  # (process name, bound address, port) of a listening socket


class SampledRun(NamedTuple):
    out: Path  # its output_dir
    proc: subprocess.CompletedProcess  # the finished process (stdout and stderr captured apart)
    listeners: dict[Listener, str]  # every listening socket its process tree had, sampled while it ran: cmdline
    temp_seen: set[str]  # what its run temporary directory (/tmp/vime_tmp_<pid>) held, sampled while it ran
    pids: set[int]  # every process of its tree, sampled while it ran
    pid: int  # its driver's pid

    def rows(self) -> list[dict]:
        import json

        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]

    @property
    def console(self) -> str:
        return self.proc.stdout + self.proc.stderr


def _sample_listeners(
    pid: int,
    listeners: dict[Listener, str],
    done: threading.Event,
    temp_seen: set[str] | None = None,
    pids: set[int] | None = None,
) -> None:
    """Every 0.5 s until `done`: each listening inet socket of process `pid` and its descendants (and, when
    given, the names in its run temporary directory and the pids of its tree)."""
    import psutil

    while not done.is_set():
        if temp_seen is not None:
            with contextlib.suppress(OSError):
                temp_seen.update(os.listdir(f"/tmp/vime_tmp_{pid}"))
        if pids is not None:
            with contextlib.suppress(psutil.Error):
                pids.update(p.pid for p in psutil.Process(pid).children(recursive=True))
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    for c in p.net_connections(kind="inet"):
                        if c.status == psutil.CONN_LISTEN:
                            listeners[(p.name(), c.laddr.ip, c.laddr.port)] = " ".join(p.cmdline())[:120]
        done.wait(0.5)


def sampled_run(out: Path, *overrides: str, timeout: int = 840) -> SampledRun:
    """`python -m vime.train output_dir=<out> <overrides>` to its end, with the listening sockets, temporary
    files and processes of its whole process tree sampled while it runs."""
    listeners: dict[Listener, str] = {}
    temp_seen: set[str] = set()
    pids: set[int] = set()
    proc = subprocess.Popen(
        train_cmd(f"output_dir={out}", *overrides),
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    done = threading.Event()
    sampler = threading.Thread(target=_sample_listeners, args=(proc.pid, listeners, done, temp_seen, pids), daemon=True)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        done.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return SampledRun(
        out,
        subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
        listeners,
        temp_seen,
        pids,
        proc.pid,
    )


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> SampledRun:
    """The main job exactly as a new user runs it (`python -m vime.train`, the default config: 40 steps, strict),
    sampled while it runs. Shared by the learning, e2e and loopback checks, so the suite runs it once."""
    return sampled_run(tmp_path_factory.mktemp("default") / "run")


@pytest.fixture(scope="session")
def native_run(tmp_path_factory) -> SampledRun:
    """The default run's all-native twin (vLLM's and Megatron's own kernels), 2 steps."""
    out = tmp_path_factory.mktemp("native") / "run"
    return sampled_run(out, "steps=2", "rollout.mode=native", "trainer.mode=native")


@pytest.fixture(scope="session")
def strict_run(tmp_path_factory) -> SampledRun:
    """The default config for 2 steps with `compare=native` (the native twin runs first in the same invocation,
    under `<out>/native`): the uninterrupted twin of the resume and asynchronous runs (opt-in sets)."""
    return sampled_run(tmp_path_factory.mktemp("strict") / "run", "steps=2", "compare=native")


def alive(pids: set[int]) -> list[str]:
    """Those of `pids` still running (not zombies), as 'pid name'."""
    import psutil

    left = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:80]}")
    return left


def run_files_left(pid: int) -> list[str]:
    """The rendezvous files and the run temporary directory of the driver `pid` that still exist."""
    import glob

    return glob.glob(f"/tmp/vime_rdzv_{pid}_*") + glob.glob(f"/tmp/vime_tmp_{pid}")


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
            size, kind = struct.unpack("<HB", data[pos + 4 : pos + 7]) if left >= 7 else (0, 0)
            if left < 7 or (size == 0 and kind == 0):  # block trailer / zero padding
                pos += left
                continue
            chunk, pos = chunk + data[pos + 7 : pos + 7 + size], pos + 7 + size
            if kind in (1, 4):  # a full record, or the last chunk of one
                record = pb.Record()
                record.ParseFromString(chunk)
                chunk = b""
                if record.WhichOneof("record_type") == "exit":
                    code = record.exit.exit_code
        codes.append(code)
    return codes
