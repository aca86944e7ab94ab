"""Whole-`generate` rollout throughput, strict vs native vLLM, timed as an RL step waits for it.

    python benchmarks/rollout_generate.py --device cuda [--layers 36] [--passes 3]     # the H200 headline
    python benchmarks/rollout_generate.py --device cpu --passes 1                      # plumbing, tiny model
    python benchmarks/rollout_generate.py --device cuda --arch qwen3_30b_a3b [--layers 48]   # the MoE headline
    python benchmarks/rollout_generate.py --device cpu --arch qwen3_30b_a3b --passes 1       # plumbing, tiny MoE

An RL rollout is one `LLM.generate` over fresh prompts: prefill, mixed prefill + decode steps, every sampling step
and the decode tail, all inside the wall time the trainer waits for. This benchmark times exactly that call.
(`benchmarks/vllm_throughput.py` measures the marginal cost of a decode step over cached prompts; its figures are
secondary rows of this one, not the headline.)

Rows (`ROWS`; batch, prompts, new tokens):
- `mixed_fixed`: `batch` fresh prompts whose lengths are log-uniform in [64, 2048] tokens (RL prompt sets skew
  short, with a long tail), every request sampled to `--new-tokens` (`ignore_eos`).
- `mixed_eos`: the same prompts' distribution, each request stopping at its own length, drawn geometric with mean
  `--new-tokens` / 3 and capped at `--new-tokens` (the cap is the truncated share, about 5%). The stop is imposed
  (`max_tokens` per request, `ignore_eos`): a random-weight model almost never samples EOS, and both engines must
  do the same work for the ratio to mean anything. The scheduler sees requests finish at their own steps, as it
  does when responses end at EOS.
- secondary: `prefill` (prompts of 1024-2048 tokens, one new token each), `decode` (17-token prompts, decode-bound)
  and `single` (batch 1).
`--rows mixed_fixed,mixed_eos` keeps only the rows of those names (a 48-layer MoE run inside one device call).
Every (row, pass) draws its own prompts from a fixed seed: no prefix is ever reused (prefix caching stays on, as
in vime's engines, and finds nothing). Both engines get the same prompts in a pass.

Every engine lives in this process at once, CUDA graphs on all (strict: its FULL_DECODE_ONLY graphs, or
`strict_compiled`: vLLM's torch.compile with FULL_AND_PIECEWISE; native: vLLM's default compile and graphs), so the
passes interleave: pass p runs every row on every engine, the engines' order alternating from pass to pass. On CUDA
each engine takes `--memory` of the GPU (0.75; or a KV cache of `--kv-cache-gib`) and sleeps (vLLM's sleep mode,
level 1: weights to host memory, KV cache freed) while another one runs, as in vime's colocated runs; waking and
sleeping are not timed. On CPU (no sleep mode) they share the memory. Each engine is warmed up first (every batch
shape of the rows, mixed prefill and decode). Sampling at temperature 1 with each token's logprob returned, as
vime samples; no per-request seeds. Reported per row and engine: the median generated tokens/s over the passes, its
min-max spread, and strict / native of the medians; the GPU's SM clock, power and throttle reasons before each pass
and at the end.

Before any engine starts on CUDA, a run is refused (one line, with the most layers that fit) when the weights leave
too little KV cache for the largest row's whole batch (`check_gpu_memory`): vLLM would preempt, and the row would
not run at its batch.

Parity: from the first pass, `PARITY_PER_ROW` sequences of every row and engine are teacher-forced by rl_kernel's
reference (fp32 bits of every sampled token), while the engines sleep: every strict mode must show 0, native must
differ. Exit status 1
otherwise, or when an engine failed. Writes JSON (default benchmarks/results/rollout_generate_<device>.json,
`_<arch>` appended for an arch other than Qwen3-8B).

MoE (`--arch qwen3_30b_a3b`: Qwen3-30B-A3B's shapes, hidden 2048, 32 / 4 heads of 128, 128 experts, top-8,
expert FFN 768, vocab 151936; 48 layers by default). A 48-layer checkpoint is ~61 GB: more than the GPU
machine's disk takes beside the bundle, and two sleeping engines would keep ~120 GB of weights in its 128 GiB of
host memory. So (`--weights dummy`, the default for this arch on CUDA):
- the timed engines load vLLM's dummy weights (`load_format="dummy"`: every tensor filled from a fixed seed, in
  both engines; the strict model and vLLM's own fill different layouts, so their weights differ, their work per
  token does not), from a config-only checkpoint (the 48-layer config and the tokenizer beside 1 layer's weights);
- the engines run one after the other, not interleaved: each starts, warms up, runs every pass of every row and
  shuts down (no sleep mode) before the next starts; the passes' prompts are the same for every engine;
- parity is checked first (so that a run cut by its time limit keeps it) on a checkpoint of the same shapes with
  `--parity-layers` layers (2) and real (seeded) weights, on disk: an engine of each mode, with the timed
  engines' arguments, runs the first pass's `PARITY_PER_ROW` sampled requests of every row (the same prompts and
  lengths that were timed) and their tokens
  are teacher-forced by rl_kernel's reference in fp32 bits. What is checked is thus the strict engine's bits on
  what was benchmarked but for the layer count and the weights; the timed dummy-weight engines are not.
`--weights checkpoint` keeps the Qwen3-8B flow above (one on-disk checkpoint, interleaved sleeping engines).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vllm_throughput import CUDA_ENGINE, QWEN3_8B, STRICT_MODES, engine_makers, gpu_state  # noqa: E402
from rl_kernel.models.qwen3 import Qwen3Reference  # noqa: E402
from rl_kernel.models.tiny import make_tiny_qwen3  # noqa: E402
from vime.config.preflight import qwen3_parameters  # noqa: E402
from vime.loop.consistency import compare  # noqa: E402

PARITY_PER_ROW = 3
TEMPERATURE = 1.0
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2)  # the CPU plumbing's tiny Qwen3-MoE
ARCHS = {"qwen3_8b": (QWEN3_8B, 36), "qwen3_30b_a3b": (QWEN3_30B_A3B, 48)}  # (cuda shape, default layers)
GIB = 2**30
RESERVE_BYTES = 3 * GIB  # beside weights and KV cache: activations, CUDA graphs, workspaces (vLLM's profile: ~2)


@dataclass(frozen=True)
class Row:
    """One timed `generate`: `batch` prompts with lengths in [min_prompt, max_prompt] (log-uniform), each sampled
    to `new_tokens` (`stop="fixed"`) or to its own drawn length (`stop="spread"`)."""

    name: str
    batch: int
    min_prompt: int
    max_prompt: int
    new_tokens: int
    stop: str = "fixed"
    headline: bool = True


def rows_for(device: str, new_tokens: int) -> list[Row]:
    """The benchmark's rows: RL-shaped rollouts at batch 64 and 256 (the headline), then the secondary rows. On CPU
    the same rows at a tiny model's scale (plumbing only)."""
    if device == "cpu":
        return [
            Row("mixed_fixed", 4, 8, 64, new_tokens),
            Row("mixed_eos", 4, 8, 64, new_tokens, stop="spread"),
            Row("prefill", 4, 48, 64, 1, headline=False),
            Row("single", 1, 8, 64, new_tokens, headline=False),
        ]
    return [
        Row("mixed_fixed", 64, 64, 2048, new_tokens),
        Row("mixed_fixed", 256, 64, 2048, new_tokens),
        Row("mixed_eos", 64, 64, 2048, new_tokens, stop="spread"),
        Row("mixed_eos", 256, 64, 2048, new_tokens, stop="spread"),
        Row("prefill", 64, 1024, 2048, 1, headline=False),
        Row("decode", 256, 17, 17, new_tokens, headline=False),
        Row("single", 1, 64, 2048, new_tokens, headline=False),
    ]


