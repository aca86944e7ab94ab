"""Synchronous vs asynchronous GRPO (`algo.max_staleness`): tokens per second, reward, staleness, ratio, mismatches.

Runs `python -m vime.train` once per staleness bound with the same config and seed (default: the embedded CPU
config) and reads each run's metrics.jsonl. Prints a table, writes JSON (and, with --figure, a PNG of the
asynchronous run: reward beside the synchronous run's, staleness, importance ratio, mismatches).

    python benchmarks/async_overlap.py --steps 40 --out benchmarks/results/async_overlap_cpu.json \\
        --figure docs/async_run.png
    python benchmarks/async_overlap.py --steps 5 --staleness 0 1 -- +experiment=h200_8b_layers   # on an H200

Throughput counts the response tokens trained per second of step time (`step_s`, rollout + re-scoring +
train + sync), steps 1.. (step 0 starts the pipeline). On the 2-core CPU machine the rollout engine and the
trainer share the same two cores, so overlapping them cannot give much: the number shows the loop overlaps
(a step costs about the longer of rollout and train plus sync, not their sum) only when they have their own
devices.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_KEY = "run_key.json"  # beside wall_s.txt in a finished run's dir: what `reusable` compares


def run_key(overrides: list[str]) -> dict:
    """What a finished run's results depend on: the checkout's commit, a digest of its uncommitted changes (empty
    when clean) and the vime.train overrides (those of this script, then the user's)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout  # noqa: E731
    diff = git("diff", "HEAD")
    return {
        "commit": git("rev-parse", "HEAD").strip() or "unknown",
        "uncommitted": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else "",
        "overrides": list(overrides),
    }


def reusable(out: Path, key: dict) -> bool:
    """Whether `out` (--workdir) holds a finished run made with `key` (reuse it); False when it holds none.
    SystemExit when it holds one of another commit or other arguments (or one that recorded no key): its
    numbers would be reported as this run's."""
    if not (out / "wall_s.txt").is_file():
        return False
    recorded = json.loads((out / RUN_KEY).read_text()) if (out / RUN_KEY).is_file() else None
    if recorded == key:
        return True
    differ = sorted(k for k in key if recorded is None or recorded.get(k) != key[k])
    theirs = {k: (recorded or {}).get(k) for k in differ}
    raise SystemExit(
        f"{out} holds a finished run of other settings ({', '.join(differ)} differ: it has {theirs}, this run "
        f"{ {k: key[k] for k in differ} }); pass another --workdir, or remove {out} to run it again"
    )


def run(out: Path, staleness: int, steps: int, extra: list[str]) -> tuple[list[dict], float]:
    """(rows, wall seconds) of one run; a finished run already in `out` (--workdir) of the same commit and
    arguments is read, not run again (`reusable`)."""
    done = out / "wall_s.txt"
    overrides = [
        f"steps={steps}",
        f"output_dir={out}",
        f"algo.max_staleness={staleness}",
        "checkpoint.final=false",
        "checkpoint.export_hf=false",
        *extra,
    ]
    if staleness:
        overrides.append("algo.correction=tis")
    key = run_key(overrides)
    if reusable(out, key):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], float(done.read_text())
    env = os.environ | {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "vime.train", *overrides], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL
    )
    wall = time.perf_counter() - t0
    (out / RUN_KEY).write_text(json.dumps(key) + "\n")
    done.write_text(f"{wall}\n")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], wall


