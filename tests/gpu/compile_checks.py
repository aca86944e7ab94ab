"""Compile every Triton kernel launch of the strict ops for an H100/H200 (sm_90) on a machine with no GPU.

    python tests/gpu/compile_checks.py [--stage ttir|ttgir|llir|ptx|layouts|resources] [--json PATH]

The Triton interpreter (tests/gpu/interpreter_checks.py) runs a kernel's Python on the host, and accepts code
that the compiler refuses: a `None` argument placed in a tuple that a `@triton.jit` helper returns compiles
nowhere, and runs fine there. This script makes the ops' real launches on CPU tensors (the launchers need no
GPU to pick their configurations), stops each at `JITFunction.run` and compiles it instead, for
`GPUTarget("cuda", 90, 32)`, with whichever Triton is importable (on the GPU image: 3.6; carry its wheel's
`triton` first on PYTHONPATH to check against it). Each distinct (kernel, signature, constexprs) compiles once.

`--stage layouts` stops at TTGIR and records, per launch, the tensors of 256 or more elements that every thread
holds whole (`whole_in_each_thread`: the compiler computes all of such a block in each thread).

`--stage resources` compiles to the cubin and records, per launch, what ptxas allotted (`cuobjdump -res-usage`,
beside Triton's ptxas): registers a thread, bytes a thread spilled to the stack, and the launch's dynamic shared
memory: spills are where a kernel's time goes to local memory.

Exit status 0 when every launch compiled, 1 otherwise (each failure: kernel, its constexprs, the compiler's first
error line)."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

SM90 = GPUTarget("cuda", 90, 32)
_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def _arg_type(value) -> str | None:
    """Triton's signature type of one runtime argument; None: a constexpr (Triton makes None one)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    base = getattr(value, "base", None)  # a host TensorDescriptor
    if isinstance(base, torch.Tensor):
        return f"tensordesc<{_DTYPES[base.dtype]}{list(value.block_shape)}>"
    raise TypeError(f"no Triton signature type for {type(value).__name__}")


