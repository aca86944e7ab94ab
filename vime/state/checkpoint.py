"""Checkpoints and resume: nothing a run has done is lost.

Layout under `<output_dir>`:

    checkpoints/config.yaml          the run's resolved config (what `resume=<output_dir>` runs again)
    checkpoints/step_<k>/trainer/    the trainer's native distributed checkpoint: Megatron
                                     dist-checkpointing (model + optimizer, every rank writes its shards)
    checkpoints/step_<k>/rng/        RNG states of every trainer rank
    checkpoints/step_<k>/state.pt    driver state: next step, the prompt stream's position and epoch
                                     order (`data`), weight version,
                                     metrics so far, driver RNG states, the W&B run id; an asynchronous
                                     run (algo.max_staleness >= 1) adds its rollouts in flight (`async`)
    checkpoints/step_<k>/kept/       an asynchronous run's kept weight versions older than the
                                     checkpoint's (version_<v>.pt, HF-named, the trainer's bits)
    checkpoints/latest               name of the last complete checkpoint, written last (atomic rename):
                                     a step dir it does not name is an interrupted save and is ignored
    hf_model/                        HF safetensors export of the final weights (+ config, tokenizer):
                                     model.safetensors, or shards with model.safetensors.index.json

A checkpoint is taken after step k's weight sync, so it holds weight version k + 1 and resume starts
at step k + 1. Rollout sampling is seeded per (seed, step, engine), so a resumed run draws the same
samples as one that never stopped; the test `tests/vime/test_resume.py` asserts equal bits.

An asynchronous run has rollouts in flight at a checkpoint: those of steps k+1 .. k+N, submitted before
step k trained. The save waits for them to finish (a step boundary: what they hold does not depend on when
they are collected) and records their samples, with every token's weight version, and their rl_kernel
evidence; the trainer records the kept versions it needs to re-score them (`kept/`). A resumed run collects
them as the uninterrupted run does, so it continues exactly (`tests/vime/test_async_e2e.py`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import random
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vime.errors import VimeError
from vime.loop.record import StepRecord
from vime.reporting.commands import resume_command

log = logging.getLogger("vime")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE = "state.pt"
KEPT = "kept"  # an asynchronous run's kept weight versions
HF_DIR = "hf_model"
# metrics that measure wall time: they differ between any two runs, resumed or not
TIMING_KEYS = ("rollout_s", "score_s", "train_s", "step_s", "sync_s", "sync_gbps", "sleep_s", "wake_s")
_HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


class CheckpointError(VimeError):
    """A checkpoint is missing, incomplete or does not belong to this run (the message names the path)."""

    bad_input = True  # what `resume=` points at


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step_{step:06d}"


def latest(output_dir: Path) -> Path | None:
    """The last complete checkpoint of the run in `output_dir`, or None when it has none."""
    pointer = Path(output_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / STATE).is_file():
        raise CheckpointError(
            f"{pointer} names {path}, which has no {STATE}: the checkpoint is damaged; "
            "point it at an earlier step_* directory or start a new run"
        )
    return path


def is_due(every: int, step: int, steps: int, final: bool = True) -> bool:
    """Save after `step`? Every `every` steps (0: never in between) and after the last step (unless not `final`)."""
    return (final and step == steps - 1) or (every > 0 and (step + 1) % every == 0)


# ---- driver side ------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU, and CUDA when present) RNG states of this process."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_config(output_dir: Path, config: dict) -> None:
    """Record the run's resolved config once (`resume=` reads it back)."""
    from omegaconf import OmegaConf

    path = Path(output_dir) / CHECKPOINTS / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), path)


def saved_config(output_dir: Path) -> dict:
    """The config a run recorded with `save_config`; CheckpointError if it has none."""
    from omegaconf import OmegaConf

    path = Path(output_dir) / CHECKPOINTS / "config.yaml"
    if not path.is_file():
        raise CheckpointError(
            f"resume={output_dir}: no {path} (not a vime run dir, or it stopped before its "
            "first step); pass the output_dir of a run that saved a checkpoint"
        )
    return OmegaConf.to_container(OmegaConf.load(path))