def selected_rows(args) -> list[Row]:
    """`rows_for` the run's device, only those `--rows` names (all when it is empty), in their order."""
    rows = rows_for(args.device, args.new_tokens)
    names = [n for n in (args.rows or "").split(",") if n]
    unknown = sorted(set(names) - {r.name for r in rows})
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; known: {sorted({r.name for r in rows})}")
    return [r for r in rows if not names or r.name in names]


def draw_requests(row: Row, seed: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, new tokens per request) of `row`, from `seed` alone: prompt lengths log-uniform in [min_prompt,
    max_prompt], token ids uniform in [10, vocab); lengths geometric with mean new_tokens / 3, capped at new_tokens,
    for `stop="spread"`."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = math.log(row.min_prompt), math.log(row.max_prompt + 1)
    lengths = (
        torch.exp(lo + (hi - lo) * torch.rand(row.batch, generator=g)).long().clamp(row.min_prompt, row.max_prompt)
    )
    prompts = [torch.randint(10, vocab, (int(n),), generator=g).tolist() for n in lengths]
    if row.stop == "fixed":
        return prompts, [row.new_tokens] * row.batch
    p = min(1.0, 3.0 / row.new_tokens)
    u = torch.rand(row.batch, generator=g).clamp_min(1e-12)
    drawn = (torch.log(u) / math.log1p(-p)).ceil().long() if p < 1 else torch.ones(row.batch, dtype=torch.long)
    return prompts, drawn.clamp(1, row.new_tokens).tolist()


