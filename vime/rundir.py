"""The run directory, settled before Hydra creates it (a Hydra callback, `hydra.callbacks.run_dir`).

- A new run never writes into a directory that already holds something: it is refused with a
  message that offers `resume=<dir>` (when that run has a checkpoint) or a new `output_dir`.
- `resume=<dir>` runs the config that run recorded (`checkpoints/config.yaml`) in that same
  directory; only the keys in `RESUMABLE` may be given again (e.g. more `steps`). Hydra writes this
  invocation's own `.hydra/` files under `.hydra/resume-<time>/`; train.log continues.
- The config is validated here too, so a bad value leaves no directory behind.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from vime import checkpoint
from vime.config import to_object, validate
from vime.errors import ConfigError, VimeError

RESUMABLE = ("steps", "checkpoint.stop_after", "checkpoint.every", "checkpoint.export_hf", "checkpoint.final",
             "verbose", "wandb.mode")


def refuse_existing(output_dir: Path) -> None:
    """SystemExit when `output_dir` exists and is not empty."""
    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return
    held = ", ".join(sorted(p.name for p in output_dir.iterdir())[:6])
    if (output_dir / checkpoint.CHECKPOINTS / checkpoint.LATEST).is_file():
        offer = f"continue that run with `{checkpoint.resume_command(output_dir)}`, or pass a new output_dir=..."
    else:
        offer = "it has no checkpoint to resume from: pass a new output_dir=... (or remove that directory)"
    raise SystemExit(f"output_dir={output_dir} already holds a run ({held}); vime never overwrites one: {offer}")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def apply_resume(config: DictConfig, overrides: list[str]) -> None:
    """Replace the composed job config by the one the run in `config.resume` recorded, keeping the
    `RESUMABLE` keys given on this command line."""
    run = Path(config.resume)
    saved = checkpoint.saved_config(run)
    given = {_key(o) for o in overrides} - {"resume"}
    bad = sorted(given - set(RESUMABLE))
    if bad:
        raise ConfigError(f"resume= continues a run with its own config, so {', '.join(bad)} cannot be set "
                          f"(allowed with resume=: {', '.join(RESUMABLE)}); start a new run to change them")
    keep = {k: OmegaConf.select(config, k) for k in given}
    for key, value in saved.items():
        OmegaConf.update(config, key, value, merge=isinstance(value, dict))
    for key, value in keep.items():
        OmegaConf.update(config, key, value, merge=False)
    config.resume = str(run)
    config.output_dir = str(run)
    config.hydra.output_subdir = f".hydra/resume-{time.strftime('%Y%m%d-%H%M%S')}"


def check(config: DictConfig) -> None:
    """The job config (the composed config without `hydra`) passes the schema and `validate`."""
    job = copy.deepcopy(config)
    with read_write(job), open_dict(job):
        del job["hydra"]
    validate(to_object(job))


def prepare(config: DictConfig) -> None:
    """Settle `output_dir` (and the config, for resume=) before Hydra creates the directory."""
    with read_write(config), open_dict(config):
        if config.get("resume"):
            apply_resume(config, list(config.hydra.overrides.task))
        else:
            config.output_dir = str(config.output_dir)  # resolve ${now:...} once: the checked dir is the one used
            refuse_existing(Path(config.output_dir))
    check(config)


class RunDirGuard(Callback):
    """Hydra callback: `prepare` the run dir and config at `on_run_start`, before Hydra writes anything."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            prepare(config)
        except (VimeError, OmegaConfBaseException) as e:
            raise SystemExit(f"config error: {e}") from None
