"""`python -m vime.train [overrides]`: the GRPO run (Hydra). With no overrides: a tiny Qwen3 made on the
fly, vLLM rollout + Megatron trainer on CPU, strict mode, a few steps. `+experiment=qwen3_8b_grpo`
gives the GPU cluster shape. Outputs (metrics.jsonl, wandb/, consistency.png, the Hydra log) go to
`output_dir`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig
from omegaconf.errors import ValidationError

from vime import faults
from vime.config import register_configs, to_object, validate
from vime.driver import Driver
from vime.errors import ConfigError, VimeError

log = logging.getLogger("vime")
register_configs()


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    try:
        cfg = validate(to_object(dcfg))
    except (ValidationError, ConfigError) as e:
        raise SystemExit(f"config error: {e}") from None
    if not cfg.verbose:  # errors are reported once, by the driver, naming the engine or rank
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    driver = Driver(cfg, Path(cfg.output_dir))
    code = 0
    faults.install_signal_handlers()
    try:
        driver.run()
    except KeyboardInterrupt:  # faults.Stopped, or Ray's re-raise of it from a blocking call
        signum = faults.stop_signal()
        code = 128 + signum
        faults.report_stop(driver, f"{signal.Signals(signum).name}: stopped")
    except VimeError as e:
        code = 1
        log.error("%s: %s", type(e).__name__, e)
        if cfg.verbose and e.__cause__ is not None:  # the actor's own traceback, as Ray reported it
            log.error("".join(traceback.format_exception(e.__cause__)))
        faults.report_stop(driver, "failed")
    finally:
        faults.ignore_signals()
        driver.shutdown(code)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    sys.exit(main())
