"""Rewards computed off the driver: a pool of `reward.num_workers` Ray actors scores a step's samples in parallel.

`Rewards.score(batch, samples)` is the one call the loops make: it decodes each response up to its first stop
token, spreads the samples over the workers (round robin; an `async def` function runs its share concurrently
inside each worker, a plain one in turn), enforces `reward.timeout_s` per sample, applies `reward.on_error` to
a call that raised, timed out or returned something that is not a finite number, adds DAPO's overlong shaping
and sets `sample.reward`. It returns the step's reward metrics: `reward_errors`, `truncated_frac` (responses
cut at algo.max_new_tokens) and the mean of each extra value a dict-returning function gave (`reward/<name>`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from typing import Any

from vime.data import rewards
from vime.data.dataset import Prompt, response_text
from vime.engines import Sample
from vime.errors import VimeError

log = logging.getLogger("vime")

# (sample index, prompt text, response text, label, metadata) of one call
Item = tuple[int, str, str, Any, dict]
# (score, extras) or (None, the error's description)
Outcome = tuple[float | None, dict[str, float] | str]


class RewardError(VimeError):
    """A reward function failed under `reward.on_error=raise` (the message names the sample, function and error)."""


class Scorer:
    """Calls one reward function on items, each within `timeout_s` (in a Ray actor, or in the driver)."""

    def __init__(self, spec: str | None, pattern: str | None, paths: list[str]):
        self.fn = rewards.resolve(spec, pattern, paths)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def score(self, items: list[Item], timeout_s: float) -> list[Outcome]:
        if self.is_async:
            return asyncio.run(_score_async(self.fn, items, timeout_s))
        return [self._call_sync(item, timeout_s) for item in items]

    def _call_sync(self, item: Item, timeout_s: float) -> Outcome:
        _, prompt, response, label, metadata = item
        self._pool = self._pool or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward")
        future = self._pool.submit(self.fn, prompt, response, label, metadata)
        try:
            return _checked(future.result(timeout=timeout_s))
        except concurrent.futures.TimeoutError:
            self._pool.shutdown(wait=False)  # the call goes on in its thread; the next one gets a fresh thread
            self._pool = None
            return None, f"timed out after {timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - the user's function: whatever it raises is reported
            return None, f"raised {type(e).__name__}: {_one_line(e)}"


# A module function, not a method: an actor class with an `async def` method is an asyncio actor to Ray, whose
# methods run inside its event loop (where `asyncio.run` cannot start another).
async def _score_async(fn, items: list[Item], timeout_s: float) -> list[Outcome]:
    """Every item's call at once, each within `timeout_s`."""

    async def one(item: Item) -> Outcome:
        _, prompt, response, label, metadata = item
        try:
            return _checked(await asyncio.wait_for(fn(prompt, response, label, metadata), timeout_s))
        except TimeoutError:
            return None, f"timed out after {timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - the user's function
            return None, f"raised {type(e).__name__}: {_one_line(e)}"

    return list(await asyncio.gather(*(one(i) for i in items)))


def _one_line(error: BaseException) -> str:
    """The error's message on one line (a user's message may quote a multi-line label or response)."""
    return str(error).replace("\r", "\\r").replace("\n", "\\n")


def _checked(value: Any) -> Outcome:
    try:
        return rewards.check_value(value)
    except rewards.RewardValueError as e:
        return None, str(e)


class RewardWorker(Scorer):
    """The Ray actor of the pool (`ray.remote` is applied where it is started)."""

    def ready(self) -> bool:
        return True