def request_seed(row_index: int, pass_index: int) -> int:
    """Prompts of one (row, pass): fresh in every pass, the same for every engine of the pass."""
    return 1_000_003 * (pass_index + 1) + 7919 * row_index


class Engine:
    """One vLLM engine of `mode` over the checkpoint at `path` and its request maker."""

    def __init__(self, mode: str, path: Path, device: str, engine_args: dict):
        from vllm import LLM

        make_kwargs, self.make_params = engine_makers(mode)
        self.mode = mode
        t0 = time.perf_counter()
        self.llm = LLM(**make_kwargs(path, device=device, **engine_args))
        self.start_s = round(time.perf_counter() - t0, 1)
        self.sleeps = bool(engine_args.get("enable_sleep_mode"))

    def sleep(self) -> None:
        """Give the GPU back (weights to host memory, KV cache freed) until `wake`; no-op without sleep mode."""
        if self.sleeps:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self.sleeps:
            self.llm.wake_up()

    def generate(self, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list]:
        """Wall seconds of one `generate` over `prompts` (each to its length in `lengths`) and its outputs."""
        params = [self.make_params(temperature=TEMPERATURE, max_tokens=n, ignore_eos=True) for n in lengths]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, outputs

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def warm_up(engine: Engine, rows: list[Row], vocab: int) -> None:
    """Every batch size of the rows through a mixed prefill + decode `generate` (a few new tokens), so that no
    kernel compiles and no graph is captured inside a timed call."""
    for batch in sorted({r.batch for r in rows}):
        warm = Row("warm", batch, min(r.min_prompt for r in rows), max(r.max_prompt for r in rows), 8)
        engine.generate(*draw_requests(warm, seed=batch, vocab=vocab))


