"""Generated prompt sets with verifiable rewards (no downloads).

copy: "g=" -> "g" (the embedded default: a tiny random model learns it in a few dozen steps);
arithmetic: "12+7=" -> "19";  reverse: "rev abc=" -> "cba".
Reward of a response (text up to the first EOS): 1.0 when it starts with the answer (stripped);
otherwise partial credit 0.5 x (fraction of answer characters matched at the same position)
+ `format_weight` x (fraction of the response's characters that belong to the answer alphabet, a
format term; 0.1 for arithmetic and reverse). The shaping gives a random tiny model reward
variance inside a group, so GRPO has signal. The copy task has no format term: it rewards every
letter alike, so it pulls a tiny policy towards one letter for every prompt (a collapse it does
not climb out of) instead of towards the right one.
"""

from __future__ import annotations

import dataclasses
import random
import string

DIGITS = string.digits
LETTERS = string.ascii_lowercase


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    alphabet: str  # characters an answer can contain
    format_weight: float = 0.1  # weight of the format term of the reward


def copy(n: int, letters: int = 8) -> list[Problem]:
    """ "x=" -> "x" for x cycling through the first `letters` lowercase letters (n problems)."""
    if not 1 <= letters <= len(LETTERS):
        raise ValueError(f"letters must be in [1, {len(LETTERS)}], got {letters}")
    return [
        Problem(f"{LETTERS[i % letters]}=", LETTERS[i % letters], LETTERS[:letters], format_weight=0.0)
        for i in range(n)
    ]


def arithmetic(n: int, seed: int, max_operand: int = 99) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append(Problem(f"{a}+{b}=", str(a + b), DIGITS))
    return out


def reverse(n: int, seed: int, min_len: int = 3, max_len: int = 6) -> list[Problem]:
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
        out.append(Problem(f"rev {s}=", s[::-1], LETTERS))
    return out


def reward(problem: Problem, response: str) -> float:
    """Verifiable reward in [0, 1] of `response` (already cut at EOS) for `problem` (see module doc)."""
    text = response.strip()
    if text.startswith(problem.answer):
        return 1.0
    matched = sum(1 for a, b in zip(problem.answer, text) if a == b) / len(problem.answer)
    in_alphabet = sum(c in problem.alphabet for c in text) / len(text) if text else 0.0
    return 0.5 * matched + problem.format_weight * in_alphabet
