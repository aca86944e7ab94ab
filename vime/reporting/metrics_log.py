"""Per-step metrics: a JSONL file, W&B (offline by default, under the run dir; keys grouped as
`consistency/`, `rollout/`, `train/`, `timing/`, `weights/`, sample completions as a table), a
console table (with a few sample completions every `samples_every` steps), and at the end one
figure (`consistency.png`, `vime.reporting.report.plot_run`)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from vime.reporting import report

log = logging.getLogger("vime")

# GRPO's loss is ~0 by construction (advantages have mean 0 per group), so it is shown in %e; the
# learning signal is the reward, the tied groups (no signal) and the gradient norm.
CONSOLE_COLUMNS = (("step", "{:>4d}"), ("version", "{:>3d}"), ("reward_mean", "{:>7.3f}"), ("tied_groups", "{:>4d}"),
                   ("tokens", "{:>6d}"), ("mismatch_count", "{:>8d}"), ("max_abs_diff", "{:>10.3e}"),
                   ("loss", "{:>10.2e}"), ("grad_norm", "{:>9.3e}"), ("step_s", "{:>7.1f}"))
CONSOLE_NAMES = {"reward_mean": "reward", "tied_groups": "tied", "mismatch_count": "mismatch",
                 "max_abs_diff": "max|diff|", "version": "ver"}


def jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


class MetricsLogger:
    def __init__(self, output_dir: Path, config: dict, wandb_mode: str = "offline", project: str = "vime",
                 name: str | None = None, entity: str | None = None, samples_every: int = 10):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.dir / "metrics.jsonl"
        self.jsonl.write_text("")
        self.rows: list[dict] = []
        self.samples_every = samples_every
        self.run = None
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=project, name=name, entity=entity, mode=wandb_mode, dir=str(self.dir),
                                  config=config, settings=wandb.Settings(console="off", x_disable_stats=True))
            log.info("W&B %s run in %s", wandb_mode, self.run.dir)
        self._header_printed = False

    def log(self, row: dict) -> None:
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps({k: jsonable(v) for k, v in row.items()}) + "\n")
        if self.run is not None:
            import wandb

            data: dict = report.wandb_row(row)
            if row.get("samples"):
                data["rollout/samples"] = wandb.Table(columns=["step", "prompt", "response", "reward"],
                                                      data=[[row["step"], *s] for s in row["samples"]])
            self.run.log(data, step=row["step"])
            for key in report.SUMMARY_KEYS:  # the run's summary: the last step's value and the worst over steps
                self.run.summary[key] = row[key]
            self.run.summary["consistency/total_mismatches"] = sum(int(r["mismatch_count"]) for r in self.rows)
            self.run.summary["consistency/max_abs_diff_over_run"] = max(float(r["max_abs_diff"]) for r in self.rows)
        self._console(row)

    def _console(self, row: dict) -> None:
        names = [CONSOLE_NAMES.get(name, name) for name, _ in CONSOLE_COLUMNS]
        widths = [max(len(n), len(fmt.format(0))) for n, (_, fmt) in zip(names, CONSOLE_COLUMNS)]
        if not self._header_printed:
            log.info(" ".join(n.rjust(w) for n, w in zip(names, widths)))
            self._header_printed = True
        cells = [(fmt.format(row[name]) if row.get(name) is not None else "-").rjust(w)
                 for (name, fmt), w in zip(CONSOLE_COLUMNS, widths)]
        log.info(" ".join(cells))
        if row.get("worst_position") is not None:
            log.info("     worst token: sample %s position %s token %s rollout %r trainer %r",
                     row.get("worst_sample"), row.get("worst_position"), row.get("worst_token_id"),
                     row.get("worst_rollout"), row.get("worst_trainer"))
        if self.samples_every and row.get("samples") and row["step"] % self.samples_every == 0:
            for prompt, response, reward in row["samples"][:2]:
                log.info("     sample: %r -> %r  reward %.2f", prompt, response, reward)

    def plot(self, compare: list[dict] | None = None, task: str = "") -> Path | None:
        """Write `consistency.png` (reward, mismatch_count, max |diff|, worst token; beside `compare`,
        a twin run's rows, when given); returns its path."""
        if not self.rows:
            return None
        path = report.plot_run(self.rows, self.dir / "consistency.png", compare, task=task)
        if self.run is not None:
            import wandb

            self.run.log({"consistency/figure": wandb.Image(str(path))})
        return path

    def close(self, exit_code: int = 0) -> None:
        """Finish the W&B run with the run's true exit code (non-zero marks it failed)."""
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
