"""`python -m vime.audit [overrides]`: operator ablation of rollout vs trainer logprob parity.

Same config and overrides as `python -m vime.train` (the engines, layouts, checkpoint and modes it
would run). The audit:

1. starts the engines and rolls out one step (weight version 0, or the checkpoint's weights with
   `model.path=`): these sampled tokens stay fixed for the whole ladder;
2. the **base** rung: the trainer scores them by teacher forcing under the configured modes and
   the rollout logprobs recorded while sampling are compared with it, bit for bit (fp32 int32
   views) on every active response token, after the comparability gate;
3. a **re-score check**: the rollout engine re-scores the same tokens by forced decoding under the
   configured modes; its logprobs must equal the ones recorded while sampling (same bits), or the
   ladder would not compare like with like;
4. the **ladder**: for each side (rollout, trainer) and each boundary (norm, gemm, activation,
   rope, attention, logprob, collective) that is strict in the config, that one boundary is set
   native on that one side, the side re-scores the fixed tokens (rollout: forced decoding on
   vLLM's decode path; trainer: teacher forcing), and the result is compared with the other side's
   base logprobs; the modes are then restored;
5. a verdict: does the configured (base) run keep parity, and which boundaries' native form
   breaks it on which side.

Printed as a table; written to `<output_dir>/audit.json` (every rung: modes, mismatch_count,
max_abs_diff, mean_abs_diff, tokens, the worst token, the contracts that ran per op) and
`<output_dir>/audit.png`. `audit.run=<earlier output_dir>` instead summarises the evidence an
earlier run recorded on every step (its metrics.jsonl): no engine is started.

A native rung reports what this CPU/GPU and build show; whether a native form differs from the
strict one can depend on the instruction set (e.g. vectorised exp), so only the strict base and
boundaries that differ by construction are stable across machines.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from rl_kernel import BOUNDARIES
from vime.config.schema import VimeConfig, as_dict, config_or_exit, modes_label, register_configs
from vime.engines import Sample
from vime.errors import ComparabilityError, ConfigError, VimeError, one_line
from vime.loop import consistency
from vime.loop.consistency import Consistency
from vime.reporting.metrics_log import read_rows

log = logging.getLogger("vime")
SIDES = ("rollout", "trainer")


def _rung(
    name: str,
    side: str | None,
    boundary: str | None,
    modes: dict[str, dict[str, str]],
    result: Consistency | None,
    contracts: dict[str, str] | None,
    evidence: list[dict] | None,
    error: str | None = None,
    seconds: float = 0.0,
) -> dict:
    """One row of the ladder (JSON-able)."""
    row = {
        "rung": name,
        "side": side,
        "boundary": boundary,
        "rollout_modes": dict(modes["rollout"]),
        "trainer_modes": dict(modes["trainer"]),
        "contracts": contracts or {},
        "seconds": round(seconds, 3),
        "error": error,
        "ran": sorted({f"{r['op']}:{r['mode']}:{r['contract_id']}[{r['fingerprint']}]" for r in evidence or []}),
    }
    if result is not None:
        row |= {
            "mismatch_count": result.mismatch_count,
            "max_abs_diff": result.max_abs_diff,
            "mean_abs_diff": result.mean_abs_diff,
            "tokens": result.tokens,
            "worst": result.worst,
        }
    return row


class Audit:
    """Runs the ladder on a started `Driver` (engines up, weights at the timeline's version)."""

    def __init__(self, driver, boundaries: list[str], sides: list[str]):
        self.d = driver
        self.boundaries, self.sides = list(boundaries), list(sides)
        self.base = {"rollout": dict(driver.rollout_modes), "trainer": dict(driver.trainer_modes)}

    # ---- the two sides --------------------------------------------------------------------------

    def _set_modes(self, side: str, modes: dict[str, str]) -> None:
        actors = self.d.engines if side == "rollout" else self.d.trainer
        self.d._call(actors, "set_modes", f"set {side} modes", modes, trainer=side == "trainer")

    def _rollout_rescore(self, samples: list[Sample]) -> tuple[list[torch.Tensor], list[dict]]:
        """Forced-decoding logprobs of the fixed samples, each on the engine that sampled it."""
        per_engine = [[i for i, s in enumerate(samples) if s.engine == e] for e in range(len(self.d.engines))]
        refs = [eng.rescore.remote([samples[i] for i in idx]) for eng, idx in zip(self.d.engines, per_engine) if idx]
        from vime.cluster.remote import call

        outs = call(refs, "re-score", [f"rollout engine {e}" for e, idx in enumerate(per_engine) if idx])
        lps: list[torch.Tensor | None] = [None] * len(samples)
        for idx, out in zip([idx for idx in per_engine if idx], outs):
            for i, lp in zip(idx, out):
                lps[i] = consistency.rollout_tensor(lp)
        evidence = [r for ev in self.d._call(self.d.engines, "evidence", "evidence") for r in ev]
        return lps, evidence

    def _trainer_score(self, samples: list[Sample]) -> tuple[list, list[dict]]:
        scored = self.d._call(self.d.trainer, "score", "score", samples, trainer=True)[0]
        evidence = self.d._call(self.d.trainer, "evidence", "evidence", trainer=True)[0]
        return scored, evidence

    # ---- the ladder -----------------------------------------------------------------------------

    def run(self) -> dict:
        d = self.d
        version = d.timeline.check_ready_for_rollout()
        t0 = time.perf_counter()
        samples = d.rollout(0)
        rollout_ev = [r for ev in d._call(d.engines, "evidence", "evidence") for r in ev]
        sampled = [consistency.rollout_tensor(s.logprobs) for s in samples]
        scored, trainer_ev = self._trainer_score(samples)
        consistency.check_comparable(samples, scored, version)
        positions = [sc.positions for sc in scored]
        token_ids = [sc.token_ids for sc in scored]
        trainer_lp = [sc.logprobs for sc in scored]

        def cmp(a, b):
            return consistency.compare(a, b, positions, token_ids)

        contracts = consistency.check_contracts(rollout_ev, trainer_ev, self.base["rollout"], self.base["trainer"])
        rungs = [
            _rung(
                "base",
                None,
                None,
                self.base,
                cmp(sampled, trainer_lp),
                contracts,
                rollout_ev + trainer_ev,
                seconds=time.perf_counter() - t0,
            )
        ]
        t0 = time.perf_counter()
        rescored, ev = self._rollout_rescore(samples)
        rescore = _rung(
            "rollout re-score",
            "rollout",
            None,
            self.base,
            cmp(sampled, rescored),
            None,
            ev,
            seconds=time.perf_counter() - t0,
        )
        if rescore["mismatch_count"]:
            raise ComparabilityError(
                f"re-scoring the sampled tokens by forced decoding changed "
                f"{rescore['mismatch_count']} of {rescore['tokens']} rollout logprobs: the "
                "ladder would not compare like with like"
            )
        rungs.append(rescore)
        for side in self.sides:
            for b in self.boundaries:
                if self.base[side][b] != "strict":
                    continue  # already native in the config: the base rung shows it
                modes = {"rollout": dict(self.base["rollout"]), "trainer": dict(self.base["trainer"])}
                modes[side][b] = "native"
                t0 = time.perf_counter()
                self._set_modes(side, modes[side])
                try:
                    if side == "rollout":
                        lp, ev = self._rollout_rescore(samples)
                        r_ev, t_ev, result = ev, trainer_ev, cmp(lp, trainer_lp)
                    else:
                        sc, ev = self._trainer_score(samples)
                        consistency.check_comparable(samples, sc, version)
                        r_ev, t_ev, result = rollout_ev, ev, cmp(sampled, [x.logprobs for x in sc])
                    try:
                        verdict = consistency.check_contracts(r_ev, t_ev, modes["rollout"], modes["trainer"])
                        error = None
                    except ComparabilityError as e:
                        verdict, error = None, f"contract gate: {e}"
                    rungs.append(
                        _rung(f"{side}:{b}", side, b, modes, result, verdict, ev, error, time.perf_counter() - t0)
                    )
                finally:
                    self._set_modes(side, self.base[side])
        return self._report(samples, version, rungs)

    def _report(self, samples: list[Sample], version: int, rungs: list[dict]) -> dict:
        base = rungs[0]
        breaking: dict[str, list[str]] = {s: [] for s in SIDES}
        for r in rungs[2:]:
            if r.get("mismatch_count"):
                breaking[r["side"]].append(r["boundary"])
        configured_native = {s: sorted(b for b, m in self.base[s].items() if m == "native") for s in SIDES}
        return {
            "version": version,
            "samples": len(samples),
            "tokens": base["tokens"],
            "rollout_engine": self.d.labels["rollout_engine"],
            "trainer_engine": self.d.labels["trainer_engine"],
            "model_path": self.d.model_path,
            "base_modes": self.base,
            "configured_native": configured_native,
            "base_parity": base["mismatch_count"] == 0,
            "breaking": breaking,
            "rungs": rungs,
            "verdict": verdict_text(base, breaking, configured_native),
        }


def verdict_text(base: dict, breaking: dict[str, list[str]], configured_native: dict[str, list[str]]) -> str:
    """One paragraph: does the configured run keep parity, and which native forms break it."""
    n, tokens = base["mismatch_count"], base["tokens"]
    if n == 0:
        head = (
            f"PARITY: the configured run keeps rollout == trainer on all {tokens} tokens (0 fp32 bit "
            "mismatches); no configured boundary breaks parity."
        )
    else:
        named = "; ".join(f"{s}: {', '.join(b)}" for s, b in configured_native.items() if b) or "none (all strict)"
        head = (
            f"BROKEN: the configured run differs on {n} of {tokens} tokens (max |diff| "
            f"{base['max_abs_diff']:.3e}); boundaries configured native: {named}."
        )
    found = [f"{s}: {', '.join(b)}" for s, b in breaking.items() if b]
    tail = (
        "Native forms that break parity when flipped alone: " + "; ".join(found) + "."
        if found
        else "No single boundary's native form broke parity on these tokens."
    )
    return f"{head} {tail}"


# ---- printing and the figure -----------------------------------------------------------------


def _worst(r: dict) -> str:
    w = r.get("worst")
    if not w:
        return "-"
    return f"sample {w['sample']} pos {w['position']} token {w['token_id']}: {w['rollout']:.7g} vs {w['trainer']:.7g}"


def format_ladder(report: dict) -> str:
    """The ladder as a fixed-width table plus the verdict."""
    lines = [
        f"vime.audit: {report['samples']} samples, {report['tokens']} response tokens, weight version "
        f"{report['version']}, model {report['model_path']}",
        f"  rollout: {report['rollout_engine']} ({modes_label(report['base_modes']['rollout'])})",
        f"  trainer: {report['trainer_engine']} ({modes_label(report['base_modes']['trainer'])})",
        f"{'rung':<22} {'mismatch':>12} {'max|diff|':>10}  {'native ops that ran':<28} "
        "worst token (rollout vs trainer)",
    ]
    for r in report["rungs"]:
        native_ops = sorted({x.split(":")[0] for x in r["ran"] if ":native:" in x})
        mm = f"{r['mismatch_count']} / {r['tokens']}" if "mismatch_count" in r else "-"
        diff = f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else "-"
        lines.append(
            f"{r['rung']:<22} {mm:>12} {diff:>10}  {','.join(native_ops) or '-':<28} {_worst(r)}"
            + (f"  [{r['error']}]" if r.get("error") else "")
        )
    strict_ran = sorted({x.split(":", 2)[2] for x in report["rungs"][0]["ran"] if ":strict:" in x})
    lines.append(f"contracts (base): {', '.join(strict_ran) or 'none'}")
    lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)


