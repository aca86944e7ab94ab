"""What a person reads after a run: the figure, the end-of-run summary, sample completions and the
no-learning-signal warning (pure functions over the run's step records, `vime.loop.record.StepRecord`)."""

from __future__ import annotations

import logging
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from vime.cluster.remote import (  # noqa: F401 - actor deaths and where engine output goes (report.death_cause, ...)
    ANSI,
    ENGINE_LOG,
    actor_died_message,
    death_cause,
    engine_log_hint,
    route_engine_output,
)
from vime.loop.record import StepRecord, tied_groups
from vime.reporting.commands import python_command, resume_command  # noqa: F401 - printed commands (report.python_command)


def no_signal_warning(step: int, rewards: Sequence[float], group_size: int) -> str | None:
    """A warning line when every group of the step is tied, else None."""
    n_groups = len(rewards) // group_size
    if n_groups and tied_groups(rewards, group_size) == n_groups:
        values = sorted({round(r, 4) for r in rewards})
        return (
            f"step {step}: no learning signal: every one of the {n_groups} groups has tied rewards "
            f"(values {values[:4]}{' ...' if len(values) > 4 else ''}), so all advantages are 0 and this "
            "update does not change the policy; if it persists, the task is too hard or already solved "
            "at this temperature (try another task, more samples per group, or a higher temperature)"
        )
    return None


def no_signal_count(steps: Sequence[int]) -> str:
    """The summary's note of the steps whose groups all tied ('' when none)."""
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    return f"; no learning signal (every group tied) on {len(steps)} steps: {shown}"


# ---- the figure -------------------------------------------------------------------------------


def _series(values) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def _label(rows: Sequence[StepRecord]) -> str:
    return "strict" if rows and rows[0].strict else "native"


