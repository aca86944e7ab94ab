"""Reward throughput: a step's rewards must not be computed one at a time.

A reward function that sleeps `--sleep-ms` per sample (100 ms: a slow verifier, a sandbox, a judge call) scores
`--samples` samples through `vime.data.reward_pool.Rewards`, the path `vime.train` takes, once per worker count
(`reward.num_workers`; 0: in the driver, one at a time) and per function kind (plain `def`, `async def`). Ray is
started locally; the workers' start-up is timed apart from the scoring. The target (issue 36): 256 samples at
100 ms with 8 workers in at most 5 s (one at a time: 25.6 s).

    python benchmarks/reward_throughput.py --out benchmarks/results/reward_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FN = """
import asyncio, time

SLEEP_S = {sleep}

def score(prompt, response, label, metadata):
    time.sleep(SLEEP_S)
    return float(response == label)

async def ascore(prompt, response, label, metadata):
    await asyncio.sleep(SLEEP_S)
    return float(response == label)
"""


def measure(fn: str, workers: int, samples: int) -> dict:
    """Start the pool, score `samples` samples once (32 groups of samples/32), return the timings."""
    from vime.config.schema import RewardConfig
    from vime.data.dataset import Prompt
    from vime.data.reward_pool import Rewards
    from vime.engines import Sample

    tok = SimpleNamespace(decode=lambda ids: "".join(chr(97 + i) for i in ids))
    cfg = SimpleNamespace(reward=RewardConfig(fn=fn, num_workers=workers, timeout_s=60))
    groups = 32
    batch = [Prompt(g, None, [0], f"q{g}", "b", {}) for g in range(groups)]
    batch_samples = [
        Sample(i % groups, [0], [1, 25], [0.0, 0.0], [0, 0], 0, 1.0, finish_reason="stop") for i in range(samples)
    ]
    t0 = time.perf_counter()
    rewards = Rewards(cfg, tok, [25], max_new_tokens=2)
    rewards.start()
    t1 = time.perf_counter()
    rewards.score(batch, batch_samples)
    t2 = time.perf_counter()
    assert all(s.reward == 1.0 for s in batch_samples)
    for w in rewards.workers:
        import ray

        ray.kill(w)
    return {"start_s": t1 - t0, "score_s": t2 - t1, "samples_per_s": samples / (t2 - t1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--sleep-ms", type=float, default=100.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--serial", action="store_true", help="also time num_workers=0 (in the driver: samples x sleep)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slow_reward.py"
        path.write_text(FN.format(sleep=args.sleep_ms / 1000))
        for kind, name in (("def", "score"), ("async def", "ascore")):
            for workers in ([0] if args.serial else []) + args.workers:
                r = measure(f"{path}:{name}", workers, args.samples)
                results.append({"fn": kind, "num_workers": workers, **r})
                print(f"{kind:9s} workers {workers}: {r['score_s']:.2f} s ({r['start_s']:.1f} s to start)", flush=True)
    ray.shutdown()
    serial_s = args.samples * args.sleep_ms / 1000
    print(f"\n{args.samples} samples x {args.sleep_ms:g} ms (one at a time: {serial_s:.1f} s)")
    print(f"{'fn':10s} {'workers':>7s} {'score s':>8s} {'samples/s':>10s} {'start s':>8s}")
    for r in results:
        print(f"{r['fn']:10s} {r['num_workers']:7d} {r['score_s']:8.2f} {r['samples_per_s']:10.1f} {r['start_s']:8.2f}")
    eight = [r for r in results if r["num_workers"] == 8 and r["fn"] == "def"]
    target = {"samples": 256, "sleep_ms": 100, "num_workers": 8, "max_s": 5.0}
    met = bool(eight) and args.samples == 256 and args.sleep_ms == 100 and eight[0]["score_s"] <= 5.0
    if eight:
        print(f"target (256 x 100 ms, 8 workers, plain def, <= 5 s): {'met' if met else 'NOT met'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": "reward_throughput",
            "samples": args.samples,
            "sleep_ms": args.sleep_ms,
            "serial_s": serial_s,
            "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
            "results": results,
            "target": target,
            "target_met": met,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