def plot_ladder(report: dict, path: Path) -> Path:
    """audit.png: mismatch_count (integer axis from 0) and max |diff| (log axis) per rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rungs = [r for r in report["rungs"] if "mismatch_count" in r]
    names = [r["rung"] for r in rungs]
    counts = [r["mismatch_count"] for r in rungs]
    diffs = [r["max_abs_diff"] for r in rungs]
    colors = [
        "#2b8a3e" if c == 0 else ("#c92a2a" if r["side"] in (None, "trainer") else "#e67700")
        for c, r in zip(counts, rungs)
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.38 * len(rungs) + 1.8), sharey=True)
    y = list(range(len(rungs)))
    ax1.barh(y, counts, color=colors)
    ax1.set_yticks(y, names)
    ax1.invert_yaxis()
    ax1.set_xlim(0, max(1, report["tokens"]))
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_xlabel(f"mismatch_count (of {report['tokens']} tokens; 0 = bitwise equal)")
    for yi, c in zip(y, counts):
        ax1.text(c + report["tokens"] * 0.01, yi, str(c), va="center", fontsize=8)
    positive = [d for d in diffs if d > 0]
    if positive:
        ax2.barh(y, [d if d > 0 else 0 for d in diffs], color=colors, left=0)
        ax2.set_xscale("log")
        ax2.set_xlim(min(positive) / 3, max(positive) * 3)
    else:
        ax2.set_xlim(0, 1)
    for yi, d in zip(y, diffs):
        if d == 0:
            ax2.text(ax2.get_xlim()[0], yi, "  0 (equal bits)", va="center", fontsize=8, color="#2b8a3e")
    ax2.set_xlabel("max |rollout - trainer| (log; 0 marked)")
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    ax1.legend(
        handles=[
            Patch(color="#2b8a3e", label="bitwise equal"),
            Patch(color="#e67700", label="rollout side native: differs"),
            Patch(color="#c92a2a", label="trainer side native (or base): differs"),
        ],
        loc="lower right",
        fontsize=8,
    )
    status = "parity holds" if report["base_parity"] else "parity BROKEN"
    fig.suptitle(
        f"vime.audit: configured run (base) {status} on {report['tokens']} tokens; then one boundary "
        "native at a time, one side at a time, same sampled tokens",
        fontsize=11,
    )
    import textwrap

    fig.text(0.01, 0.005, "\n".join(textwrap.wrap(report["verdict"], 170)), fontsize=8, va="bottom")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- an earlier run's evidence ----------------------------------------------------------------


def audit_run(run_dir: Path) -> dict:
    """Per-step evidence an earlier `vime.train` run recorded (its metrics.jsonl): tokens compared,
    mismatches, max |diff|, worst token, engines and the per-op contract verdicts of each step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"audit.run={run_dir}: no metrics.jsonl there; pass the output_dir of a vime.train run")
    rows = read_rows(path)
    parity = (
        "tokens",
        "mismatch_count",
        "max_abs_diff",
        "worst_sample",
        "worst_position",
        "worst_token_id",
        "worst_rollout",
        "worst_trainer",
    )
    steps = [
        {
            "step": r.step,
            "version": r.weights.version,
            **{k: getattr(r.consistency, k) for k in parity},
            "contracts": r.contracts,
            "strict": r.strict,
            "rollout_engine": r.rollout_engine,
            "trainer_engine": r.trainer_engine,
        }
        for r in rows
    ]
    total, tokens = sum(r.consistency.mismatch_count for r in rows), sum(r.consistency.tokens for r in rows)
    return {
        "run": str(run_dir),
        "steps": steps,
        "total_mismatches": total,
        "tokens": tokens,
        "verdict": f"{len(rows)} steps, {total} mismatching tokens of {tokens} compared",
    }