def plot_run(
    rows: Sequence[StepRecord],
    path: Path,
    compare: Sequence[StepRecord] | None = None,
    task: str = "",
    title_extra: str = "",
) -> Path:
    """One figure for a run (and, when given, its twin in the other mode): reward per step (0..1),
    mismatch_count per step (integer axis from 0), max |diff| per step (log axis when any is
    non-zero; exact zeros drawn on the floor and labelled), and the worst token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = [(rows, _label(rows))] + ([(compare, _label(compare))] if compare else [])
    colors = {"strict": "#2b8a3e", "native": "#c92a2a"}
    fig = plt.figure(figsize=(11, 7.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.25, 1], hspace=0.42, wspace=0.22)
    ax_r = fig.add_subplot(grid[0, :])
    ax_m = fig.add_subplot(grid[1, 0])
    ax_d = fig.add_subplot(grid[1, 1])

    for rs, label in runs:
        steps = [r.step for r in rs]
        mean, std = _series(r.rollout.reward_mean for r in rs), _series(r.rollout.reward_std for r in rs)
        ls = "-" if rs is rows else "--"
        ax_r.plot(steps, mean, ls, marker="o", ms=3, color=colors[label], label=f"{label}: mean reward")
        if rs is rows:  # one band only: two overlapping bands hide both curves
            ax_r.fill_between(
                steps,
                [max(0, m - s) for m, s in zip(mean, std)],
                [min(1, m + s) for m, s in zip(mean, std)],
                color=colors[label],
                alpha=0.12,
            )
    ax_r.set_ylim(0, 1.02)
    ax_r.set_ylabel("reward (0..1)")
    ax_r.set_xlabel("step")
    first, last = rows[0].rollout.reward_mean, rows[-1].rollout.reward_mean
    ax_r.set_title(
        f"reward{f' on {task}' if task else ''}: {first:.2f} -> {last:.2f} "
        f"(band: ± std over the {_label(rows)} run's samples)",
        fontsize=10,
    )
    ax_r.legend(loc="upper left", fontsize=8)

    max_tokens = 1
    for rs, label in runs:
        steps = [r.step for r in rs]
        counts = [r.consistency.mismatch_count for r in rs]
        max_tokens = max(max_tokens, *(r.consistency.tokens for r in rs))
        ax_m.plot(steps, counts, marker="o", ms=3, color=colors[label], label=label)
        if label == "native":
            ax_m.plot(steps, [r.consistency.tokens for r in rs], ":", color="grey", lw=1, label="tokens compared")
    top = max(max(r.consistency.mismatch_count for r in rs) for rs, _ in runs)
    if any(label == "native" for _, label in runs):
        top = max(top, max_tokens)
    ax_m.set_ylim(0, max(1, top) * 1.12 + 0.5)
    ax_m.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_m.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_m.set_ylabel("tokens whose fp32 bits differ")
    ax_m.set_xlabel("step")
    ax_m.set_title("mismatch_count (0 = rollout == trainer, bit for bit)", fontsize=10)
    ax_m.legend(fontsize=8)

    positive = [
        d for rs, _ in runs for d in _series(r.consistency.max_abs_diff for r in rs) if d > 0 and math.isfinite(d)
    ]
    floor = min(positive) / 10 if positive else None
    for rs, label in runs:
        steps = [r.step for r in rs]
        diffs = _series(r.consistency.max_abs_diff for r in rs)
        if floor is not None:
            zero = all(d == 0 for d in diffs)
            ax_d.plot(
                steps,
                [d if d > 0 else floor for d in diffs],
                marker="o",
                ms=3,
                color=colors[label],
                label=f"{label}: exactly 0 (drawn on the floor)" if zero else label,
            )
        else:
            ax_d.plot(steps, diffs, marker="o", ms=3, color=colors[label], label=label)
    if floor is not None:
        ax_d.set_yscale("log")
        ax_d.set_ylim(floor / 2, max(positive) * 3)
    else:
        ax_d.set_ylim(-0.05, 1)
        ax_d.text(
            0.5,
            0.5,
            "0 on every step\n(no token differs)",
            transform=ax_d.transAxes,
            ha="center",
            fontsize=10,
            color=colors["strict"],
        )
    ax_d.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_d.set_xlabel("step")
    ax_d.set_title("max |rollout - trainer| logprob", fontsize=10)
    ax_d.legend(fontsize=8, loc="best")

    worst = _worst_token(runs)
    total, mism = _tokens(rows), _mismatches(rows)
    twin = f"; {_label(compare)} twin: {_mismatches(compare)} of {_tokens(compare)}" if compare else ""
    fig.suptitle(
        f"vime: {_label(rows)} run, {len(rows)} steps, {mism} of {total} tokens differ (rollout vs "
        f"trainer logprob bits){twin}{title_extra}",
        fontsize=11.5,
    )
    fig.text(0.5, 0.005, worst, ha="center", fontsize=8.5, family="monospace")
    fig.subplots_adjust(top=0.9, bottom=0.1, left=0.07, right=0.98)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _tokens(rows: Sequence[StepRecord]) -> int:
    return sum(r.consistency.tokens for r in rows)


def _mismatches(rows: Sequence[StepRecord]) -> int:
    return sum(r.consistency.mismatch_count for r in rows)


def _worst_token(runs) -> str:
    parts = []
    for rs, label in runs:
        cands = [r for r in rs if r.consistency.worst_position is not None]
        if not cands:
            parts.append(f"{label}: no token differs")
            continue
        r = max(cands, key=lambda x: x.consistency.max_abs_diff)
        c = r.consistency
        parts.append(
            f"{label} worst token: step {r.step} sample {c.worst_sample} position {c.worst_position} "
            f"token {c.worst_token_id}: rollout {c.worst_rollout:.7g} vs trainer {c.worst_trainer:.7g}"
        )
    return "   |   ".join(parts)


class ConsoleFormatter(logging.Formatter):
    """The console's log lines: `HH:MM:SS message`, the level named only from WARNING up (not before a bad
    input's `config error: ...`, which says what it is), colour codes removed (train.log keeps Hydra's full
    format). Hydra's job_logging uses it (configs/config.yaml)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if record.levelno >= logging.WARNING and not record.getMessage().startswith("config error: "):
            stamp, _, rest = line.partition(" ")
            line = f"{stamp} {record.levelname.lower()}: {rest}"
        return ANSI.sub("", line)


