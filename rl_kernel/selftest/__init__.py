"""Check, on this machine, that rl_kernel's strict ops give the same bits in every layout.

    python -m rl_kernel.selftest [--device cpu|cuda] [--json PATH] [--accuracy]

Each cell computes the same logical outputs of one op in two layouts of one invariance axis (a row
alone vs inside batches of other sizes and positions; packed vs padded; prefill vs decode vs chunked
prefill; paged KV with other page sizes and shuffled block tables; 1 vs 2 threads; vocab or K
sharded over gloo ranks) and compares their raw bit patterns on every element, once in strict mode
and once in native mode. The exit code is 1 when any strict cell differs. Native cells that differ
are expected (the framework's kernels do not promise invariance) and are shown, not judged.
`--accuracy` also prints each op's error against an fp64 reference (the table in docs/accuracy.md).
Homes: `matrix` (the single-process cells), `ranks` (the sharded cells, on spawned ranks), `accuracy`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import rl_kernel as rk
from rl_kernel.selftest import accuracy, matrix, ranks


def run_matrix(
    device: str = "cpu",
    seed: int = 0,
    distributed: bool = True,
    ops: list[str] | None = None,
) -> list[dict]:
    """Every cell (of `ops`, default all) in strict and native mode: the single-process cells
    (`matrix`), then the sharded ones (`ranks`) unless `distributed` is False; one dict per cell (op, axis,
    inputs, backend, strict and native outcomes)."""
    return matrix.run_cells(device, seed, ops) + (ranks.run_rank_cells(device, ops) if distributed else [])


def cpu_name() -> str:
    """This machine's CPU model (/proc/cpuinfo's `model name`, else platform's), with torch's CPU capability: what
    decides the bits of the native kernels, so which native cells differ from the strict ones."""
    import platform
    from pathlib import Path

    name = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name or platform.processor() or 'unknown'} [{torch.backends.cpu.get_cpu_capability()}]"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit code: 1 when a strict cell differs."""
    parser = argparse.ArgumentParser(prog="python -m rl_kernel.selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--accuracy", action="store_true", help="also measure errors against fp64")
    parser.add_argument("--no-distributed", action="store_true", help="skip the cells that spawn ranks")
    parser.add_argument("--ops", help="comma-separated ops to check (default: all), e.g. linear,rope")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")

    start = time.time()
    print(
        f"rl_kernel selftest  device={args.device}  backend={rk.get_backend()}  torch={torch.__version__}  "
        f"threads={torch.get_num_threads()}  cpu={cpu_name()} (native cells' results depend on it)"
    )
    print("contracts (id, fingerprint):")
    print(matrix.format_contracts())
    ops = args.ops.split(",") if args.ops else None
    rows = run_matrix(args.device, distributed=not args.no_distributed, ops=ops)
    if not rows:
        parser.error(f"--ops {args.ops}: no such op in the matrix")
    print()
    print(matrix.format_table(rows))
    errors = accuracy.measure_accuracy(args.device) if args.accuracy else None
    if errors:
        print()
        print(accuracy.format_accuracy(errors))
    strict_fail = [r for r in rows if not r["strict"]["passed"]]
    native_fail = [r for r in rows if not r["native"]["passed"]]
    elapsed = time.time() - start
    print(
        f"\n{'OK' if not strict_fail else 'FAILED'}: strict bit-identical in {len(rows) - len(strict_fail)}/"
        f"{len(rows)} cells; native differs in {len(native_fail)}/{len(rows)} (expected where the framework's "
        f"kernels are not invariant); {elapsed:.1f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": args.device,
                    "backend": rk.get_backend(),
                    "torch": torch.__version__,
                    "contracts": {c.id: c.fingerprint for c in rk.contracts.all_contracts().values()},
                    "cells": rows,
                    "accuracy": errors,
                    "strict_failures": len(strict_fail),
                    "native_failures": len(native_fail),
                    "seconds": elapsed,
                },
                f,
                indent=2,
            )
    return 1 if strict_fail else 0
