"""The run directory, settled before Hydra creates it (a Hydra callback, `hydra.callbacks.run_dir`).

- A new run never writes into a directory that holds a run (at least one logged step, or a
  checkpoint): it is refused with a message that offers `resume=<dir>` (when that run has a
  checkpoint) or a new `output_dir`. A directory that holds only what a start that failed before
  its first step left (`.hydra/`, `train.log`, `model/`, ...) is no run: it is cleaned and reused,
  so the retry after fixing a bad value is the same command. A directory with files vime did not
  write is refused.
- An override of a key the schema does not have (`stpes=3`) is answered with one line naming the
  nearest valid key, before Hydra composes anything (`check_override_keys`).
- `resume=` of a run that has done all its steps is refused with how to extend it (`steps=N`),
  before any engine starts.
- `resume=<dir>` runs the config that run recorded (`checkpoints/config.yaml`) in that same
  directory; only the keys in `RESUMABLE` may be given again (e.g. more `steps`). Hydra writes this
  invocation's own `.hydra/` files under `.hydra/resume-<time>/`; train.log continues.
- The config is validated here too, so a bad value leaves no directory behind.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import shutil
import sys
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from vime.config import preflight
from vime.config.schema import VimeConfig, to_object, validate
from vime.errors import ConfigError, VimeError
from vime.reporting.commands import resume_command

RESUMABLE = (
    "steps",
    "checkpoint.stop_after",
    "checkpoint.every",
    "checkpoint.export_hf",
    "checkpoint.final",
    "checkpoint.on_stop",
    "checkpoint.on_stop_s",
    "verbose",
    "wandb.mode",
)


# What a run writes in its output_dir. A directory holding only these, with no logged step and no
# checkpoint, is what a start that failed (or was stopped) before its first step left behind.
RUN_ENTRIES = frozenset(
    {
        ".hydra",
        "train.log",
        "engines.log",
        "model",
        "wandb",
        "metrics.jsonl",
        "checkpoints",
        "consistency.png",
        "hf_model",
        "native",
        "audit.json",
        "audit.png",
    }
)


def logged_steps(output_dir: Path) -> int:
    """Steps the run in `output_dir` logged (lines of its metrics.jsonl, its native twin's included)."""
    n = 0
    for metrics in (output_dir / "metrics.jsonl", output_dir / "native" / "metrics.jsonl"):
        if metrics.is_file():
            n += sum(1 for line in metrics.read_text().splitlines() if line.strip())
    return n


def refuse_existing(output_dir: Path) -> None:
    """SystemExit when `output_dir` holds a run (a logged step or a checkpoint) or files vime did not
    write; a directory left by a start that never completed a step is emptied for reuse (one line on
    stderr says so)."""
    from vime.state import checkpoint  # torch: imported once the command line is known to be good

    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return
    entries = sorted(p.name for p in output_dir.iterdir())
    held = ", ".join(entries[:6])
    if (output_dir / checkpoint.CHECKPOINTS / checkpoint.LATEST).is_file():
        raise SystemExit(
            f"config error: output_dir={output_dir} already holds a run ({held}); vime never overwrites one: continue "
            f"that run with `{continue_command(output_dir)}`, or pass a new output_dir=..."
        )
    steps = logged_steps(output_dir)
    if steps:
        raise SystemExit(
            f"config error: output_dir={output_dir} already holds a run of {steps} logged step(s) ({held}) and no "
            "checkpoint to resume from; vime never overwrites a run: pass a new output_dir=..."
        )
    foreign = [e for e in entries if e not in RUN_ENTRIES]
    if foreign:
        raise SystemExit(
            f"config error: output_dir={output_dir} holds files vime did not write ({', '.join(foreign[:6])}); "
            "pass an empty or new output_dir=..."
        )
    for entry in entries:
        path = output_dir / entry
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    print(
        f"output_dir={output_dir} held a start that never completed a step ({held}): cleaned, starting there",
        file=sys.stderr,
    )


# ---- override keys ---------------------------------------------------------------------------------------


def schema_keys(schema: type = VimeConfig, prefix: str = "") -> tuple[set[str], set[str]]:
    """(every dotted key of the schema, the dict-valued keys whose sub-keys are free)."""
    keys, free = set(), set()
    for f in dataclasses.fields(schema):
        name = f"{prefix}{f.name}"
        keys.add(name)
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            more, more_free = schema_keys(sub, f"{name}.")
            keys |= more
            free |= more_free
        elif sub is dict:
            free.add(name)
    return keys, free


def _config_groups() -> set[str]:
    """Hydra config groups under configs/ (`+experiment=...`)."""
    configs = Path(__file__).resolve().parents[2] / "configs"  # configs/ at the repository root
    return {p.name for p in configs.iterdir() if p.is_dir()} if configs.is_dir() else set()


def unknown_override(override: str, keys: set[str], free: set[str], groups: set[str]) -> str | None:
    """The one-line error for a command-line override whose key the schema lacks, else None."""
    if override.startswith("-") or "=" not in override:
        return None
    key = override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
    if not key or key.startswith("hydra") or "/" in key or key in groups or key in keys:
        return None
    if any(key.startswith(f"{k}.") for k in free):
        return None
    near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.75)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return (
        f"config error: unknown config key {key}{hint}; `python -m vime.train --cfg job` lists every key "
        "(vime/config/schema.py documents them)"
    )