def save(driver, step: int, rows: list[StepRecord], wandb_id: str | None) -> Path:
    """Checkpoint the run after `step` (collective over the trainer ranks); returns the step dir. The
    steps' records are kept as their metrics.jsonl rows."""
    path = step_dir(driver.output_dir, step)
    if path.exists():
        shutil.rmtree(path)  # an earlier save of this step that never completed (no `latest` names it)
    (path / "trainer").mkdir(parents=True)
    loop = getattr(driver, "async_loop", None)
    in_flight = loop.state() if loop is not None else None  # waits for the rollouts in flight
    driver._call(driver.trainer, "save_checkpoint", "save checkpoint", str(path), trainer=True)
    state = {
        "next_step": step + 1,
        "version": driver.timeline.trainer_version,
        "rows": [r.row() for r in rows],
        "rng": rng_state(),
        "wandb_id": wandb_id,
        "prompt_batches": getattr(driver, "prompt_batches", step + 1),  # the data position (vime.loop.sampling)
        "data": driver.prompts.state_dict(),  # the prompt stream's position and the epoch's order
    }
    if in_flight is not None:
        state["async"] = in_flight
    torch.save(state, path / STATE)
    pointer = path.parent / LATEST
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(path.name)
    os.replace(tmp, pointer)
    log.info("checkpoint: %s (weight version %d, resume at step %d)", path, state["version"], step + 1)
    return path


def resume_point(cfg, output_dir: Path) -> Path | None:
    """The checkpoint a `resume=` run continues from (None for a new run). Also points W&B at the
    run's own W&B run id, so its history continues there."""
    if not cfg.resume:
        return None
    path = latest(output_dir)
    if path is None:
        raise CheckpointError(
            f"resume={cfg.resume}: {Path(output_dir) / CHECKPOINTS} holds no complete checkpoint "
            "(the run stopped before its first save); start a new run instead"
        )
    state = load_state(path)
    check_resumable(cfg, state, path)
    check_files(path)
    wandb_id = state.get("wandb_id")
    if wandb_id:
        os.environ["WANDB_RUN_ID"], os.environ["WANDB_RESUME"] = wandb_id, "allow"
    return path


def check_files(path: Path) -> None:
    """CheckpointError naming the first file of checkpoint `path` that a resume would read and could not: every
    torch file (state, each rank's RNG, kept versions, the reference trainer's state) must be a whole zip
    archive, and the trainer's distributed checkpoint (Megatron torch_dist: `.metadata`, `metadata.json`, the
    `*.distcp` shards) must hold every byte range its metadata lists. Checked before any engine starts (a
    truncated shard would otherwise fail as an EOFError deep in the trainer's load, minutes later); reads the
    archives' directories and the shards' sizes, not their data."""
    path = Path(path)
    fix = f"resume from an earlier step_* dir (edit {path.parent / LATEST}) or start a new run"
    for file in sorted(path.rglob("*.pt")):
        _check_zip(file, fix)
    trainer = path / "trainer"
    if (trainer / "metadata.json").is_file():
        try:
            json.loads((trainer / "metadata.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {trainer / 'metadata.json'}: {e}; {fix}") from None
    if (trainer / ".metadata").is_file():
        _check_distcp(trainer, fix)


def _check_zip(file: Path, fix: str) -> None:
    """`file` (torch.save's zip format) has its central directory and every member inside the file."""
    try:
        size = file.stat().st_size
        with zipfile.ZipFile(file) as z:
            end = max((i.header_offset + i.compress_size for i in z.infolist()), default=0)
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"{file} is damaged or truncated ({size_or(file)} bytes: {e}); {fix}") from None
    if end > size:
        raise CheckpointError(f"{file} is truncated: its contents need {end} bytes, the file has {size}; {fix}")


