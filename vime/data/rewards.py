"""Reward functions: the built-ins and the user's, resolved from `reward.fn`, and what a call's value must be.

Every reward function is called as `score(prompt, response, label, metadata)`: `prompt` the text the model was
given (the chat template applied, when on), `response` the decoded response up to its first stop token, `label`
the row's `data.answer_key` value, `metadata` its other columns. It returns a number, or a dict with a numeric
`score` and further numeric values (logged as `reward/<name>`); it may be `async def`.

Built-ins: `task` (the generated tasks' reward, vime/data/tasks.py), `exact` (the stripped response equals the
label), `regex` (reward.pattern), `math` (the final answer, from the last `\\boxed{...}` or GSM8K's `#### n`,
equivalent to the label under math-verify: fractions, LaTeX forms).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime.data import tasks
from vime.errors import ConfigError

RewardFn = Callable[[str, str, Any, dict], Any]


class RewardValueError(ValueError):
    """A reward function's value is not a finite number (or a dict with a finite numeric `score`)."""


# ---- built-ins -----------------------------------------------------------------------------------


def task_reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
    """The generated tasks' reward (vime/data/tasks.py: exact start, partial credit, format term)."""
    problem = tasks.Problem(prompt, str(label), metadata["alphabet"], metadata.get("format_weight", 0.1))
    return tasks.reward(problem, response)


def exact_reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
    """1.0 when the response, stripped, equals the label (as a string, stripped), else 0.0."""
    return float(response.strip() == str(label).strip())


def make_regex_reward(pattern: str) -> RewardFn:
    """1.0 when the response has a match of `pattern` whose group 1 (else the whole match), stripped, equals the
    label; `{label}` in the pattern is the escaped label. The first match counts."""

    def regex_reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
        text = str(label).strip()
        m = re.search(pattern.replace("{label}", re.escape(text)), response)
        if m is None:
            return 0.0
        found = m.group(1) if m.re.groups else m.group(0)
        return float(found is not None and found.strip() == text)

    re.compile(pattern.replace("{label}", "x"))  # a bad pattern fails at start-up
    return regex_reward


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`) in `text`, braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


_GSM8K = re.compile(r"####\s*([^\n]+)")


def final_answer(text: str) -> str | None:
    """The final answer a solution states: the last `\\boxed{}`, else the last GSM8K `#### n` line (commas
    dropped); None when it states none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    found = _GSM8K.findall(text)
    return found[-1].strip().replace(",", "") if found else None


def math_reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
    """1.0 when the response's final answer (`final_answer`) equals the label's (the label itself when it states
    none) as math-verify judges it, else 0.0 (no final answer: 0.0)."""
    pred = final_answer(response)
    if pred is None:
        return 0.0
    gold = final_answer(str(label)) or str(label).strip()
    if pred == gold:
        return 1.0
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only the main thread may set; reward.timeout_s bounds the call
    gold_p = parse(f"${gold}$", parsing_timeout=None)
    pred_p = parse(f"${pred}$", parsing_timeout=None)
    return float(bool(gold_p and pred_p and verify(gold_p, pred_p, timeout_seconds=None)))


BUILTINS = {"task": task_reward, "exact": exact_reward, "math": math_reward}  # and regex (needs a pattern)


# ---- the user's function ---------------------------------------------------------------------------


def resolve(spec: str | None, pattern: str | None = None, paths: list[str] | None = None) -> RewardFn:
    """The function `reward.fn` names (None: `task`): a built-in, `module.path:function` or
    `path/to/file.py:function`; ConfigError (one line) when it cannot be imported or takes other arguments
    than (prompt, response, label, metadata). `paths` go on sys.path first (where the driver found it)."""
    spec = spec or "task"
    if spec in BUILTINS:
        return BUILTINS[spec]
    if spec == "regex":
        if not pattern:
            raise ConfigError("reward.fn=regex without reward.pattern; set reward.pattern (e.g. 'answer: (\\d+)')")
        try:
            return make_regex_reward(pattern)
        except re.error as e:
            raise ConfigError(f"reward.pattern={pattern!r} is not a regular expression ({e}); fix it") from None
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(
            f"reward.fn={spec!r} is neither a built-in ({', '.join([*BUILTINS, 'regex'])}) nor "
            "module.path:function / path/to/file.py:function; name one of them"
        )
    for p in paths or []:
        if p not in sys.path:
            sys.path.insert(0, p)
    module = _load_module(where, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"reward.fn={spec!r}: {where} has no function {name!r}; check the name after the ':'")
    check_signature(fn, spec)
    return fn