def parity_picks(n: int) -> list[int]:
    """The requests of a row of `n` whose tokens parity checks: `PARITY_PER_ROW` of them (first, middle, last)."""
    return sorted({0, n // 2, n - 1})[:PARITY_PER_ROW]


def parity_sample(row_index: int, prompts: list[list[int]], outputs: list, picks=None) -> list[dict]:
    """Sequences `picks` (default `parity_picks`) of one row with their sampled tokens and logprobs."""
    picks = parity_picks(len(prompts)) if picks is None else picks
    samples = []
    for i in picks:
        c = outputs[i].outputs[0]
        samples.append(
            {
                "row": row_index,
                "prompt": prompts[i],
                "tokens": list(c.token_ids),
                "logprobs": [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)],
            }
        )
    return samples


def parity(path: Path, samples: dict[str, list[dict]], device: str) -> dict[str, list[dict]]:
    """Per mode and row: sampled tokens whose fp32 logprob bits differ from rl_kernel's teacher forcing."""
    reference = Qwen3Reference.from_pretrained(path, device=device)
    result: dict[str, list[dict]] = {}
    for mode, rows in samples.items():
        per_row: dict[int, list[int]] = {}
        for s in rows:
            want = reference.sequence_logprobs([s["prompt"] + s["tokens"]], [len(s["prompt"])], TEMPERATURE)[0]
            got = torch.tensor(s["logprobs"], dtype=torch.float32)
            tally = per_row.setdefault(s["row"], [0, 0])
            tally[0] += compare([got], [want.float().cpu()]).mismatch_count
            tally[1] += got.numel()
        result[mode] = [{"row": r, "mismatches": m, "tokens": n} for r, (m, n) in sorted(per_row.items())]
    del reference
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def rate_key(row: Row) -> str:
    """What a row's throughput counts: prompt tokens/s for the prefill-only row (one new token each), else
    generated tokens/s."""
    return "prompt_tokens_per_s" if row.new_tokens == 1 else "tokens_per_s"


def summarize(rows: list[Row], timings: dict[str, list[list[dict]]], modes: list[str]) -> list[dict]:
    """Per row: every mode's tokens/s per pass (`rate_key`), median, min, max; strict modes' median over native's."""
    table = []
    for i, row in enumerate(rows):
        entry = {"row": row.name, "batch": row.batch, "headline": row.headline, "counts": rate_key(row), "modes": {}}
        for mode in modes:
            tps = [p[i][rate_key(row)] for p in timings[mode]]
            entry["modes"][mode] = {
                "tokens_per_s": tps,
                "median": round(statistics.median(tps), 1),
                "min": min(tps),
                "max": max(tps),
                "generated_tokens": timings[mode][-1][i]["generated_tokens"],
                "prompt_tokens": timings[mode][-1][i]["prompt_tokens"],
            }
        if "native" in modes:
            base = entry["modes"]["native"]["median"]
            entry["ratio_to_native"] = {m: round(entry["modes"][m]["median"] / base, 3) for m in modes if m != "native"}
        table.append(entry)
    return table


def print_table(title: str, table: list[dict], modes: list[str]) -> None:
    print(f"\n{title}")
    head = f"{'row':>12} {'batch':>5} " + " ".join(f"{m + ' tok/s med (min-max)':>34}" for m in modes)
    exact = [m for m in modes if m != "native"]
    print(head + ("".join(f" {m + '/native':>16}" for m in exact) if "native" in modes else ""))
    for e in table:
        cells = " ".join(
            f"{e['modes'][m]['median']:>12,.0f} ({e['modes'][m]['min']:,.0f}-{e['modes'][m]['max']:,.0f})".rjust(34)
            for m in modes
        )
        ratios = "".join(f" {e['ratio_to_native'][m]:>16.3f}" for m in exact) if "native" in modes else ""
        print(f"{e['row'] + ('' if e['headline'] else '*'):>12} {e['batch']:>5} {cells}{ratios}")
    print("(* secondary rows; prefill counts prompt tokens/s, the others generated tokens/s)")


def model_bytes(shape: dict, layers: int) -> tuple[int, int]:
    """(bf16 weight bytes, KV-cache bytes per token) of a Qwen3 (or Qwen3-MoE) of `shape` at `layers` layers,
    untied embeddings (parameters counted by the trainer preflight's `qwen3_parameters`)."""
    heads = {"num_attention_heads": shape["num_heads"], "num_key_value_heads": shape["num_kv_heads"]}
    config = shape | heads | {"num_hidden_layers": layers, "tie_word_embeddings": False}
    return 2 * qwen3_parameters(config), 2 * layers * 2 * shape["num_kv_heads"] * shape["head_dim"]


def largest_row(rows: list[Row], passes: int, vocab: int) -> tuple[Row, int]:
    """The row whose batch holds the most tokens (prompts + new tokens) in any pass, and that count."""
    totals = []
    for i, row in enumerate(rows):
        for p in range(passes):
            prompts, lengths = draw_requests(row, request_seed(i, p), vocab)
            totals.append((sum(map(len, prompts)) + sum(lengths), i))
    tokens, i = max(totals)
    return rows[i], tokens


def check_gpu_memory(args, rows: list[Row], total_bytes: int) -> None:
    """Refuse (one line: what to pass instead) a run whose weights leave a GPU of `total_bytes` too little KV
    cache to hold the largest row's whole batch: vLLM would preempt, and the row would not run at its batch."""
    shape = ARCHS[args.arch][0]
    row, tokens = largest_row(rows, args.passes, shape["vocab_size"])

    def kv_room(layers: int) -> tuple[float, float, float]:
        weights, per_token = model_bytes(shape, layers)
        if args.kv_cache_gib is not None:
            room = min(args.kv_cache_gib * GIB, total_bytes - weights - RESERVE_BYTES)
        else:
            room = args.memory * total_bytes - weights - RESERVE_BYTES
        return weights, per_token * tokens, room

    weights, need, room = kv_room(args.layers)
    if need <= room:
        return
    fit = next((n for n in range(args.layers - 1, 0, -1) if (r := kv_room(n))[1] <= r[2]), 0)
    budget = f"--kv-cache-gib {args.kv_cache_gib}" if args.kv_cache_gib is not None else f"--memory {args.memory}"
    raise SystemExit(
        f"rollout_generate: {args.layers} {args.arch} layers take {weights / GIB:.1f} GiB of weights and the row "
        f"{row.name}@{row.batch} needs {need / GIB:.1f} GiB of KV cache ({tokens:,} tokens); {budget} of this "
        f"{total_bytes / GIB:.1f} GiB GPU leaves {max(room, 0) / GIB:.1f} GiB for it: pass --layers {fit} (the most "
        "that fit), smaller rows (--rows), or run on a larger GPU"
    )


def engine_args(device: str, args) -> dict:
    if device == "cpu":
        return dict(seed=0, max_model_len=256, max_num_batched_tokens=128, max_num_seqs=8, gpu_memory_utilization=0.3)
    memory = {"gpu_memory_utilization": args.memory}
    if args.kv_cache_gib is not None:
        memory["kv_cache_memory_bytes"] = int(args.kv_cache_gib * GIB)
    return CUDA_ENGINE | memory | {"enable_sleep_mode": True}


def arch_shapes(arch: str, device: str) -> dict:
    """`make_tiny_qwen3`'s keyword arguments for `arch` (`ARCHS`): on CUDA its shapes, made on the GPU with
    init_std 0.02; on CPU the tiny test shapes (a tiny Qwen3-MoE, `TINY_MOE`, for the MoE arch)."""
    if device == "cuda":
        return ARCHS[arch][0] | {"device": "cuda", "init_std": 0.02}
    return TINY_MOE if arch == "qwen3_30b_a3b" else {}


def make_checkpoint(root: Path, args, layers: int) -> Path:
    """A seeded checkpoint of `args.arch` with `layers` layers on disk (CUDA: the arch's shape; CPU: tiny)."""
    if args.device == "cuda":
        path = make_tiny_qwen3(root, num_layers=layers, **arch_shapes(args.arch, args.device))
        gc.collect()
        torch.cuda.empty_cache()  # the engines' memory checks must see the GPU free
        return path
    return make_tiny_qwen3(root, **arch_shapes(args.arch, args.device))


def config_only_checkpoint(root: Path, args) -> Path:
    """The arch's checkpoint directory for `load_format="dummy"`: the `args.layers`-layer config and the tokenizer,
    beside one layer's weights (which the dummy loader never reads)."""
    path = make_checkpoint(root, args, 1)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    n = args.layers if args.device == "cuda" else config["num_hidden_layers"]
    config["num_hidden_layers"] = n
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:1] * n
    if "max_window_layers" in config:
        config["max_window_layers"] = n
    config_file.write_text(json.dumps(config, indent=2))
    return path


