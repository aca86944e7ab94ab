"""Held-out evaluation (`eval.*`): the rollout engines sample `eval.n` responses to each prompt of `eval.path`
between steps, the run's reward function scores them, and pass@1 / pass@n / response_len_mean are reported.

When: before step 0 trains, before every step that is a multiple of `eval.every`, and after the last step (the
row's `step` is the weight version evaluated: the number of optimizer steps behind it). Where: `eval/*` in W&B,
one console line, a row of `<output_dir>/eval.jsonl`, every completion in `<output_dir>/eval/step_<N>.jsonl`.
It does not perturb training: it samples with its own seeds (from `eval.seed`; every rollout reseeds the engine
by its own step), moves no driver RNG and no prompt stream, and a resumed run keeps only the rows before it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from vime.data import files
from vime.data.dataset import Prompt, build_prompts, response_text
from vime.engines import Sample
from vime.errors import DataError

log = logging.getLogger("vime")

EVAL_JSONL = "eval.jsonl"
EVAL_DIR = "eval"


def pass_metrics(passed: list[list[bool]], lengths: list[int]) -> dict[str, float]:
    """pass@1 (each prompt's share of passing samples, averaged over prompts), pass@n (the share of prompts with
    at least one passing sample) and the mean response length (tokens) of `passed[prompt][sample]`."""
    if not passed or not all(passed):
        raise ValueError("pass_metrics needs at least one sample for every prompt")
    return {
        "pass@1": sum(sum(p) / len(p) for p in passed) / len(passed),
        "pass@n": sum(any(p) for p in passed) / len(passed),
        "response_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
    }


class Evaluator:
    """The eval set (tokenized as the training data) and the schedule; `run` evaluates the engines' weights."""

    def __init__(self, cfg, prompts: list[Prompt], output_dir: Path):
        self.cfg, self.e, self.prompts, self.output_dir = cfg, cfg.eval, prompts, Path(output_dir)
        self.max_new_tokens = self.e.max_new_tokens or cfg.algo.max_new_tokens
        self._trimmed = False

    @classmethod
    def build(cls, cfg, tokenizer, vocab_size: int, model_path: str, output_dir: Path) -> Evaluator | None:
        """The run's evaluator (None without eval.path): the rows read and checked before any engine starts."""
        e = cfg.eval
        if not e.path:
            return None
        rows = files.load_rows(e.path, cfg.data.prompt_key, cfg.data.answer_key, "eval.path")
        rows = rows[: e.max_prompts] if e.max_prompts else rows
        prompts, dropped = build_prompts(rows, cfg.data, tokenizer, vocab_size, f"eval.path={e.path}", model_path)
        new = e.max_new_tokens or cfg.algo.max_new_tokens
        longest = max(len(p.token_ids) for p in prompts)
        if longest + new > cfg.rollout.max_model_len:
            raise DataError(
                f"eval.path={e.path}: its longest prompt ({longest} tokens) + {new} new tokens > "
                f"rollout.max_model_len={cfg.rollout.max_model_len}; raise rollout.max_model_len or set "
                "data.max_prompt_tokens"
            )
        log.info("eval: %d prompts from %s (%d dropped), %d samples each", len(prompts), e.path, dropped, e.n)
        return cls(cfg, prompts, output_dir)

    def due(self, step: int) -> bool:
        """Evaluate the weights of version `step` (before step `step` trains; `cfg.steps`: after the last)?"""
        return step == 0 or step == self.cfg.steps or (self.e.every > 0 and step % self.e.every == 0)

    def run(self, driver, step: int) -> dict[str, Any]:
        """Sample and score the eval set on `driver`'s engines (their current weights, version `step`); report."""
        from vime.cluster.remote import call

        if not self._trimmed:  # a resumed run evaluates again from its first step on: drop the rows from there
            self._trim(step)
        engines = driver.engines
        n = len(engines)
        shares = [[(g, p.token_ids) for g, p in enumerate(self.prompts) if g % n == i] for i in range(n)]
        seed_step = self.e.seed * 1_000_000 + step  # apart from every training step's (< 1e6)
        refs = [
            engines[i].generate.remote(
                shares[i], self.e.n, self.max_new_tokens, self.e.temperature, driver.stop_ids, seed_step
            )
            for i in range(n)
            if shares[i]
        ]
        outs = call(refs, f"eval at step {step}", [f"rollout engine {i}" for i in range(n) if shares[i]])
        samples: list[Sample] = sorted((s for out in outs for s in out), key=lambda s: s.group)
        scores, errors, _ = driver.rewards.values(self.prompts, samples, step)
        passed: list[list[bool]] = [[] for _ in self.prompts]
        for s, score in zip(samples, scores):
            passed[s.group].append(score >= self.e.pass_threshold)
        metrics = pass_metrics(passed, [len(s.response_ids) for s in samples])
        row = {
            "step": step,
            **metrics,
            "reward_mean": sum(scores) / len(scores),
            "reward_errors": errors,
            "prompts": len(self.prompts),
            "n": self.e.n,
        }
        self._write(step, row, samples, scores, driver)
        log.info(
            "eval step %d: pass@1 %.3f  pass@%d %.3f  response_len_mean %.1f  (%d prompts x %d samples)",
            step,
            metrics["pass@1"],
            self.e.n,
            metrics["pass@n"],
            metrics["response_len_mean"],
            len(self.prompts),
            self.e.n,
        )
        run = getattr(driver.logger, "run", None)
        if run is not None:
            run.log({f"eval/{k}": v for k, v in row.items() if k != "step"}, step=step)
        return row

    def _write(self, step: int, row: dict, samples: list[Sample], scores: list[float], driver) -> None:
        with (self.output_dir / EVAL_JSONL).open("a") as f:
            f.write(json.dumps(row) + "\n")
        out = self.output_dir / EVAL_DIR / f"step_{step}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        seen: dict[int, int] = {}
        lines = []
        for s, score in zip(samples, scores):
            p = self.prompts[s.group]
            k = seen[s.group] = seen.get(s.group, -1) + 1
            lines.append(
                {
                    "row": p.index,
                    "sample": k,
                    "prompt": p.text,
                    "response": response_text(driver.tokenizer, s.response_ids, driver.stop_ids),
                    "label": p.label,
                    "score": score,
                    "passed": score >= self.e.pass_threshold,
                    "response_len": len(s.response_ids),
                    "finish_reason": s.finish_reason,
                }
            )
        out.write_text("".join(json.dumps(line, default=str) + "\n" for line in lines))

    def _trim(self, first_step: int) -> None:
        """Keep only the eval.jsonl rows of steps before `first_step` (a resumed run redoes the others)."""
        self._trimmed = True
        path = self.output_dir / EVAL_JSONL
        if path.is_file():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < first_step]
            path.write_text("".join(line + "\n" for line in kept))


def read_rows(output_dir: Path) -> list[dict]:
    """The rows of a run's eval.jsonl (none when it has none)."""
    path = Path(output_dir) / EVAL_JSONL
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