# ---- the end-of-run summary ----------------------------------------------------------------------


def _gb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e9


# The per-step table of the summary: (header, format, value of a record).
STEP_COLUMNS = (
    ("step", "{:>4d}", lambda r: r.step),
    ("tokens", "{:>6d}", lambda r: r.consistency.tokens),
    ("mismatch", "{:>8d}", lambda r: r.consistency.mismatch_count),
    ("max|diff|", "{:>9.2e}", lambda r: r.consistency.max_abs_diff),
    ("rollout_s", "{:>9.2f}", lambda r: r.timing.rollout_s),
    ("score_s", "{:>7.2f}", lambda r: r.timing.score_s),
    ("train_s", "{:>7.2f}", lambda r: r.timing.train_s),
    ("sync_s", "{:>6.2f}", lambda r: r.timing.sync_s),
    ("sync_GB", "{:>7.3f}", lambda r: _gb(r.weights.sync_bytes)),
    ("sync_GB/s", "{:>9.2f}", lambda r: r.weights.sync_gbps),
    ("step_s", "{:>6.2f}", lambda r: r.timing.step_s),
)


def table_cell(value, fmt: str) -> str:
    """`value` in `fmt` (an integer format takes it as int), '-' when the step did not measure it."""
    if value is None:
        return "-"
    return fmt.format(int(value) if fmt.endswith("d}") else float(value))


def table_header(columns) -> str:
    """The header line of a table of (header, format, value of a record) columns."""
    return " ".join(h.rjust(w) for (h, _, _), w in zip(columns, _widths(columns)))


def table_row(columns, record: StepRecord) -> str:
    """One record's line under `table_header(columns)`; a value the step did not measure shows as '-'."""
    return " ".join(table_cell(get(record), f).rjust(w) for (_, f, get), w in zip(columns, _widths(columns)))


def _widths(columns) -> list[int]:
    return [max(len(h), len(f.format(0))) for h, f, _ in columns]


