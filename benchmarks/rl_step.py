"""The RL step end to end, strict against native: `vime.train` on one GPU, per-phase medians after step 0.

    python benchmarks/rl_step.py --runs OUT/rlstep/gpu_train_h200.json [--out benchmarks/results/rl_step_h200.json]

The runs themselves are `scripts/gpu_train.sh`'s (`bash scripts/gpu_vllm.sh rlstep` makes them: `+experiment=h200_vllm`
at RL sizes, strict then native, colocated on one GPU with vLLM's sleep mode); this script reads their
`gpu_train_h200.json`, prints the per-phase table and writes the summary JSON: `layers`, `sequences`, `new_tokens`,
`mismatches` (strict, every token of every step), `strict_step_s` / `native_step_s` (medians of the steps after
step 0, which holds compilation and warm-up) and the per-phase medians of both. Phases (seconds, `vime/loop/record.py`):
rollout (the whole `generate` of the step's fresh prompts), sleep (the engine's sleep, inside score), score (sleep
plus a separate scoring pass, when configured), train (the trainer's forward, backward and optimizer step), wake (the
engine's wake-up) and sync (the weight push to the engine). Exit status 1 unless the strict run passed with 0
mismatches and the native run ran.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PHASES = ("rollout_s", "sleep_s", "score_s", "train_s", "wake_s", "sync_s", "step_s")
STRICT, NATIVE = "strict_1gpu", "native_1gpu"


def override(overrides: str, key: str) -> str | None:
    """The value of `key=` in the runs' Hydra overrides, or None."""
    match = re.search(rf"(?:^|\s){re.escape(key)}=(\S+)", overrides)
    return match.group(1) if match else None


def summarize(runs: dict) -> dict:
    """The RL-step summary of gpu_train.sh's JSON (its `runs` by name)."""
    overrides = runs.get("overrides", "")
    strict, native = runs["runs"].get(STRICT, {}), runs["runs"].get(NATIVE, {})
    first = (strict.get("steps") or native.get("steps") or [{}])[0]
    prompts, group = override(overrides, "algo.prompts_per_step"), override(overrides, "algo.group_size")
    summary = {
        "preset": runs.get("preset"),
        "overrides": overrides,
        "layers": int(override(overrides, "model.tiny.num_layers") or 0) or None,
        "sequences": int(prompts) * int(group) if prompts and group else None,
        "new_tokens": int(override(overrides, "algo.max_new_tokens") or 0) or None,
        "tokens_per_step": first.get("tokens"),
        "strict_status": strict.get("status", "NOT RUN"),
        "native_status": native.get("status", "NOT RUN"),
        "mismatches": strict.get("mismatch_total"),
        "strict_tokens": strict.get("tokens_total"),
        "native_mismatches": native.get("mismatch_total"),
        "native_tokens": native.get("tokens_total"),
        "strict_step_s": strict.get("median_after_step0", {}).get("step_s"),
        "native_step_s": native.get("median_after_step0", {}).get("step_s"),
        "phases": {
            name: {k: r.get("median_after_step0", {}).get(k) for k in PHASES}
            for name, r in (("strict", strict), ("native", native))
        },
        "versions": runs.get("versions"),
        "gpus": runs.get("gpus"),
    }
    if summary["strict_step_s"] and summary["native_step_s"]:
        summary["strict_over_native_step"] = round(summary["strict_step_s"] / summary["native_step_s"], 3)
    return summary


def print_table(s: dict) -> None:
    print(
        f"RL step on {', '.join(s['gpus'] or ['?'])}: {s['layers']} Qwen3-8B-shaped layers, {s['sequences']} sequences "
        f"x {s['new_tokens']} new tokens ({s['tokens_per_step']} response tokens a step); medians after step 0, seconds"
    )
    print(f"{'phase':>10} {'strict':>9} {'native':>9} {'strict/native':>14}")
    for k in PHASES:
        a, b = s["phases"]["strict"].get(k), s["phases"]["native"].get(k)
        ratio = f"{a / b:>14.3f}" if a is not None and b else f"{'-':>14}"
        fmt = lambda v: f"{v:>9.3f}" if v is not None else f"{'-':>9}"  # noqa: E731
        print(f"{k.removesuffix('_s'):>10} {fmt(a)} {fmt(b)} {ratio}")
    print(
        f"strict {s['strict_status']}: {s['mismatches']} / {s['strict_tokens']} tokens mismatched; native "
        f"{s['native_status']}: {s['native_mismatches']} / {s['native_tokens']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="scripts/gpu_train.sh's gpu_train_h200.json")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "rl_step_h200.json")
    args = parser.parse_args()
    summary = summarize(json.loads(args.runs.read_text()))
    print_table(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    ok = summary["strict_status"] == "PASS" and summary["mismatches"] == 0 and summary["native_status"] != "NOT RUN"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
