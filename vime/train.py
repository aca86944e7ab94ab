"""`python -m vime.train [overrides]`: the GRPO run (Hydra). With no overrides: a tiny Qwen3 made on the
fly, vLLM rollout + Megatron trainer on CPU, strict mode, a few steps. `+experiment=qwen3_8b_grpo`
gives the GPU cluster shape. Outputs (metrics.jsonl, wandb/, consistency.png, the Hydra log) go to
`output_dir`."""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

from vime.config.schema import config_or_exit, register_configs
from vime.errors import VimeError, one_line
from vime.faults import stops
from vime.loop.record import StepRecord
from vime.state import rundir

# Module level: only what parsing and checking the command line needs (no torch, Ray, vLLM or Megatron), so
# that a bad value is answered within a few seconds; the rest is imported once the config is good.

log = logging.getLogger("vime")
register_configs()


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg = config_or_exit(dcfg)
    from tqdm.contrib.logging import logging_redirect_tqdm

    from vime.loop.driver import Driver  # Ray, vLLM's and Megatron's imports: only once the config is good

    if not cfg.verbose:  # errors are reported once, by the driver, naming the engine or rank
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    code = 0
    driver = None
    stops.install_signal_handlers()
    # console lines go through tqdm.write: a progress bar on a terminal is cleared before each line, not left
    # behind between the per-step rows
    with logging_redirect_tqdm(loggers=[logging.getLogger()]):
        try:
            if cfg.plan:  # the checks and the placement only, no engine (vime/cluster/plan.py)
                driver = Driver(cfg, Path(cfg.output_dir))
                driver.setup()
            else:
                compare = run_compare(cfg)  # `compare=native`: the native twin first (its own dir), then this run
                driver = Driver(cfg, Path(cfg.output_dir))
                driver.run()
                driver.finish(compare)
        except KeyboardInterrupt:  # stops.Stopped, or Ray's re-raise of it from a blocking call
            signum = stops.stop_signal()
            code = 128 + signum
            if driver is not None:
                stops.report_stop(driver, f"{signal.Signals(signum).name}: stopped{stops.stop_note(driver)}")
            else:
                log.warning("%s during start-up: no step ran, nothing was trained", signal.Signals(signum).name)
        except VimeError as e:
            code = 1
            log.error("%s", one_line(e))
            if cfg.verbose and e.__cause__ is not None:  # the actor's own traceback, as Ray reported it
                log.error("".join(traceback.format_exception(e.__cause__)))
            if driver is not None:
                stops.report_stop(driver, "failed")
        finally:
            stops.ignore_signals()
            if driver is not None:
                driver.shutdown(code)
            stops.remove_own_temp_files()
    if code:
        raise SystemExit(code)


def run_compare(cfg) -> list[StepRecord] | None:
    """Steps of the run to plot beside this one: `compare=native` runs the all-native twin of this
    config under `<output_dir>/native` (same seed, same prompts); `compare=<dir>` reads a sibling
    run's metrics.jsonl; unset: None."""
    if not cfg.compare:
        return None
    if cfg.compare != "native":
        from vime.reporting.metrics_log import read_rows

        rundir.check_compare(cfg.compare)  # (checked before the heavy imports too)
        return read_rows(Path(cfg.compare) / "metrics.jsonl")
    from vime.loop.driver import Driver

    twin = copy.deepcopy(cfg)
    twin.rollout.mode = twin.trainer.mode = "native"
    twin.rollout.boundary_modes, twin.trainer.boundary_modes = {}, {}
    twin.output_dir = str(Path(cfg.output_dir) / "native")
    twin.wandb.name = f"{cfg.wandb.name or 'run'}-native"
    log.info("compare=native: running the native twin first, outputs in %s", twin.output_dir)
    driver = Driver(twin, Path(twin.output_dir))
    try:
        return driver.run()
    finally:
        driver.shutdown()


if __name__ == "__main__":
    rundir.check_override_keys(sys.argv[1:])  # a mistyped key: one line, before Hydra composes anything
    rundir.compose_or_exit(sys.argv[1:])  # Hydra's own errors (a value's type, a preset's name): one line too
    sys.exit(main())