def step_table(rows: Sequence[StepRecord], max_rows: int = 12) -> list[str]:
    """Per-step phase timings and weight-sync rate, one line per step (the first and last `max_rows // 2`
    steps of a longer run); a missing value shows as '-'."""
    shown = list(rows) if len(rows) <= max_rows else [*rows[: max_rows // 2], None, *rows[-(max_rows // 2) :]]
    return ["  " + table_header(STEP_COLUMNS)] + [
        "  ..." if r is None else "  " + table_row(STEP_COLUMNS, r) for r in shown
    ]


def staleness_line(rows: Sequence[StepRecord]) -> str | None:
    """The summary's staleness line when any token was sampled by weights older than the trainer's (the
    asynchronous loop): staleness mean / max in weight versions and the importance ratios it brought; None
    when every token was on-policy (the ratios are then exactly 1 wherever the bits agree)."""
    worst = max((r.offpolicy.staleness_max or 0 for r in rows), default=0)
    if not worst:
        return None
    means = [r.offpolicy.staleness_mean for r in rows if r.offpolicy.staleness_mean is not None]
    ratios = [r.offpolicy.is_ratio_max for r in rows if r.offpolicy.is_ratio_max is not None]
    clipped = [r.offpolicy.is_clip_frac for r in rows if r.offpolicy.is_clip_frac is not None]
    return (
        f"  staleness        mean {sum(means) / max(1, len(means)):.2f}, max {worst} weight version(s) behind"
        + (f"; importance ratio max {max(ratios):.3g}" if ratios else "")
        + (f", clipped/masked share {sum(clipped) / len(clipped):.3f}" if clipped else "")
    )


SUMMARY_WIDTH = 110  # the summary's lines fit 120 columns with the console's `HH:MM:SS ` prefix


def summary_lines(
    rows: Sequence[StepRecord],
    output_dir: Path,
    plot: Path | None,
    model_path: str | None,
    compare: Sequence[StepRecord] | None = None,
    steps: int | None = None,
    last_checkpoint: Path | None = None,
    no_signal_steps: Sequence[int] = (),
) -> list[str]:
    """The closing block: steps, tokens compared, mismatches and what 0 means, reward first -> last,
    time per step, engine restarts, where the outputs are, and what to do next: a run that did all its
    `steps` is complete (extend it with more `steps`); one stopped early continues from its last checkpoint
    (`last_checkpoint`, None when it saved none). `no_signal_steps`: the steps whose groups all tied."""
    if not rows:
        return ["no step ran"]
    tokens, mism = _tokens(rows), _mismatches(rows)
    worst = max(r.consistency.max_abs_diff for r in rows)
    step_s = sorted(r.timing.step_s or 0.0 for r in rows)
    k = max(1, len(rows) // 5)
    head = sum(r.rollout.reward_mean for r in rows[:k]) / k
    tail = sum(r.rollout.reward_mean for r in rows[-k:]) / k
    mode = _label(rows)
    stale = staleness_line(rows)
    if mism == 0 and stale:
        meaning = (
            "0: the trainer recomputed the exact fp32 bits the engine sampled with; the importance ratios are "
            "not 1 where tokens came from older weights (staleness below)"
        )
    elif mism == 0:
        meaning = "0: the trainer recomputed the exact fp32 bits the engine sampled with (ratios exactly 1)"
    else:
        meaning = (
            f"{mism} tokens' rollout and trainer logprobs differ in bits (max |diff| {worst:.3e}): the "
            "update's importance ratios carry that numeric drift"
        )
    lines = [
        f"run summary ({mode})",
        f"  steps            {len(rows)} (weight versions 0 -> {rows[-1].weights.next_version})",
        f"  tokens compared  {tokens} (every active response token, every step)",
        f"  mismatches       {mism} in total, {sum(1 for r in rows if r.consistency.mismatch_count)} steps with any; "
        f"max |diff| {worst:.3e}",
        *textwrap.wrap(meaning, width=SUMMARY_WIDTH, initial_indent=" " * 19, subsequent_indent=" " * 19),
        f"  reward           {rows[0].rollout.reward_mean:.3f} -> {rows[-1].rollout.reward_mean:.3f} "
        f"(mean of first {k} "
        f"steps {head:.3f}, last {k} steps {tail:.3f}){no_signal_count(no_signal_steps)}",
        f"  time per step    median {step_s[len(step_s) // 2]:.2f} s (min {step_s[0]:.2f}, max {step_s[-1]:.2f})",
    ]
    if stale:
        lines.append(stale)
    restarts = rows[-1].engine_restarts
    if restarts:
        lines.append(f"  engine restarts  {restarts} (dead rollout engines restarted, their share of the step redone)")
    lines += ["  per step (seconds; sync in GB of weights and GB/s):", *step_table(rows, max_rows=4)]
    if compare:
        lines.append(
            f"  {_label(compare)} twin      {_mismatches(compare)} of {_tokens(compare)} tokens differ "
            f"over {len(compare)} steps"
        )
    lines += [
        f"  outputs          {output_dir} (metrics.jsonl, train.log, wandb/)",
        f"  figure           {plot}" if plot else "  figure           -",
        f"  model            {model_path} (the starting weights)",
    ]
    last = last_checkpoint
    done = rows[-1].step + 1
    if last is not None and steps is not None and done >= steps:
        lines.append(f"  checkpoint       {last}")
        lines.append(
            f"  run complete     all {steps} steps done; to train further: "
            f"{resume_command(output_dir)} steps={done + done}"
        )
    elif last is not None:
        lines.append(f"  checkpoint       {last} (continue with: {resume_command(output_dir)})")
    return lines