class Rewards:
    """The run's reward: resolved (and its signature checked) when built, before any engine; `start` brings up
    the workers once Ray runs; `score` rewards a step."""

    def __init__(self, cfg, tokenizer, stop_ids: list[int], max_new_tokens: int):
        r = cfg.reward
        self.spec, self.cfg, self.tokenizer, self.stop_ids = r.fn or "task", r, tokenizer, list(stop_ids)
        self.worker_spec = rewards.absolute(r.fn)  # a file path as the driver resolves it (a worker's cwd may differ)
        self.max_new_tokens = max_new_tokens
        self.local = Scorer(r.fn, r.pattern, [])  # ConfigError here names a bad fn before anything starts
        self.paths = rewards.import_paths(r.fn)
        self.workers: list = []

    def start(self) -> None:
        """Start `reward.num_workers` actors (none for 0, or for the generated task's reward: a string compare
        that costs less than a remote call)."""
        if self.cfg.num_workers == 0 or self.spec == "task":
            return
        import ray

        from vime.cluster.remote import call

        Worker = ray.remote(num_cpus=0)(RewardWorker)  # noqa: N806 - a class
        self.workers = [
            Worker.remote(self.worker_spec, self.cfg.pattern, self.paths) for _ in range(self.cfg.num_workers)
        ]
        names = [f"reward worker {i}" for i in range(len(self.workers))]
        call([w.ready.remote() for w in self.workers], "start", names)

    def items(self, batch: list[Prompt], samples: list[Sample]) -> list[Item]:
        out = []
        for i, s in enumerate(samples):
            p = batch[s.group]
            out.append((i, p.text, response_text(self.tokenizer, s.response_ids, self.stop_ids), p.label, p.metadata))
        return out

    def outcomes(self, items: list[Item]) -> list[Outcome]:
        """Each item's outcome, in order: spread over the workers, or scored here without any."""
        if not self.workers:
            return self.local.score(items, self.cfg.timeout_s)
        import ray

        n = len(self.workers)
        shares = [items[w::n] for w in range(n)]
        refs = [(w, self.workers[w].score.remote(share, self.cfg.timeout_s)) for w, share in enumerate(shares) if share]
        out: list[Outcome | None] = [None] * len(items)
        for w, ref in refs:
            try:
                results = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise RewardError(
                    f"reward worker {w} died while scoring samples {[i[0] for i in shares[w]]} with "
                    f"reward.fn={self.spec}: {str(e).strip().splitlines()[0]}"
                ) from None
            for item, outcome in zip(shares[w], results):
                out[item[0]] = outcome
        return out

    def values(
        self, batch: list[Prompt], samples: list[Sample], step: int | None = None
    ) -> tuple[list[float], int, dict[str, list[float]]]:
        """The reward function's score of each sample (its group's prompt is `batch[sample.group]`), with
        `reward.on_error` applied: (scores, how many failed and were scored 0, each extra's values). Under
        on_error=raise a failure raises RewardError naming the step, the sample, the function and the error."""
        items = self.items(batch, samples)
        scores, errors, extras = [], 0, {}
        for s, item, (value, info) in zip(samples, items, self.outcomes(items)):
            if value is None:
                if self.cfg.on_error == "raise":
                    at = f"step {step}, " if step is not None else ""
                    raise RewardError(
                        f"reward.fn={self.spec} {info} on {at}sample {item[0]} (group {s.group}, prompt "
                        f"...{item[1][-40:]!r}, response {item[2][:40]!r}); fix the function, or set "
                        "reward.on_error=zero to score such samples 0"
                    )
                errors, value = errors + 1, 0.0
            else:
                for k, v in info.items():
                    extras.setdefault(k, []).append(v)
            scores.append(value)
        return scores, errors, extras

    def score(self, batch: list[Prompt], samples: list[Sample], step: int | None = None) -> dict[str, Any]:
        """Set every sample's reward: its score (`values`) plus DAPO's overlong shaping. Returns the step's reward
        metrics: reward_errors, truncated_frac, reward/<name> (each extra's mean)."""
        scores, errors, extras = self.values(batch, samples, step)
        c = self.cfg
        for s, value in zip(samples, scores):
            s.reward = value + rewards.overlong_penalty(
                len(s.response_ids), self.max_new_tokens, c.overlong_buffer, c.overlong_penalty
            )
        return {
            "reward_errors": errors,
            "truncated_frac": truncated_share(samples),
            **{f"reward/{k}": sum(v) / len(v) for k, v in sorted(extras.items())},
        }


def truncated_share(samples: list[Sample]) -> float:
    """The share of `samples` cut at max_new_tokens (no stop token: vLLM's finish reason "length")."""
    return sum(s.finish_reason == "length" for s in samples) / max(1, len(samples))