def check_override_keys(argv: list[str]) -> None:
    """SystemExit with one line when an override names a key the schema does not have (Hydra would answer
    a plain `stpes=3` with a suggestion to add it as `+stpes=3`, which is then refused anyway)."""
    keys, free = schema_keys()
    groups = _config_groups()
    for arg in argv:
        error = unknown_override(arg, keys, free, groups)
        if error:
            raise SystemExit(error)


CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # vime.train's Hydra config dir (configs/ at the root)


def compose_or_exit(argv: list[str], config_dir: Path = CONFIGS) -> None:
    """Compose the config of these command-line overrides as `@hydra.main` will, and answer Hydra's own errors
    (a value of the wrong type or not in an enum, a preset that does not exist, an override it cannot parse)
    with one line, `config error: <override>: <what>; <what to do>`, instead of Hydra's report and its
    HYDRA_FULL_ERROR hint. Hydra's own flags (`--cfg job`, `-m`, ...) are left to Hydra."""
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    from vime.config.schema import register_configs

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            compose("config", argv, return_hydra_config=True)
    except MissingConfigException as e:
        raise SystemExit(missing_preset_line(argv, config_dir, e)) from None
    except OverrideParseException as e:
        first = str(e).splitlines()
        raise SystemExit(
            f"config error: {first[0]}: {first[1] if len(first) > 1 else 'not key=value'}; write overrides as "
            "key=value (quote values with spaces: key='a b')"
        ) from None
    except HydraException as e:
        raise SystemExit(override_error_line(argv, e)) from None


def override_error_line(argv: list[str], error: Exception) -> str:
    """One line for Hydra's error merging an override: the override, the first line of what OmegaConf said,
    and what the key takes (its schema default as an example)."""
    cause = error.__cause__
    key = getattr(cause, "full_key", None) or ""
    given = next((a for a in argv if _key(a).split("@", 1)[0] == key), key)
    what = (getattr(cause, "msg", None) or str(cause or error)).splitlines()[0]
    keys, free = schema_keys()
    parent = key.rpartition(".")[0]
    if parent in free and "not in struct" in what:  # a new key of a free dict (rollout.boundary_modes.attention)
        return free_key_line(given, parent)
    default = OmegaConf.select(OmegaConf.structured(VimeConfig), key, default=None) if key in keys else None
    hint = f"give {key} a value of its type (its default: {key}={_plain(default)})" if key in keys else ""
    return f"config error: {given}: {what}" + (f"; {hint}" if hint else "")


def free_key_line(given: str, parent: str) -> str:
    """A `parent.name=value` override of a dict-valued key: Hydra needs `+` to add a name. For the
    per-boundary modes the name and value are checked here, so the answer is the fix."""
    name, _, value = given.lstrip("+").partition("=")
    name = name.rsplit(".", 1)[1]
    if parent.endswith("boundary_modes"):
        from vime.config.schema import BOUNDARIES, Mode

        if name not in BOUNDARIES:
            return f"config error: {given}: {name!r} is no boundary; use one of {', '.join(BOUNDARIES)}"
        if value not in [m.value for m in Mode]:
            return f"config error: {given}: Invalid value {value!r}, expected one of [strict, native]"
    return f"config error: {given}: {parent} starts empty, so a name is added with +; write +{given.lstrip('+')}"


def missing_preset_line(argv: list[str], config_dir: Path, error: Exception) -> str:
    """One line for a config group option (`+experiment=...`) that does not exist: the presets there are."""
    text = str(error)
    for arg in argv:
        group, _, option = arg.lstrip("+~").partition("=")
        folder = config_dir / group
        if folder.is_dir() and not (folder / f"{option}.yaml").is_file():
            names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
            return f"config error: {arg}: no preset {option!r} in configs/{group}/; use one of: {names}"
    return f"config error: {text.splitlines()[0]}"


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def apply_resume(config: DictConfig, overrides: list[str]) -> None:
    """Replace the composed job config by the one the run in `config.resume` recorded, keeping the
    `RESUMABLE` keys given on this command line."""
    from vime.state import checkpoint  # torch: imported once the command line is known to be good

    run = Path(config.resume)
    saved = checkpoint.saved_config(run)
    given = {_key(o) for o in overrides} - {"resume"}
    bad = sorted(given - set(RESUMABLE))
    if bad:
        raise ConfigError(
            f"resume= continues a run with its own config, so {', '.join(bad)} cannot be set "
            f"(allowed with resume=: {', '.join(RESUMABLE)}); start a new run to change them"
        )
    keep = {k: OmegaConf.select(config, k) for k in given}
    for key, value in saved.items():
        OmegaConf.update(config, key, value, merge=isinstance(value, dict))
    for key, value in keep.items():
        OmegaConf.update(config, key, value, merge=False)
    config.resume = str(run)
    config.output_dir = str(run)
    refuse_complete(run, int(config.steps), bool(config.checkpoint.export_hf))
    config.hydra.output_subdir = f".hydra/resume-{time.strftime('%Y%m%d-%H%M%S')}"