def summary(rows: list[dict], wall: float) -> dict:
    steady = rows[1:] or rows
    tokens, seconds = sum(r["tokens"] for r in steady), sum(r["step_s"] for r in steady)
    return {
        "steps": len(rows),
        "wall_s": wall,
        "step_s_mean": seconds / len(steady),
        "tokens_per_s": tokens / seconds,
        "rollout_s_mean": sum(r["rollout_s"] for r in steady) / len(steady),
        "train_s_mean": sum(r["train_s"] for r in steady) / len(steady),
        "reward_first": rows[0]["reward_mean"],
        "reward_last5": sum(r["reward_mean"] for r in rows[-5:]) / min(5, len(rows)),
        "mismatches": sum(int(r["mismatch_count"]) for r in rows),
        "tokens_checked": sum(int(r["tokens"]) for r in rows),
        "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in steady) / len(steady),
        "is_ratio_max": max(r.get("is_ratio_max", 1.0) for r in rows),
        "is_clip_frac_mean": sum(r.get("is_clip_frac", 0.0) for r in rows) / len(rows),
        "lag0_ratio_off": sum(int(r.get("lag0_ratio_off", 0)) for r in rows),
    }


def figure(path: Path, runs: dict[int, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(runs)
    rows = runs[n]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 4, figsize=(13, 2.8), dpi=80)
    for k, rs in sorted(runs.items()):
        ax[0].plot([r["step"] for r in rs], [r["reward_mean"] for r in rs], label=f"max_staleness={k}")
    ax[0].set_ylim(0, 1)
    ax[0].set_title("reward")
    ax[0].legend(fontsize=7)
    ax[1].plot(steps, [r["staleness_mean"] for r in rows], label="mean")
    ax[1].plot(steps, [r["staleness_max"] for r in rows], "--", label="max")
    ax[1].set_title("staleness (versions behind)")
    ax[1].legend(fontsize=7)
    ax[2].plot(steps, [r["is_ratio_mean"] for r in rows], label="mean")
    ax[2].plot(steps, [r["is_ratio_max"] for r in rows], "--", label="max")
    ax[2].set_title("ratio pi_prox / pi_behaviour")
    ax[2].legend(fontsize=7)
    ax[3].plot(steps, [r["mismatch_count"] for r in rows], "o-", ms=2, label="mismatch_count")
    ax[3].set_ylim(-0.5, max(1, max(r["mismatch_count"] for r in rows)) + 0.5)
    ax[3].set_title(f"mismatches (of {sum(r['tokens'] for r in rows):.0f} tokens)")
    for a in ax:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/async_overlap_cpu.json")
    ap.add_argument("--figure", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    ap.add_argument("overrides", nargs="*", help="vime.train overrides for every run (after --)")
    args = ap.parse_args()
    runs, table = {}, {}
    with tempfile.TemporaryDirectory(prefix="vime_async_") as tmp:
        work = args.workdir or Path(tmp)
        for n in args.staleness:
            rows, wall = run(work / f"n{n}", n, args.steps, args.overrides)
            runs[n], table[n] = rows, summary(rows, wall)
    base = table[min(table)]["tokens_per_s"]
    print(
        f"{'max_staleness':>13} {'tok/s':>8} {'x sync':>7} {'step_s':>7} {'rollout_s':>9} {'train_s':>8} "
        f"{'reward0':>7} {'reward_end':>10} {'stale':>5} {'ratio_max':>9} {'mismatch':>8} {'lag0_off':>8}"
    )
    for n, s in table.items():
        s["speedup_vs_first"] = s["tokens_per_s"] / base
        print(
            f"{n:>13d} {s['tokens_per_s']:>8.1f} {s['speedup_vs_first']:>7.2f} {s['step_s_mean']:>7.2f} "
            f"{s['rollout_s_mean']:>9.2f} {s['train_s_mean']:>8.2f} {s['reward_first']:>7.3f} "
            f"{s['reward_last5']:>10.3f} {s['staleness_mean']:>5.2f} {s['is_ratio_max']:>9.4f} "
            f"{s['mismatches']:>8d} {s['lag0_ratio_off']:>8d}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "cpus": os.cpu_count(),
                "overrides": args.overrides,
                "summary": table,
                "rows": {n: [{k: v for k, v in r.items() if k != "samples"} for r in rs] for n, rs in runs.items()},
            },
            indent=1,
        )
    )
    if args.figure:
        figure(args.figure, runs)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