def run_sequential(args) -> int:
    """The `--weights dummy` flow (module doc, MoE): parity of the first pass's requests on a `--parity-layers`
    checkpoint with real weights, then the timed engines on dummy weights one after the other."""
    modes = args.modes.split(",")
    rows = selected_rows(args)
    out = args.out or default_out(args)
    eargs = engine_args(args.device, args) | {"enable_sleep_mode": False}
    with tempfile.TemporaryDirectory() as tmp:
        dummy_path = config_only_checkpoint(Path(tmp) / "dummy", args)
        vocab = json.loads((dummy_path / "config.json").read_text())["vocab_size"]
        result: dict = {"device": args.device, "arch": args.arch, "layers": args.layers, "passes": args.passes}
        result |= {"weights": "dummy", "parity_layers": args.parity_layers, "modes": modes, "interleaved": False}
        result["rows"] = [r.__dict__ for r in rows]
        result["gpu"] = [{"when": "start", **gpu_state()}] if args.device == "cuda" else []
        timings: dict[str, list[list[dict]]] = {}
        failed, starts = {}, {}
        picked = {}  # the first pass's parity requests per row (prompts are drawn from seeds: known up front)
        for i, row in enumerate(rows):
            prompts, lengths = draw_requests(row, request_seed(i, 0), vocab)
            keep = parity_picks(len(prompts))
            picked[i] = ([prompts[j] for j in keep], [lengths[j] for j in keep])
        result["parity"] = sequential_parity(Path(tmp) / "parity", args, modes, picked, eargs, failed)
        out.parent.mkdir(parents=True, exist_ok=True)  # first, so that a run cut short by its time limit keeps it
        out.write_text(json.dumps(result | {"failed": failed, "partial": True}, indent=1))
        for m in modes:
            try:
                engine = Engine(m, dummy_path, args.device, eargs | {"load_format": "dummy"})
            except Exception as e:  # noqa: BLE001 - report the engine that failed; no ratio without it
                failed[m] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{m}: failed to start: {failed[m]}; no further engine timed", flush=True)
                break
            starts[m] = engine.start_s
            warm_up(engine, rows, vocab)
            timings[m] = []
            for p in range(args.passes):
                if args.device == "cuda":
                    result["gpu"].append({"when": f"{m} before pass {p + 1}", **gpu_state()})
                timings[m].append([])
                for i, row in enumerate(rows):
                    prompts, lengths = draw_requests(row, request_seed(i, p), vocab)
                    wall, outputs = engine.generate(prompts, lengths)
                    timings[m][p].append(timing(wall, prompts, outputs))
                print(
                    f"pass {p + 1} {m}: "
                    + ", ".join(f"{r.name}@{r.batch} {t['tokens_per_s']:,.0f}" for r, t in zip(rows, timings[m][p]))
                    + " tok/s",
                    flush=True,
                )
                result["timings"] = timings  # kept if a later pass runs out of time
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result | {"failed": failed, "partial": True}, indent=1))
            engine.shutdown()
            wait_for_gpu(args.memory)
        done = [m for m in modes if m in timings]
        result["engine_start_s"] = starts
        if args.device == "cuda":
            result["gpu"].append({"when": "end", **gpu_state()})
        result["timings"], result["failed"] = timings, failed
        result["table"] = summarize(rows, timings, done)
    return report(args, result, done, out, failed)


