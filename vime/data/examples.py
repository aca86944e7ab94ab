"""Example datasets in the formats users bring, generated (no downloads), deterministic by seed.

`gsm8k_rows`: GSM8K's format: `question`, and `answer` = a worked solution whose last line is `#### n` (an
integer). `boxed_rows`: MATH's format: `problem`, `solution` ending in `\\boxed{...}`, `answer` (a fraction in
LaTeX or an integer) and `level`. `scripts/make_gsm8k.py` writes them as .jsonl (GSM8K) and .parquet (boxed).
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Lee", "Mia")
ITEMS = ("apples", "books", "coins", "pens", "cards", "shells", "stamps", "eggs")


def _problem(rng: random.Random) -> tuple[str, list[str], int]:
    """(question, solution steps, integer answer) of one templated word problem."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    a, b = rng.randint(2, 40), rng.randint(2, 20)
    if kind == 0:
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?"
        return question, [f"{a}+{b}={a + b}"], a + b
    if kind == 1:
        a = a + b
        return (f"{name} has {a} {item} and gives away {b}. How many are left?", [f"{a}-{b}={a - b}"], a - b)
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return (f"{name} buys {a} bags of {b} {item}. How many {item} is that?", [f"{a}*{b}={a * b}"], a * b)
    c = rng.randint(2, 9)
    return (
        f"{name} has {a} {item}, buys {b} more, then gives {c} to a friend. How many are left?",
        [f"{a}+{b}={a + b}", f"{a + b}-{c}={a + b - c}"],
        a + b - c,
    )


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` GSM8K-format rows: {"question", "answer": steps then "#### <integer>", "id"}."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question, steps, answer = _problem(rng)
        rows.append({"question": question, "answer": "\n".join([*steps, f"#### {answer}"]), "id": f"s{seed}-{i}"})
    return rows


def boxed_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` MATH-format rows: a sum of two fractions, {"problem", "solution" ending in \\boxed{}, "answer", "level"}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        x = Fraction(rng.randint(1, 9), rng.randint(2, 9))
        y = Fraction(rng.randint(1, 9), rng.randint(2, 9))
        s = x + y
        answer = str(s.numerator) if s.denominator == 1 else f"\\frac{{{s.numerator}}}{{{s.denominator}}}"
        rows.append(
            {
                "problem": f"What is {x} + {y}? Put the answer in \\boxed{{}}.",
                "solution": f"{x} + {y} = \\boxed{{{answer}}}",
                "answer": answer,
                "level": 1 + (s.denominator > 9),
            }
        )
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_examples(out: Path, n_train: int = 512, n_test: int = 64, seed: int = 0) -> dict[str, Path]:
    """The example datasets under `out`: gsm8k_{train,test}.jsonl and boxed_{train,test}.parquet (the test splits
    drawn from another seed than the train ones)."""
    out = Path(out)
    return {
        "gsm8k_train": write_jsonl(gsm8k_rows(n_train, seed), out / "gsm8k_train.jsonl"),
        "gsm8k_test": write_jsonl(gsm8k_rows(n_test, seed + 1), out / "gsm8k_test.jsonl"),
        "boxed_train": write_parquet(boxed_rows(n_train, seed), out / "boxed_train.parquet"),
        "boxed_test": write_parquet(boxed_rows(n_test, seed + 1), out / "boxed_test.parquet"),
    }
