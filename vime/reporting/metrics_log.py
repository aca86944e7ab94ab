"""Per-step metrics from the step records (`vime.loop.record.StepRecord`): a JSONL file, W&B (offline by
default, under the run dir; keys grouped as the record's groups `consistency/`, `rollout/`, `train/`,
`timing/`, `weights/`, `offpolicy/`, sample completions as a table), a console table (with a few sample
completions every `samples_every` steps), and at the end one figure (`consistency.png`,
`vime.reporting.report.plot_run`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from vime.loop.record import StepRecord
from vime.reporting import report

log = logging.getLogger("vime")

# GRPO's loss is ~0 by construction (advantages have mean 0 per group), so it is shown in %e; the
# learning signal is the reward, the tied groups (no signal) and the gradient norm.
CONSOLE_COLUMNS = (
    ("step", "{:>4d}", lambda r: r.step),
    ("ver", "{:>3d}", lambda r: r.weights.version),
    ("reward", "{:>7.3f}", lambda r: r.rollout.reward_mean),
    ("tied", "{:>4d}", lambda r: r.rollout.tied_groups),
    ("tokens", "{:>6d}", lambda r: r.consistency.tokens),
    ("mismatch", "{:>8d}", lambda r: r.consistency.mismatch_count),
    ("max|diff|", "{:>10.3e}", lambda r: r.consistency.max_abs_diff),
    ("stale", "{:>5.2f}", lambda r: r.offpolicy.staleness_mean),  # weight versions behind, mean of the step
    ("loss", "{:>10.2e}", lambda r: r.train.loss),
    ("grad_norm", "{:>9.3e}", lambda r: r.train.grad_norm),
    ("step_s", "{:>7.1f}", lambda r: r.timing.step_s),
)


def read_rows(path: Path) -> list[StepRecord]:
    """The step records of a run's metrics.jsonl."""
    return [StepRecord.from_row(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


def write_rows(path: Path, rows: list[StepRecord]) -> None:
    """`path` (a metrics.jsonl) holding exactly `rows`, one JSON line each."""
    path.write_text("".join(json.dumps(r.row()) + "\n" for r in rows))


class MetricsLogger:
    def __init__(
        self,
        output_dir: Path,
        config: dict,
        wandb_mode: str = "offline",
        project: str = "vime",
        name: str | None = None,
        entity: str | None = None,
        samples_every: int = 10,
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.dir / "metrics.jsonl"
        self.jsonl.write_text("")
        self.rows: list[StepRecord] = []
        self.samples_every = samples_every
        self.run = None
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=project,
                name=name,
                entity=entity,
                mode=wandb_mode,
                dir=str(self.dir),
                config=config,
                settings=wandb.Settings(console="off", x_disable_stats=True),
            )
            log.info("W&B %s run in %s", wandb_mode, self.run.dir)
        self._header_printed = False

    def log(self, record: StepRecord) -> None:
        self.rows.append(record)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record.row()) + "\n")
        if self.run is not None:
            import wandb

            data: dict = record.wandb()
            if record.samples:
                data["rollout/samples"] = wandb.Table(
                    columns=["step", "prompt", "response", "reward"], data=[[record.step, *s] for s in record.samples]
                )
            self.run.log(data, step=record.step)
            # the run's summary: the last step's parity and the totals over the run
            self.run.summary["mismatch_count"] = record.consistency.mismatch_count
            self.run.summary["max_abs_diff"] = record.consistency.max_abs_diff
            self.run.summary["consistency/total_mismatches"] = sum(r.consistency.mismatch_count for r in self.rows)
            self.run.summary["consistency/max_abs_diff_over_run"] = max(r.consistency.max_abs_diff for r in self.rows)
        self._console(record)

    def _console(self, record: StepRecord) -> None:
        if not self._header_printed:
            log.info(report.table_header(CONSOLE_COLUMNS))
            self._header_printed = True
        log.info(report.table_row(CONSOLE_COLUMNS, record))
        c = record.consistency
        if c.worst_position is not None:
            log.info(
                "     worst token: sample %s position %s token %s rollout %r trainer %r",
                c.worst_sample,
                c.worst_position,
                c.worst_token_id,
                c.worst_rollout,
                c.worst_trainer,
            )
        if self.samples_every and record.samples and record.step % self.samples_every == 0:
            for prompt, response, reward in record.samples[:2]:
                log.info("     sample: %r -> %r  reward %.2f", prompt, response, reward)

    def plot(self, compare: list[StepRecord] | None = None, task: str = "") -> Path | None:
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
