"""The prompt pool of a run, tokenized with the checkpoint's tokenizer: generated problems (`data.task`,
`PromptSet`) or the rows of dataset files (`data.path`, `FilePromptSet`: shuffled every epoch, its position in
the checkpoint)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

from vime.config.schema import DataConfig, Task
from vime.data import chat, files, tasks
from vime.errors import DataError

log = logging.getLogger("vime")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of the pool: `text` is what the model is given (the chat template applied, when on),
    `token_ids` its tokens; `label` and `metadata` go to the reward with the response. A generated task's
    prompt also carries its `problem`."""

    index: int
    problem: tasks.Problem | None
    token_ids: list[int]
    text: str = ""
    label: Any = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


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
            meta = {"alphabet": p.alphabet, "format_weight": p.format_weight}
            self.prompts.append(Prompt(i, p, ids, p.prompt, p.answer, meta))
        if not self.prompts:
            raise DataError("the prompt set is empty: set data.num_prompts >= 1")

    def batch(self, step: int, n: int) -> list[Prompt]:
        return [self.prompts[(step * n + i) % len(self.prompts)] for i in range(n)]

    def state_dict(self) -> dict[str, Any]:
        """Nothing to keep: a step's batch is a function of the step."""
        return {"kind": "task"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "task":
            raise DataError(f"the checkpoint's data state is a {state.get('kind')!r} dataset's, this run has data.task")

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        eos = self.tokenizer.eos_token_id
        ids = response_ids[: response_ids.index(eos)] if eos in response_ids else response_ids
        return tasks.reward(prompt.problem, self.tokenizer.decode(ids))


def tokenize_prompts(tokenizer, texts: list[str], vocab_size: int, where: str) -> list[list[int]]:
    """Token ids of each prompt text (no special tokens added: a template writes its own); DataError naming the
    first prompt with an id outside the model vocab or a character the tokenizer does not know."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    unk = tokenizer.unk_token_id
    for i, ids in enumerate(encoded):
        if not ids or max(ids) >= vocab_size or (unk is not None and unk in ids):
            what = "no tokens" if not ids else f"ids outside the model vocab [0, {vocab_size})"
            if ids and unk is not None and unk in ids:
                what = "characters the tokenizer does not know (unk)"
            raise DataError(f"{where}: prompt {i} ({texts[i][:60]!r}) has {what}; fix the row or use another tokenizer")
    return [list(ids) for ids in encoded]


def build_prompts(
    rows: list[files.Row], cfg: DataConfig, tokenizer, vocab_size: int, where: str, model_path: str = ""
) -> tuple[list[Prompt], int]:
    """The rows as prompts (rendered with the chat template when `cfg.chat_template`), less those longer than
    `cfg.max_prompt_tokens`; returns (prompts, how many were dropped). DataError when none is left."""
    if cfg.chat_template:
        chat.check_template(tokenizer, model_path or "the checkpoint")
        texts = [chat.render(tokenizer, r.prompt, cfg.system_prompt, dict(cfg.template_kwargs)) for r in rows]
    else:
        chats = [r.index for r in rows if not isinstance(r.prompt, str)]
        if chats:
            raise DataError(
                f"{where}: row {chats[0]}'s prompt is a list of chat messages but data.chat_template=false; set "
                "data.chat_template=true (the tokenizer's template renders them) or give plain-text prompts"
            )
        texts = [r.prompt for r in rows]
    ids = tokenize_prompts(tokenizer, texts, vocab_size, where)
    limit = cfg.max_prompt_tokens
    prompts = [
        Prompt(r.index, None, t, text, r.label, r.metadata)
        for r, text, t in zip(rows, texts, ids)
        if limit is None or len(t) <= limit
    ]
    if not prompts:
        shortest = min(len(t) for t in ids)
        raise DataError(
            f"{where}: every prompt is longer than data.max_prompt_tokens={limit} (the shortest has {shortest} "
            f"tokens); raise data.max_prompt_tokens to at least {shortest}"
        )
    return prompts, len(rows) - len(prompts)


class FilePromptSet:
    """The prompts of `data.path`: drawn in order through the rows, reshuffled (seeded by `data.seed` and the
    epoch) at the start of every epoch when `data.shuffle`, cycling through epochs. `batch` draws the next `n`
    prompts; `state_dict` is the position and the epoch's order, which a checkpoint keeps."""

    def __init__(self, cfg: DataConfig, tokenizer, vocab_size: int, model_path: str = ""):
        self.tokenizer, self.shuffle, self.seed = tokenizer, cfg.shuffle, cfg.seed
        rows = files.load_rows(cfg.path, cfg.prompt_key, cfg.answer_key, "data.path")
        where = f"data.path={cfg.path}"
        self.prompts, self.dropped = build_prompts(rows, cfg, tokenizer, vocab_size, where, model_path)
        limit = f" longer than data.max_prompt_tokens={cfg.max_prompt_tokens}" if cfg.max_prompt_tokens else ""
        log.info("data: %d prompts from %s (%d dropped%s)", len(self.prompts), cfg.path, self.dropped, limit)
        self.fingerprint = _fingerprint(self.prompts)
        self.epoch, self.position = 0, 0
        self.order = self._order(0)

    def _order(self, epoch: int) -> list[int]:
        n = len(self.prompts)
        if not self.shuffle:
            return list(range(n))
        return random.Random(self.seed * 1_000_003 + epoch).sample(range(n), n)

    def batch(self, step: int, n: int) -> list[Prompt]:
        """The next `n` prompts of the stream (`step` is the loop's, unused: the stream's position is its state,
        so a loop that draws more than once in a step gets new prompts)."""
        out = []
        while len(out) < n:
            if self.position == len(self.order):
                self.epoch, self.position = self.epoch + 1, 0
                self.order = self._order(self.epoch)
            out.append(self.prompts[self.order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "files",
            "epoch": self.epoch,
            "position": self.position,
            "order": list(self.order),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict`; DataError when it belongs to other data."""
        if state.get("kind") != "files" or state.get("fingerprint") != self.fingerprint:
            raise DataError(
                "the checkpoint's data position belongs to another dataset (data.path, its keys, template or "
                "max_prompt_tokens changed since it was saved); resume with the run's own data or start a new run"
            )
        self.epoch, self.position, self.order = int(state["epoch"]), int(state["position"]), list(state["order"])


def _fingerprint(prompts: list[Prompt]) -> str:
    """A digest of the prompts' row indices and token ids: equal exactly when a resume sees the same pool."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.index, p.token_ids]).encode())
    return h.hexdigest()


def make_prompts(cfg: DataConfig, tokenizer, vocab_size: int, model_path: str = "") -> PromptSet | FilePromptSet:
    """The run's prompt pool: the files of `data.path` when set, else the generated `data.task`."""
    if cfg.path:
        return FilePromptSet(cfg, tokenizer, vocab_size, model_path)
    if cfg.chat_template:
        raise DataError("data.chat_template=true needs data.path (the generated tasks are plain text): set data.path")
    return PromptSet(cfg, tokenizer, vocab_size)


def stop_token_ids(cfg: DataConfig, tokenizer) -> list[int]:
    """The run's stop tokens: eos, and the chat template's end-of-turn token when the template is on."""
    ids = [tokenizer.eos_token_id]
    if cfg.chat_template:
        ids += [i for i in chat.end_of_turn_ids(tokenizer, dict(cfg.template_kwargs)) if i not in ids]
    return ids


def response_text(tokenizer, response_ids: list[int], stop_ids: list[int]) -> str:
    """The response as the reward reads it: decoded up to (not including) its first stop token."""
    cut = next((i for i, t in enumerate(response_ids) if t in stop_ids), len(response_ids))
    return tokenizer.decode(response_ids[:cut])