def sequential_parity(root: Path, args, modes: list[str], picked: dict, eargs: dict, failed: dict) -> dict:
    """Per mode and row: mismatches of the first pass's picked requests, run by an engine of that mode over a
    `--parity-layers` checkpoint with real weights, against teacher forcing. An engine that fails is recorded in
    `failed` (as "<mode> (parity)") and skipped."""
    path = make_checkpoint(root, args, args.parity_layers if args.device == "cuda" else 2)
    samples: dict[str, list[dict]] = {}
    for m in modes:
        try:
            engine = Engine(m, path, args.device, eargs)
        except Exception as e:  # noqa: BLE001 - report the engine that failed, check the others
            failed[f"{m} (parity)"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"{m} (parity): failed to start: {failed[f'{m} (parity)']}", flush=True)
            continue
        samples[m] = []
        for i in sorted(picked):
            prompts, lengths = picked[i]
            _, outputs = engine.generate(prompts, lengths)
            samples[m] += parity_sample(i, prompts, outputs, picks=range(len(prompts)))
        engine.shutdown()
        wait_for_gpu(args.memory)
    return parity(path, samples, args.device)


def wait_for_gpu(fraction: float, timeout_s: float = 120.0) -> None:
    """Until `fraction` of the GPU is free again (a shut-down engine's process releases its memory as it exits;
    the next engine's start checks for its share) or `timeout_s`; no-op without CUDA."""
    if not torch.cuda.is_available():
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free >= fraction * total:
            return
        time.sleep(2)