def format_run(report: dict) -> str:
    lines = [
        f"evidence of {report['run']}:",
        f"{'step':>4} {'version':>7} {'tokens':>6} {'mismatch':>8} {'max|diff|':>10}  contracts (op: verdict)",
    ]
    for s in report["steps"]:
        contracts = ", ".join(f"{op}:{v}" for op, v in sorted((s.get("contracts") or {}).items()))
        diff = s.get("max_abs_diff")
        diff = f"{float(diff):.2e}" if diff is not None and math.isfinite(float(diff)) else str(diff)
        lines.append(
            f"{s['step']:>4} {s['version']:>7} {s['tokens']:>6} {s['mismatch_count']:>8} {diff:>10}  {contracts}"
        )
    lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)


# ---- entry point -------------------------------------------------------------------------------


def audit(cfg: VimeConfig, output_dir: Path) -> dict:
    """Run the audit described by `cfg` (see the module doc); writes audit.json and audit.png."""
    from vime.loop.driver import Driver

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if cfg.audit.run:
        report = audit_run(Path(cfg.audit.run))
        print(format_run(report), flush=True)
        (output_dir / "audit.json").write_text(json.dumps(report, indent=1))
        return report
    bad = sorted(set(cfg.audit.boundaries) - set(BOUNDARIES)) + sorted(set(cfg.audit.sides) - set(SIDES))
    if bad:
        raise ConfigError(f"audit.boundaries / audit.sides: unknown {bad}; use {BOUNDARIES} and {SIDES}")
    cfg.wandb.mode = "disabled"
    driver = Driver(cfg, output_dir)
    try:
        driver.setup()
        report = Audit(driver, cfg.audit.boundaries, cfg.audit.sides).run()
    finally:
        driver.shutdown()
    report["config"] = as_dict(cfg)
    (output_dir / "audit.json").write_text(json.dumps(report, indent=1, default=str))
    plot_ladder(report, output_dir / "audit.png")
    print(format_ladder(report), flush=True)
    print(f"wrote {output_dir / 'audit.json'} and {output_dir / 'audit.png'}", flush=True)
    return report


register_configs()


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg = config_or_exit(dcfg)
    try:
        audit(cfg, Path(cfg.output_dir))
    except VimeError as e:
        log.error("%s", one_line(e))
        raise SystemExit(1) from None


if __name__ == "__main__":
    from vime.state.rundir import check_override_keys

    check_override_keys(sys.argv[1:])  # a mistyped key: one line, before Hydra composes anything
    sys.exit(main())
