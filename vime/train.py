"""`python -m vime.train [overrides]`: the GRPO run (Hydra). With no overrides: a tiny Qwen3 made on the
fly, vLLM rollout + Megatron trainer on CPU, strict mode, a few steps. `+experiment=qwen3_8b_grpo`
gives the GPU cluster shape. Outputs (metrics.jsonl, wandb/, consistency.png, the Hydra log) go to
`output_dir`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from omegaconf.errors import ValidationError

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
    driver = Driver(cfg, Path(cfg.output_dir))
    try:
        driver.run()
    except VimeError as e:
        log.error("%s: %s", type(e).__name__, e)
        raise SystemExit(1) from None
    finally:
        driver.shutdown()


if __name__ == "__main__":
    sys.exit(main())
