"""Per-step metrics: a JSONL file, W&B (offline by default, under the run dir), a console table, and a
PNG plot of mismatch_count / max_abs_diff / reward at the end of the run."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger("vime")

CONSOLE_COLUMNS = (("step", "{:>4d}"), ("version", "{:>3d}"), ("reward_mean", "{:>7.3f}"), ("tokens", "{:>6d}"),
                   ("mismatch_count", "{:>8d}"), ("max_abs_diff", "{:>10.3e}"), ("mean_abs_diff", "{:>10.3e}"),
                   ("loss", "{:>9.4f}"), ("grad_norm", "{:>9.3e}"),
                   ("step_s", "{:>7.1f}"))


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


class MetricsLogger:
    def __init__(self, output_dir: Path, config: dict, wandb_mode: str = "offline", project: str = "vime",
                 name: str | None = None, entity: str | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.dir / "metrics.jsonl"
        self.jsonl.write_text("")
        self.rows: list[dict] = []
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
            f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=row["step"])
        self._console(row)

    def _console(self, row: dict) -> None:
        widths = [max(len(name), len(fmt.format(0))) for name, fmt in CONSOLE_COLUMNS]
        if not self._header_printed:
            log.info(" ".join(name.rjust(w) for (name, _), w in zip(CONSOLE_COLUMNS, widths)))
            self._header_printed = True
        cells = [(fmt.format(row[name]) if row.get(name) is not None else "-").rjust(w)
                 for (name, fmt), w in zip(CONSOLE_COLUMNS, widths)]
        log.info(" ".join(cells))
        if row.get("worst_position") is not None:
            log.info("     worst token: sample %s position %s token %s rollout %r trainer %r",
                     row.get("worst_sample"), row.get("worst_position"), row.get("worst_token_id"),
                     row.get("worst_rollout"), row.get("worst_trainer"))

    def plot(self) -> Path | None:
        """Write `consistency.png` (per-step mismatch_count, max_abs_diff, reward); returns its path."""
        if not self.rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        steps = [r["step"] for r in self.rows]
        fig, axes = plt.subplots(3, 1, figsize=(6, 7), sharex=True)
        for ax, key in zip(axes, ("mismatch_count", "max_abs_diff", "reward_mean")):
            ax.plot(steps, [r.get(key, float("nan")) for r in self.rows], marker="o")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("step")
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.suptitle("rollout vs trainer logprobs")
        fig.tight_layout()
        path = self.dir / "consistency.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        if self.run is not None:
            import wandb

            self.run.log({"consistency_plot": wandb.Image(str(path))})
        return path

    def close(self, exit_code: int = 0) -> None:
        """Finish the W&B run with the run's true exit code (non-zero marks it failed)."""
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