def continue_command(run: Path) -> str:
    """The command that continues the run in `run` (it has a checkpoint): `resume=<run>`, with more `steps=`
    when that run has done all its steps (a plain resume of it is refused: `refuse_complete`)."""
    from vime.state import checkpoint

    try:
        done = int(checkpoint.load_state(checkpoint.latest(run))["next_step"])
        saved = int(checkpoint.saved_config(run).get("steps", 0))
    except (checkpoint.CheckpointError, TypeError, KeyError, ValueError):
        return resume_command(run)  # an unreadable checkpoint: the resume names what is wrong with it
    return resume_command(run) + (f" steps={done + max(done, 1)}" if done >= saved else "")


def refuse_complete(run: Path, steps: int, export_hf: bool) -> None:
    """ConfigError when the run in `run` has done all `steps` (and its export), so `resume=` would start
    engines to run no step: say it is complete and how to extend it."""
    from vime.state import checkpoint  # torch: imported once the command line is known to be good

    last = checkpoint.latest(run)
    if last is None:
        return  # `checkpoint.resume_point` says there is nothing to resume
    checkpoint.check_files(last)  # every file the resume reads, before any heavy import (again in resume_point)
    done = int(checkpoint.load_state(last)["next_step"])
    exported = not export_hf or (run / checkpoint.HF_DIR / "model.safetensors").is_file()
    if done >= steps and exported:
        raise ConfigError(
            f"resume={run}: that run is complete ({done} steps done, steps={steps}); to train it "
            f"further give more steps: {resume_command(run)} steps={done + max(done, 1)}"
        )


def check(config: DictConfig) -> None:
    """The job config (the composed config without `hydra`) passes the schema, `validate` and every check that
    needs no engine and no Ray: a CUDA device (first), the resources a local Ray would have, W&B online, the
    model's context, `model.path`'s files and tensor shapes (the device, context and shapes import torch), and
    the data, reward function and compare run it names (`check_inputs`)."""
    job = copy.deepcopy(config)
    with read_write(job), open_dict(job):
        del job["hydra"]
    cfg = validate(to_object(job))
    preflight.check_device(cfg)  # before the resources: without CUDA they lack GPUs too, but device=cpu is the fix
    preflight.check_new_tokens(cfg)
    preflight.check_local_resources(cfg)
    preflight.check_wandb(cfg)
    preflight.check_context(cfg)
    if cfg.model.path:  # a dir with config.json, its files and every tensor's shape against config.json
        preflight.check_checkpoint(Path(cfg.model.path))
    check_inputs(cfg)


def check_inputs(cfg: VimeConfig) -> None:
    """The files and functions a run reads besides the model, named before any heavy import or model is made:
    data.path's and eval.path's files exist (their rows are read later), reward.fn imports and takes (prompt,
    response, label, metadata), compare=<dir> holds a metrics.jsonl. One-line DataError / ConfigError."""
    from vime.data import files, rewards

    for key, path in (("data.path", cfg.data.path), ("eval.path", cfg.eval.path)):
        if path:
            files.resolve(path, key)
    rewards.resolve(rewards.absolute(cfg.reward.fn), cfg.reward.pattern)
    check_compare(cfg.compare)


def check_compare(compare: str | None) -> None:
    """`compare=<dir>` names a run's output_dir (its metrics.jsonl); `native` and unset need nothing."""
    if compare and compare != "native" and not (Path(compare) / "metrics.jsonl").is_file():
        raise ConfigError(f"compare={compare}: no metrics.jsonl there; pass compare=native or a run's output_dir")


def check_writable(output_dir: Path) -> None:
    """ConfigError (one line) when `output_dir` cannot be made or written in: its nearest existing ancestor is a
    regular file, or creating a file there fails (read-only, no permission). Checked by writing, not by mode
    bits, which root and read-only mounts make lie. (Hydra would fail later in its log handler.)"""
    probe = Path(output_dir).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"output_dir={output_dir}: {probe} is a file, not a directory; pass an output_dir=... in a directory"
        )
    try:
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as e:
        raise ConfigError(
            f"output_dir={output_dir}: cannot write in {probe} ({e.strerror}); pass an output_dir=... in a "
            "directory you can write"
        ) from None


def prepare(config: DictConfig) -> None:
    """Settle `output_dir` (and the config, for resume=) before Hydra creates the directory."""
    with read_write(config), open_dict(config):
        if config.get("resume"):
            apply_resume(config, list(config.hydra.overrides.task))
        else:
            config.output_dir = str(config.output_dir)  # resolve ${now:...} once: the checked dir is the one used
            check_writable(Path(config.output_dir))
            refuse_existing(Path(config.output_dir))
    check(config)


class RunDirGuard(Callback):
    """Hydra callback: `prepare` the run dir and config at `on_run_start`, before Hydra writes anything."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            prepare(config)
        except (VimeError, OmegaConfBaseException) as e:
            raise SystemExit(f"config error: {e}") from None
