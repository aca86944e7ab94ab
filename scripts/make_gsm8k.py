"""Write the example datasets (vime/data/examples.py): GSM8K-format word problems (.jsonl, `#### n` answers) and
MATH-format \\boxed{} problems (.parquet), deterministic by seed.

    python scripts/make_gsm8k.py --out data/gsm8k          # then: python -m vime.train +experiment=gsm8k
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vime.data.examples import write_examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/gsm8k"), help="directory to write (default data/gsm8k)")
    ap.add_argument("--train", type=int, default=512, help="rows of each train split")
    ap.add_argument("--test", type=int, default=64, help="rows of each test split")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name, path in write_examples(args.out, args.train, args.test, args.seed).items():
        print(f"{name:12s} {path}")


if __name__ == "__main__":
    main()