def _load_module(where: str, spec: str):
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"reward.fn={spec!r}: no file {path}; give the path of the .py file that defines it")
        module_name = f"vime_reward_{abs(hash(str(path)))}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's module: report what it raised
            raise ConfigError(f"reward.fn={spec!r}: importing {path} raised {type(e).__name__}: {e}") from None
        sys.modules[module_name] = module
        return module
    try:
        return importlib.import_module(where)
    except Exception as e:  # noqa: BLE001 - ImportError or whatever the user's module raises when imported
        raise ConfigError(
            f"reward.fn={spec!r}: cannot import {where} ({type(e).__name__}: {e}); put it on PYTHONPATH or "
            "name its file as path/to/file.py:function"
        ) from None


def absolute(spec: str | None) -> str | None:
    """`spec` with a `path/to/file.py` made absolute (against this process's working directory)."""
    if not spec or not spec.rpartition(":")[0].endswith(".py"):
        return spec
    where, _, name = spec.rpartition(":")
    return f"{Path(where).expanduser().resolve()}:{name}"


def import_paths(spec: str | None) -> list[str]:
    """The sys.path entries a worker needs to import `module.path:function` as the driver did (none for a
    built-in or a file path): the directory its top package is in."""
    if not spec or spec in BUILTINS or spec == "regex" or spec.rpartition(":")[0].endswith(".py"):
        return []
    top = spec.rpartition(":")[0].split(".")[0]
    module = sys.modules.get(top)
    file = getattr(module, "__file__", None)
    if not file:
        return []
    path = Path(file).resolve().parent
    return [str(path.parent if path.name == top else path)]


def check_signature(fn: Callable, spec: str) -> None:
    """ConfigError unless `fn` can be called as fn(prompt, response, label, metadata)."""
    try:
        inspect.signature(fn).bind("prompt", "response", "label", {})
    except TypeError:
        raise ConfigError(
            f"reward.fn={spec!r} has signature {inspect.signature(fn)}; a reward function takes "
            "(prompt: str, response: str, label, metadata: dict) and returns a float or a dict with 'score'"
        ) from None
    except ValueError:  # no signature to read (a builtin): it is called and judged by what it returns
        pass


# ---- its value -------------------------------------------------------------------------------------


def check_value(value: Any) -> tuple[float, dict[str, float]]:
    """(score, extras) of a reward function's return value; RewardValueError (its message says what was
    returned) unless it is a finite number or a dict with a finite numeric `score` and numeric extras."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardValueError(f"returned a dict without 'score' (keys {sorted(value)})")
        extras = {}
        for k, v in value.items():
            if k != "score":
                extras[str(k)] = _number(v, f"returned {k}=")
        value = value["score"]
    return _number(value, "returned "), extras


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) and not _is_numeric_scalar(value):
        raise RewardValueError(f"{what}{value!r} ({type(value).__name__}), not a number")
    x = float(value)
    if not math.isfinite(x):
        raise RewardValueError(f"{what}{x}, not a finite number")
    return x


def _is_numeric_scalar(value: Any) -> bool:
    """numpy / torch scalars (they convert to float and are not strings)."""
    return hasattr(value, "__float__") and not isinstance(value, str | bytes) and getattr(value, "ndim", 0) == 0


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's overlong shaping (<= 0, added to the reward): 0 up to `max_new_tokens - buffer` tokens, then falling
    linearly to `-penalty` at `max_new_tokens`; `buffer=0`: always 0."""
    if buffer <= 0:
        return 0.0
    start = max_new_tokens - buffer
    return -penalty * min(1.0, (length - start) / buffer) if length > start else 0.0
