"""The prompt pool of a run: generated problems tokenized with the checkpoint's tokenizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from vime.config.schema import DataConfig, Task
from vime.data import tasks
from vime.errors import DataError


@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int
    problem: tasks.Problem
    token_ids: list[int]


def model_vocab_size(model_path: str | Path) -> int:
    config = Path(model_path) / "config.json"
    if not config.is_file():
        raise DataError(
            f"no config.json in {model_path}: point model.path at an HF checkpoint directory "
            "(or leave it null to make a tiny one)"
        )
    return int(json.loads(config.read_text())["vocab_size"])


def load_tokenizer(model_path: str | Path):
    """The checkpoint's tokenizer, checked against the model vocab (every id it emits must be a row of
    the embedding)."""
    from transformers import AutoTokenizer

    vocab = model_vocab_size(model_path)
    try:
        tok = AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError) as e:
        raise DataError(
            f"cannot load a tokenizer from {model_path}: {e}; save one next to the checkpoint "
            "(tokenizer.json / tokenizer_config.json)"
        ) from e
    if len(tok) > vocab:
        raise DataError(
            f"tokenizer has {len(tok)} tokens but the model vocab is {vocab}: ids >= {vocab} would index "
            "past the embedding; use the tokenizer that belongs to this checkpoint"
        )
    if tok.eos_token_id is None:
        raise DataError(f"the tokenizer in {model_path} has no eos token; generation could not stop")
    return tok


class PromptSet:
    """Generated problems, tokenized; `batch(step, n)` cycles through them in order."""

    def __init__(self, cfg: DataConfig, tokenizer, vocab_size: int):
        make = {
            Task.copy: lambda: tasks.copy(cfg.num_prompts, cfg.letters),
            Task.arithmetic: lambda: tasks.arithmetic(cfg.num_prompts, cfg.seed, cfg.max_operand),
            Task.reverse: lambda: tasks.reverse(cfg.num_prompts, cfg.seed, cfg.min_len, cfg.max_len),
        }
        self.tokenizer = tokenizer
        self.prompts = []
        for i, p in enumerate(make[Task(cfg.task)]()):
            ids = list(tokenizer(p.prompt, add_special_tokens=False)["input_ids"])
            if not ids or max(ids) >= vocab_size:
                raise DataError(f"prompt {p.prompt!r} tokenizes to ids {ids} outside the model vocab [0, {vocab_size})")
            if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
                raise DataError(f"prompt {p.prompt!r} has characters the tokenizer does not know (unk in {ids})")
            self.prompts.append(Prompt(i, p, ids))
        if not self.prompts:
            raise DataError("the prompt set is empty: set data.num_prompts >= 1")

    def batch(self, step: int, n: int) -> list[Prompt]:
        return [self.prompts[(step * n + i) % len(self.prompts)] for i in range(n)]

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        eos = self.tokenizer.eos_token_id
        ids = response_ids[: response_ids.index(eos)] if eos in response_ids else response_ids
        return tasks.reward(prompt.problem, self.tokenizer.decode(ids))