def _check_distcp(trainer: Path, fix: str) -> None:
    """Every shard file the torch.distributed.checkpoint `.metadata` of `trainer` lists holds its byte ranges."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(trainer)).read_metadata().storage_data or {}
    except Exception as e:  # noqa: BLE001 - any failure to read it is a damaged file, named as such
        raise CheckpointError(f"cannot read {trainer / '.metadata'} ({type(e).__name__}: {e}); {fix}") from None
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, end in sorted(need.items()):
        size = size_or(trainer / name)
        if size is None:
            raise CheckpointError(f"{trainer / name} is missing (listed in {trainer / '.metadata'}); {fix}")
        if size < end:
            raise CheckpointError(f"{trainer / name} is truncated: it needs {end} bytes, the file has {size}; {fix}")


def size_or(file: Path) -> int | None:
    """The size of `file` in bytes, None when it cannot be read."""
    try:
        return Path(file).stat().st_size
    except OSError:
        return None


def check_resumable(cfg, state: dict[str, Any], path: Path) -> None:
    """CheckpointError (one line, what to do) unless checkpoint `path` (its driver `state`) holds what `cfg`'s
    loop needs to continue exactly: an asynchronous run (algo.max_staleness = N >= 1) its rollouts in flight,
    saved at the same N, and the trainer's kept versions before the checkpoint's; a synchronous run none."""
    from vime.config.schema import kept_versions

    n, saved = cfg.algo.max_staleness, state.get("async")
    if saved is None and n >= 1:
        raise CheckpointError(
            f"{path} holds no rollouts in flight (saved by a synchronous run, or by a vime that did "
            f"not save them), so this run with algo.max_staleness={n} cannot continue from it "
            "exactly: start a new run"
        )
    if saved is not None and saved["max_staleness"] != n:
        raise CheckpointError(
            f"{path} was saved by a run with algo.max_staleness={saved['max_staleness']}, this run "
            f"has algo.max_staleness={n}: its rollouts in flight were scheduled for that bound; "
            f"set algo.max_staleness={saved['max_staleness']} back in "
            f"{Path(path).parent / 'config.yaml'} or start a new run"
        )
    if n >= 1:
        version = int(state["version"])
        missing = [
            v for v in range(max(0, version + 1 - kept_versions(cfg)), version) if not kept_path(path, v).is_file()
        ]
        if missing:
            raise CheckpointError(
                f"{path} lacks the kept weight versions {missing} ({Path(path) / KEPT}) that its "
                "rollouts in flight are re-scored under: the checkpoint is incomplete; resume from "
                f"an earlier step_* dir (edit {Path(path).parent / LATEST}) or start a new run"
            )


def after_step(driver, step: int, rows: list[StepRecord]) -> bool:
    """Run after each step's metrics are logged: save a checkpoint when due, export the final weights
    after the last step. Returns True when the run stops here (`checkpoint.stop_after`)."""
    c, steps = driver.cfg.checkpoint, driver.cfg.steps
    last = step == steps - 1
    stop = c.stop_after is not None and step == c.stop_after and not last
    if stop or is_due(c.every, step, steps, c.final):
        run = getattr(driver.logger, "run", None)
        save(driver, step, rows, run.id if run is not None else None)
    if last and c.export_hf:
        tensors = driver._call(driver.trainer, "export_hf", "export weights", trainer=True)[0]
        export_hf(tensors, driver.model_path, driver.output_dir)
    if stop:
        driver.stopped_after = step
        log.info(
            "stopped after step %d (checkpoint.stop_after=%d); continue with: %s",
            step,
            step,
            resume_command(driver.output_dir),
        )
    return stop


def load_state(path: Path) -> dict[str, Any]:
    try:
        return torch.load(Path(path) / STATE, weights_only=False)
    except (OSError, EOFError, RuntimeError) as e:
        raise CheckpointError(
            f"cannot read {Path(path) / STATE}: {e}; resume from an earlier step_* dir (edit "
            f"{Path(path).parent / LATEST}) or start a new run"
        ) from e


def restore(driver, path: Path) -> dict[str, Any]:
    """Load checkpoint `path` into a started driver: trainer model + optimizer + RNG, the weight
    version, rollout engines synced to it, the driver's RNG. Returns the saved driver state."""
    from vime.cluster.remote import BUCKET_BYTES, call
    from vime.weights.sync import sync_weights

    state = load_state(path)
    versions = driver._call(driver.trainer, "load_checkpoint", "load checkpoint", str(path), trainer=True)
    if any(v != state["version"] for v in versions):
        raise CheckpointError(
            f"{path}: trainer ranks restored versions {versions}, the driver state says {state['version']}"
        )
    driver.timeline.trainer_version = state["version"]
    driver.timeline.step = state["next_step"]
    # over each engine's weight path, as a step's sync: a vLLM engine on CUDA takes no object-store weights
    sync_weights(
        driver.trainer,
        driver.engines,
        state["version"],
        BUCKET_BYTES,
        driver.timeline,
        call,
        driver.weight_paths,
        driver.cfg.rollout.engine,
    )
    set_rng_state(state["rng"])
    if "data" in state:  # (a checkpoint of a vime before dataset files has none: its task batches are by step)
        driver.prompts.load_state_dict(state["data"])
    log.info("resumed from %s: weight version %d, next step %d", path, state["version"], state["next_step"])
    if (
        state["next_step"] >= driver.cfg.steps
        and driver.cfg.checkpoint.export_hf
        and not hf_exported(driver.output_dir)
    ):
        # the run was stopped between its last checkpoint and the export: only the export is left
        tensors = driver._call(driver.trainer, "export_hf", "export weights", trainer=True)[0]
        export_hf(tensors, driver.model_path, driver.output_dir)
    return state


def restore_metrics(logger, rows: list[dict]) -> None:
    """Put the metrics of the steps before the checkpoint (their saved rows) back into a fresh
    `MetricsLogger` (its metrics.jsonl then holds exactly those steps: steps after the checkpoint are run
    again)."""
    from vime.reporting.metrics_log import write_rows

    logger.rows.extend(StepRecord.from_row(row) for row in rows)
    write_rows(logger.jsonl, logger.rows)


HF_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default: checkpoints above it are sharded
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # one file, or the shards' index


