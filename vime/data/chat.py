"""Chat templates: a prompt rendered with the tokenizer's own template, and the token that ends a turn.

`data.chat_template=true` renders each prompt (a string becomes one user message; chat messages are used as
they are, after `data.system_prompt` when set) with `tokenizer.apply_chat_template(...,
add_generation_prompt=True, **data.template_kwargs)` (e.g. Qwen3's `enable_thinking`). The template's
end-of-turn token (`<|im_end|>` for Qwen3) joins the run's stop tokens, so a response ends where the template
would close the assistant's turn.
"""

from __future__ import annotations

from typing import Any

from vime.errors import DataError


def check_template(tokenizer, where: str) -> None:
    """DataError unless `tokenizer` (loaded from `where`) has a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"data.chat_template=true but the tokenizer in {where} has no chat template (no chat_template in its "
            "tokenizer_config.json, no chat_template.jinja); use a chat checkpoint's tokenizer, or set "
            "data.chat_template=false and give plain-text prompts"
        )


def messages(prompt: str | list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The chat messages of one prompt: a string is one user message; `system_prompt` goes first unless the
    messages start with a system message of their own."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and (not msgs or msgs[0]["role"] != "system"):
        msgs = [{"role": "system", "content": system_prompt}, *msgs]
    return msgs


def render(tokenizer, prompt: str | list[dict[str, str]], system_prompt: str | None, kwargs: dict[str, Any]) -> str:
    """The prompt text the model is given: the template applied with a generation prompt (the assistant turn
    opened), `kwargs` passed to the template."""
    return tokenizer.apply_chat_template(
        messages(prompt, system_prompt), tokenize=False, add_generation_prompt=True, **kwargs
    )


def end_of_turn_ids(tokenizer, kwargs: dict[str, Any] | None = None) -> list[int]:
    """The token(s) the template puts right after an assistant message's content (Qwen3: `<|im_end|>`): found by
    rendering a short conversation and reading the first token after the reply. Empty when that is not one
    special token of the tokenizer (the template closes turns with plain text); the eos token still stops."""
    marker = "vimeReplyMarker"
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
    text = tokenizer.apply_chat_template(conv, tokenize=False, **(kwargs or {}))
    at = text.rfind(marker)
    if at < 0:
        return []
    after = tokenizer(text[at + len(marker) :], add_special_tokens=False)["input_ids"]
    if not after:
        return []
    special = set(getattr(tokenizer, "all_special_ids", [])) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    return [after[0]] if after[0] in special else []