class Recorder:
    """Stands in for `JITFunction.run`: compiles each distinct launch for `target` up to `stage`."""

    def __init__(self, stage: str, target: GPUTarget = SM90):
        self.stage, self.target = stage, target
        self.seen: dict[tuple, dict] = {}

    def __call__(self, fn: JITFunction, *args, grid=None, warmup=False, **kwargs):
        names = fn.arg_names
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        options = {k: v for k, v in kwargs.items() if k not in names}
        signature, constexprs = {}, {}
        for i, name in enumerate(names):
            value = bound.get(name, fn.params[i].default)
            kind = "constexpr" if fn.params[i].is_constexpr else _arg_type(value)
            if kind in (None, "constexpr"):
                signature[name], constexprs[(i,)] = "constexpr", value
            else:
                signature[name] = kind
        key = (fn.__name__, tuple(signature.items()), tuple(sorted((k, repr(v)) for k, v in constexprs.items())))
        if key in self.seen:
            return None
        record = {
            "kernel": fn.__name__,
            "constexprs": {names[i]: repr(v) for (i,), v in constexprs.items()},
            "options": {k: repr(v) for k, v in options.items()},
        }
        try:
            if self.stage == "layouts":
                record["whole_in_each_thread"] = whole_in_each_thread(ttgir(fn, signature, constexprs, options))
            else:
                compiled = triton.compile(ASTSource(fn, signature, constexprs), target=self.target, options=options)
                if self.stage == "resources":
                    record.update(resources(compiled.asm["cubin"]), shared_bytes=compiled.metadata.shared)
                else:
                    _ = compiled.asm[self.stage]
            record["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure is reported, the others still compile
            record["ok"] = False
            record["error"] = _first_line(e)
        self.seen[key] = record
        return None


def ttgir(fn: JITFunction, signature: dict, constexprs: dict, options: dict, target: GPUTarget = SM90) -> str:
    """The TTGIR of one launch for `target` (the layouts Triton picked), without LLVM, PTX or ptxas."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    src = ASTSource(fn, signature, constexprs)
    opts = backend.parse_options(options)
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    metadata: dict = {}
    return str(stages["ttgir"](stages["ttir"](module, metadata), metadata))


def _registers_per_thread(kind: str, body: str, shape: list[int]) -> int:
    """Elements of a tensor of `shape` that one thread holds under a #ttg.linear or #ttg.blocked layout."""
    if kind == "linear":
        return 2 ** re.search(r"register = \[(.*?)\], lane", body).group(1).count("[")
    spt, tpw, wpc = (
        [int(v) for v in re.search(key + r" = \[([0-9, ]+)\]", body).group(1).split(",")]
        for key in ("sizePerThread", "threadsPerWarp", "warpsPerCTA")
    )
    held = 1
    for size, a, b, c in zip(shape, spt, tpw, wpc):
        held *= min(size, a) * max(1, -(-size // (a * b * c)))
    return held


def whole_in_each_thread(text: str, min_elements: int = 256) -> list[str]:
    """The tensor types of a TTGIR module (of `min_elements` or more) that every thread holds whole: a layout
    with no element spread over lanes or warps, so every thread computes all of it."""
    layouts = {m[1]: (m[2], m[3]) for m in re.finditer(r"^#(\w+) = #ttg\.(\w+)<\{(.*)\}>", text, re.M)}
    found = set()
    for m in re.finditer(r"tensor<([0-9x]+)x(\w+), #(\w+)>", text):
        shape = [int(v) for v in m[1].split("x")]
        kind, body = layouts.get(m[3], (None, ""))
        numel = math.prod(shape)
        spread = kind not in ("linear", "blocked") or _registers_per_thread(kind, body, shape) < numel
        if numel >= min_elements and not spread:
            found.add(f"tensor<{m[1]}x{m[2]}, #{m[3]}>")
    return sorted(found)


def resources(cubin: bytes) -> dict:
    """{"registers", "spill_bytes"} of a one-kernel cubin: a thread's registers and its stack frame (ptxas's spill
    stores land there), as `cuobjdump -res-usage` reports them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(usage[1]), "spill_bytes": int(usage[2])}


def _first_line(e: Exception) -> str:
    """The compiler's own reason: the innermost cause's message (a CompilationError's text is source lines)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [line for line in str(e).splitlines() if line.strip() and line.strip() != "^"]
    return f"{type(e).__name__}: {lines[-1] if lines else repr(e)}"[:300]


def _launches() -> dict[str, Callable[[], None]]:
    """The strict ops' launches on CPU tensors: attention at Qwen3-8B attention shapes (packed and paged, both
    schedules, the log-sum-exp output), the MoE router, grouped expert GEMMs (gate/up read through the sorted
    order; down) and combine at Qwen3-30B-A3B's (128 experts, top 8), QK-norm + RoPE
    and RoPE (the angle table), the fused residual RMSNorm, SwiGLU and a decode-sized GEMM at Qwen3-8B's."""
    from rl_kernel.backends.triton import activation, attention, gemm, moe, norm, rope

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 40000, 17])  # RoPE's

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    def varlen(schedule):
        lens = [300, 17, 1]
        cu = torch.tensor([0, *lens]).cumsum(0)
        q, k, v = rand(cu[-1], 32, 128), rand(cu[-1], 8, 128), rand(cu[-1], 8, 128)
        attention.varlen_attention(q, k, v, cu, 128**-0.5, schedule=schedule)

    def varlen_lse():
        cu = torch.tensor([0, 64, 100])
        q, k, v = rand(100, 32, 128), rand(100, 8, 128), rand(100, 8, 128)
        attention.varlen_attention(q, k, v, cu, 128**-0.5, lse=torch.empty(32, 100))

    def paged(schedule, block_size=16, table_blocks=256):
        b = 4
        k_cache, v_cache = rand(b * table_blocks, block_size, 8, 128), rand(b * table_blocks, block_size, 8, 128)
        table = torch.arange(b * table_blocks, dtype=torch.int32).reshape(b, table_blocks)
        seq_lens = torch.tensor([1, 40, 4000, 17], dtype=torch.int32)
        qsl = torch.arange(b + 1, dtype=torch.int32)
        attention.paged_attention(
            rand(b, 32, 128), k_cache, v_cache, table, seq_lens, qsl, 128**-0.5, schedule=schedule
        )

    return {
        "varlen_fused": lambda: varlen("fused"),
        "varlen_split": lambda: varlen("split"),
        "varlen_lse": varlen_lse,
        "paged_fused": lambda: paged("fused"),
        "paged_split": lambda: paged("split"),
        "paged_fused_tma": lambda: paged("fused", block_size=64, table_blocks=64),  # strict CUDA engines' pages
        "paged_split_tma": lambda: paged("split", block_size=64, table_blocks=64),
        "route": lambda: moe.route(torch.randn(64, 128, generator=gen), 8, True),
        "grouped_gate_up": lambda: moe.grouped_linear(
            rand(8, 256), torch.tensor([10, 0, 6]), rand(3, 128, 256), torch.bfloat16, source=torch.arange(16), slots=2
        ),
        "grouped_down": lambda: moe.grouped_linear(
            rand(16, 64), torch.tensor([10, 0, 6]), rand(3, 256, 64), torch.float32
        ),
        "combine": lambda: moe.combine(
            torch.randn(4, 8, 2048, generator=gen), torch.rand(4, 8, generator=gen), torch.bfloat16
        ),
        "qk_norm_rope": lambda: rope.qk_norm_rope(
            rand(4, 40, 128), rand(128), rand(128), 32, 1e-6, positions, 1e6, 128
        ),
        "rms_norm_residual": lambda: norm.rms_norm_residual(rand(4, 4096), rand(4, 4096), rand(4096), 1e-6),
        "silu_and_mul": lambda: activation.silu_and_mul(rand(4, 2 * 12288)),
        "gemm_decode": lambda: gemm.matmul_fp32(rand(64, 4096), rand(6144, 4096), schedule="fused"),
        "rope_at": lambda: rope.rotate_at(rand(4, 32, 128), positions, 1e6, 128),
    }


def run_checks(
    stage: str = "ttir", names: list[str] | None = None, launches: dict[str, Callable[[], None]] | None = None
) -> list[dict]:
    """Each launch of `launches` (default `_launches()`; or `names` of them) compiled for sm_90 up to `stage`; one
    record per distinct compile, with the launch that made it."""
    recorder = Recorder(stage)
    original = JITFunction.run
    records = []
    JITFunction.run = lambda fn, *a, **kw: recorder(fn, *a, **kw)  # type: ignore[method-assign]
    try:
        for name, launch in (_launches() if launches is None else launches).items():
            if names and name not in names:
                continue
            before = set(recorder.seen)
            try:
                launch()
            except Exception as e:  # noqa: BLE001 - a launcher that fails before its kernel is a failure too
                records.append({"launch": name, "kernel": None, "ok": False, "error": f"{type(e).__name__}: {e}"})
            records += [{"launch": name, **recorder.seen[k]} for k in recorder.seen if k not in before]
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=("ttir", "ttgir", "llir", "ptx", "layouts", "resources"), default="ttir")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    records = run_checks(args.stage)
    for r in records:
        status = "ok  " if r["ok"] else "FAIL"
        detail = r.get("error", r.get("whole_in_each_thread", ""))
        if "registers" in r:
            detail = f"{r['registers']} registers, {r['spill_bytes']} B spilled, {r['shared_bytes']} B shared"
        print(f"{status} {r['launch']:<14} {r['kernel'] or '-':<22} {detail}")
    print(
        f"triton {triton.__version__}, sm_90 {args.stage}: {sum(r['ok'] for r in records)} of {len(records)} compiled"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"triton": triton.__version__, "stage": args.stage, "records": records}, indent=1)
        )
    return 0 if records and all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