def timing(wall: float, prompts: list[list[int]], outputs: list) -> dict:
    """One timed `generate`'s record: wall seconds, token counts and rates."""
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "wall_s": round(wall, 4),
        "generated_tokens": generated,
        "prompt_tokens": sum(map(len, prompts)),
        "tokens_per_s": round(generated / wall, 1),
        "prompt_tokens_per_s": round(sum(map(len, prompts)) / wall, 1),
    }


def default_out(args) -> Path:
    suffix = "" if args.arch == "qwen3_8b" else f"_{args.arch}"
    return Path(__file__).resolve().parent / "results" / f"rollout_generate_{args.device}{suffix}.json"


def run(args) -> int:
    modes = args.modes.split(",")
    rows = selected_rows(args)
    out = args.out or default_out(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "qwen3", args, args.layers)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        result: dict = {"device": args.device, "layers": args.layers, "passes": args.passes, "modes": modes}
        result |= {"arch": args.arch, "weights": "checkpoint", "interleaved": True}
        result["rows"] = [r.__dict__ for r in rows]
        result["gpu"] = [{"when": "start", **gpu_state()}] if args.device == "cuda" else []
        engines, failed = {}, {}
        for mode in modes:
            try:
                engines[mode] = Engine(mode, path, args.device, engine_args(args.device, args))
                warm_up(engines[mode], rows, vocab)
                engines[mode].sleep()  # the next engine starts on a free GPU
            except Exception as e:  # noqa: BLE001 - report the engine that failed; no ratio without it
                failed[mode] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{mode}: failed to start: {failed[mode]}; no passes run", flush=True)
                engines.pop(mode, None)
                break
        if failed:  # the table is strict / native in one process: timing the engines left would answer nothing
            for engine in engines.values():
                engine.shutdown()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result | {"failed": failed}, indent=1))
            return 1
        result["engine_start_s"] = {m: engines[m].start_s for m in modes}
        timings: dict[str, list[list[dict]]] = {m: [] for m in modes}
        samples: dict[str, list[dict]] = {m: [] for m in modes}
        for p in range(args.passes):
            if args.device == "cuda":
                result["gpu"].append({"when": f"before pass {p + 1}", **gpu_state()})
            for m in modes:
                timings[m].append([])
            order = modes if p % 2 == 0 else modes[::-1]
            for m in order:
                engines[m].wake()
                for i, row in enumerate(rows):
                    prompts, lengths = draw_requests(row, request_seed(i, p), vocab)
                    wall, outputs = engines[m].generate(prompts, lengths)
                    timings[m][p].append(timing(wall, prompts, outputs))
                    if p == 0:
                        samples[m] += parity_sample(i, prompts, outputs)
                engines[m].sleep()
                print(
                    f"pass {p + 1} {m}: "
                    + ", ".join(f"{r.name}@{r.batch} {t['tokens_per_s']:,.0f}" for r, t in zip(rows, timings[m][p]))
                    + " tok/s",
                    flush=True,
                )
            if p == 0:  # checked while the engines sleep: a run cut short by its time limit keeps it
                result["parity"] = parity(path, samples, args.device)
            result["timings"] = timings  # kept if a later pass runs out of time
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result | {"failed": failed, "partial": True}, indent=1))
        if args.device == "cuda":
            result["gpu"].append({"when": "end", **gpu_state()})
        for engine in engines.values():
            engine.shutdown()
        result["timings"] = timings
        result["failed"] = failed
        result["table"] = summarize(rows, timings, modes)
    return report(args, result, modes, out, failed)


