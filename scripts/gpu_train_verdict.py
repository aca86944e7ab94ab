"""scripts/gpu_train.sh's last step: gpu_train_h200.json from the runs' metrics and status lines, the table, and the
verdict (exit 0 only when at least one strict run PASSed and no strict run that ran failed or mismatched).

    python scripts/gpu_train_verdict.py OUT STATUS_FILE START PRESET "OVERRIDES" RUN...
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

TIMES = ("rollout_s", "score_s", "train_s", "sync_s", "sleep_s", "wake_s", "step_s", "sync_gbps")
KEEP = (
    "step",
    "version",
    "tokens",
    "mismatch_count",
    "max_abs_diff",
    "mean_abs_diff",
    "train_mismatch_count",
    "reward_mean",
    "loss",
    "grad_norm",
    "clip_frac",
    "ratio_mean",
    "sync_bytes",
    "sync_buckets",
    *TIMES,
)
MIN_STEPS = 5  # a strict run passes with this many steps or more, all with 0 mismatches


def read_status(path: Path) -> dict[str, dict]:
    """The `NAME STATUS SECONDS [why]` lines `run` wrote: {name: {status, wall_s}}."""
    status = {}
    for line in path.read_text().splitlines():
        name, st, secs, *_ = line.split(" ") + [""]
        status[name] = {"status": st, "wall_s": float(secs or 0)}
    return status


def run_result(name: str, status: dict, rows: list[dict]) -> dict:
    """One run's entry of the JSON: status, strict or not, its kept per-step fields and totals."""
    r = status.get(name, {"status": "NOT RUN", "wall_s": 0.0}) | {"strict": not name.startswith("native")}
    r["steps"] = [{k: row.get(k) for k in KEEP} for row in rows]
    if rows:
        r["labels"] = {k: rows[0].get(k) for k in ("rollout_engine", "trainer_engine")}
        r["mismatch_total"] = sum(int(x["mismatch_count"]) for x in rows)
        r["tokens_total"] = sum(int(x["tokens"]) for x in rows)
        r["steps_with_mismatch"] = sum(1 for x in rows if x["mismatch_count"])
        later = rows[1:] or rows  # step 0 carries compilation and warm-up
        r["median_after_step0"] = {k: statistics.median(float(x[k]) for x in later) for k in TIMES if k in rows[0]}
        r["sync_gb"] = float(rows[0].get("sync_bytes", 0)) / 1e9
    return r


def strict_verdict(runs: dict[str, dict]) -> tuple[bool, str]:
    """(ok, what the RESULT line says of the strict runs). ok needs at least one strict run that PASSed with
    >= MIN_STEPS steps and 0 mismatches, and no strict run that ran (not SKIP) which did otherwise: runs all
    skipped for time, or none named, prove nothing."""
    strict = {n: r for n, r in runs.items() if r["strict"]}
    passed = [n for n, r in strict.items() if _passed(r)]
    failed = [f"{n} {_why_not(r)}" for n, r in strict.items() if r["status"] != "SKIP" and not _passed(r)]
    if failed:
        return False, f"FAILED ({', '.join(failed)})"
    if not passed:
        what = ", ".join(f"{n} {r['status']}" for n, r in strict.items()) or "none named in GPU_TRAIN_RUNS"
        return False, f"FAILED: no strict run passed ({what})"
    return True, f"0 mismatches on every step ({', '.join(passed)})"


def _why_not(r: dict) -> str:
    """Why a strict run that ran does not pass: its status, its mismatches or its too few steps."""
    if r["status"] != "PASS":
        return r["status"]
    if r.get("mismatch_total") != 0:
        return f"PASS with {r.get('mismatch_total')} mismatches"
    return f"PASS with {len(r['steps'])} steps, fewer than {MIN_STEPS}"


def _passed(r: dict) -> bool:
    return r["status"] == "PASS" and r.get("mismatch_total") == 0 and len(r["steps"]) >= MIN_STEPS


def main(argv: list[str]) -> int:
    out, status_file, start, preset, args = Path(argv[0]), Path(argv[1]), float(argv[2]), argv[3], argv[4]
    names = argv[5:]
    status = read_status(status_file)
    result = {"script": "scripts/gpu_train.sh", "preset": preset, "overrides": args, "runs": {}}
    try:
        import megatron.core
        import ray
        import torch
        import transformers
        import triton

        result["versions"] = {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "ray": ray.__version__,
            "megatron-core": megatron.core.__version__,
            "transformers": transformers.__version__,
        }
        result["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001 - the versions are a courtesy of the report
        result["versions"] = f"unavailable: {e}"
    for name in names:
        path = out / f"{name}.metrics.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
        result["runs"][name] = run_result(name, status, rows)
    strict_ok, strict_says = strict_verdict(result["runs"])
    natives = [r for r in result["runs"].values() if r["steps"] and not r["strict"]]
    native_every = bool(natives) and all(r.get("steps_with_mismatch") == len(r["steps"]) for r in natives)
    result["summary"] = {
        "strict_ok": strict_ok,
        "native_mismatch_every_step": native_every,
        "wall_s": time.time() - start,
    }
    (out / "gpu_train_h200.json").write_text(json.dumps(result, indent=1))
    print(
        f"{'run':<12} {'status':<9} {'steps':>5} {'tokens':>7} {'mismatch':>8} "
        + " ".join(f"{k:>10}" for k in TIMES)
        + "   (medians after step 0)"
    )
    for n, r in result["runs"].items():
        m = r.get("median_after_step0", {})
        print(
            f"{n:<12} {r['status']:<9} {len(r['steps']):>5} {r.get('tokens_total', 0):>7} "
            f"{r.get('mismatch_total', 0):>8} " + " ".join(f"{m[k]:>10.3f}" if k in m else f"{'-':>10}" for k in TIMES)
        )
    native = (
        "not run" if not natives else "mismatches on every step" if native_every else "not mismatched on every step"
    )
    print(
        f"RESULT gpu_train: strict {strict_says}; native {native}; {result['summary']['wall_s']:.0f}s; "
        f"{out / 'gpu_train_h200.json'}"
    )
    return 0 if strict_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