def export_hf(
    tensors: dict[str, torch.Tensor], model_path: str, output_dir: Path, max_shard_size: int | str = HF_MAX_SHARD_SIZE
) -> Path:
    """Write `tensors` (HF names, full, the trainer's bits) to `<output_dir>/hf_model` as Hugging Face
    writes a checkpoint (`huggingface_hub.save_torch_state_dict`): `model.safetensors`, or shards of at
    most `max_shard_size` (bytes, or a string such as "5GB") with `model.safetensors.index.json`; the
    source checkpoint's config and tokenizer files go next to them."""
    from huggingface_hub import save_torch_state_dict

    # its "successfully saved" line, said again below; huggingface_hub names that logger by the file's path
    logging.getLogger(inspect.getfile(save_torch_state_dict)).setLevel(logging.WARNING)
    out = Path(output_dir) / HF_DIR
    out.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict({k: v.detach().cpu() for k, v in tensors.items()}, out, max_shard_size=max_shard_size)
    for name in _HF_SIDE_FILES:
        if (Path(model_path) / name).is_file():
            shutil.copy2(Path(model_path) / name, out / name)
    log.info("final weights: %s (HF safetensors)", out)
    return out


def hf_exported(output_dir: Path) -> bool:
    """Whether `<output_dir>/hf_model` holds an exported checkpoint (its weights file or shard index)."""
    return any((Path(output_dir) / HF_DIR / name).is_file() for name in HF_WEIGHT_FILES)


# ---- trainer side (inside the trainer actors) ---------------------------------------------------


@contextlib.contextmanager
def _cpu_checkpointing() -> Iterator[None]:
    """Megatron's torch_dist strategy (0.16) assumes CUDA in two places: `torch.cuda.synchronize()`
    before it writes (waiting for the device-to-host copy of GPU shards) and a failure flag it
    all-reduces on `torch.cuda.current_device()`. With no CUDA there is nothing to wait for and the
    flag lives on the CPU (gloo): for the duration of the call, synchronize is a no-op and the
    current device is the CPU (a labelled workaround; with CUDA nothing changes)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _megatron_sharded(policy, loading: bool) -> dict:
    from rl_kernel.integrations.megatron._cpu import cuda_as_cpu

    model_sd = policy.model.sharded_state_dict()
    with cuda_as_cpu():
        optim_sd = policy.optimizer.sharded_state_dict(model_sd, is_loading=loading)
    return {"model": model_sd, "optimizer": optim_sd, "policy_steps": policy.steps}


def save_megatron(policy, path: Path) -> None:
    """Megatron dist-checkpointing save of model + optimizer (collective over the policy's ranks)."""
    from megatron.core import dist_checkpointing

    with _cpu_checkpointing():
        dist_checkpointing.save(_megatron_sharded(policy, loading=False), str(path))


def load_megatron(policy, path: Path) -> None:
    """Load what `save_megatron` wrote into a freshly built policy of the same shape (collective)."""
    from megatron.core import dist_checkpointing

    from rl_kernel.integrations.megatron._cpu import cuda_as_cpu

    if not (Path(path) / "metadata.json").is_file():
        raise CheckpointError(f"{path} is not a Megatron distributed checkpoint (no metadata.json)")
    with _cpu_checkpointing():
        state = dist_checkpointing.load(_megatron_sharded(policy, loading=True), str(path))
    policy.model.load_state_dict(state["model"])
    with cuda_as_cpu():
        policy.optimizer.load_state_dict(state["optimizer"])
    policy.steps = int(state["policy_steps"])


def kept_path(path: Path, version: int) -> Path:
    return Path(path) / KEPT / f"version_{version}.pt"


def save_kept(path: Path, kept: dict[int, dict[str, torch.Tensor]], current: int) -> None:
    """Write the kept weight versions older than `current` (its weights are the checkpoint's own) under
    checkpoint `path` (`kept/version_<v>.pt`: HF names, the tensors' bits). Run by trainer rank 0 only."""
    (Path(path) / KEPT).mkdir(parents=True, exist_ok=True)
    for version, tensors in kept.items():
        if version != current:
            torch.save({k: v.cpu() for k, v in tensors.items()}, kept_path(path, version))


def load_kept(path: Path, device: str | torch.device = "cpu") -> dict[int, dict[str, torch.Tensor]]:
    """The kept weight versions `save_kept` wrote under checkpoint `path` ({} when it wrote none), on `device`."""
    files = sorted((Path(path) / KEPT).glob("version_*.pt"))
    return {int(f.stem.removeprefix("version_")): torch.load(f, weights_only=True, map_location=device) for f in files}


def save_rank_rng(path: Path, rank: int) -> None:
    (Path(path) / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), Path(path) / "rng" / f"rank{rank}.pt")


def load_rank_rng(path: Path, rank: int) -> None:
    set_rng_state(torch.load(Path(path) / "rng" / f"rank{rank}.pt", weights_only=False))