def report(args, result: dict, modes: list[str], out: Path, failed: dict) -> int:
    """Print the table, engine starts, parity and GPU state; write the JSON; the exit status (module doc)."""
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    arch = {"qwen3_8b": "Qwen3-8B", "qwen3_30b_a3b": "Qwen3-30B-A3B"}[args.arch]
    how = "interleaved" if result["interleaved"] else "engine after engine"
    weights = "dummy weights, " if result["weights"] == "dummy" else ""
    print_table(
        f"whole generate on {device_name}: {args.layers} {arch}-shaped layers ({weights}fresh prompts), "
        f"{args.passes} passes {how}, temperature {TEMPERATURE}, new tokens {args.new_tokens} (fixed) / spread (eos)"
        if args.device == "cuda"
        else f"whole generate on CPU (tiny {arch} shape family, {weights}plumbing), {args.passes} passes {how}",
        result["table"],
        modes,
    )
    if result["weights"] == "dummy":
        print(f"parity: on a {result['parity_layers']}-layer checkpoint of real weights (module doc)")
    print("engine start s: " + ", ".join(f"{m} {s}" for m, s in result["engine_start_s"].items()))
    for m, per_row in result["parity"].items():
        bad, total = sum(x["mismatches"] for x in per_row), sum(x["tokens"] for x in per_row)
        print(f"parity {m}: {bad} / {total} sampled tokens differ from teacher forcing")
    for g in result["gpu"]:
        print(f"gpu {g}")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    strict_ok = all(x["mismatches"] == 0 for m, r in result["parity"].items() if m != "native" for x in r)
    native = result["parity"].get("native")
    native_differs = native is None or any(x["mismatches"] for x in native)
    return 0 if strict_ok and native_differs and not failed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--arch", choices=tuple(ARCHS), default="qwen3_8b", help="the model's shapes (module doc)")
    parser.add_argument("--layers", type=int, default=None, help="cuda: layers (qwen3_8b 36, qwen3_30b_a3b 48)")
    parser.add_argument(
        "--weights",
        choices=("checkpoint", "dummy"),
        default=None,
        help="timed engines' weights (module doc): default dummy for qwen3_30b_a3b on cuda, else checkpoint",
    )
    parser.add_argument("--parity-layers", type=int, default=2, help="--weights dummy: the parity checkpoint's layers")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (cuda 256, cpu 8)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument(
        "--rows",
        default="",
        help="only the rows of these names (e.g. mixed_fixed,mixed_eos); each row's prompts are drawn from its "
        "position in the selection",
    )
    parser.add_argument(
        "--modes", default="strict,native", help="engines, all alive at once: strict, native, strict_compiled"
    )
    parser.add_argument("--memory", type=float, default=0.75, help="cuda: gpu_memory_utilization of each engine")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="cuda: each engine's KV cache in GiB (vLLM's kv_cache_memory_bytes) instead of what --memory leaves; "
        "three or more engines on an 80 GB card need it (their profile counts what sleeping engines freed)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - {*STRICT_MODES, "native"}
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; known: {[*STRICT_MODES, 'native']}")
    if args.layers is None:
        args.layers = ARCHS[args.arch][1]
    if args.weights is None:
        args.weights = "dummy" if args.arch == "qwen3_30b_a3b" and args.device == "cuda" else "checkpoint"
    if args.layers < 1 or args.parity_layers < 1:
        parser.error(f"--layers ({args.layers}) and --parity-layers ({args.parity_layers}) must be >= 1")
    if args.new_tokens is None:
        args.new_tokens = 256 if args.device == "cuda" else 8
    if args.device == "cpu":
        import os

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        check_gpu_memory(args, selected_rows(args), torch.cuda.mem_get_info()[1])
    return run_sequential(args) if args.weights == "dummy" else run(args)


if __name__ == "__main__":
    sys.exit(main())
