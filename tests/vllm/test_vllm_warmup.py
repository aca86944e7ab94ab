"""The strict vLLM model's Triton warm-up covers every kernel specialization serving meets (pure logic, CPU).

The strict forward runs on CPU tensors with the Triton backend forced and every Triton kernel replaced by a
recorder: each launch is bound by Triton's own binder (`create_function_from_signature`, the function that makes
a JIT kernel's cache key: constexprs, options, pointer dtypes and 16-byte alignment, integer classes == 1 and
divisible by 16, less the kernel's `do_not_specialize`) and its key recorded, nothing is launched. The keys of
decode, prefill and mixed batches of an engine's limits must all be among the warm-up's. The twin: after vLLM's
own warm-up alone (its profiling forward, its decode graph captures) serving meets keys not compiled yet, which is
how `_attn_kernel` and `_rms_norm_kernel` compiled during inference.

What this cannot show without a GPU: that Triton 3.6 on the H200 keys a kernel the same way (this binder is the
installed Triton's), that vLLM's tensors have the alignments modelled here, and that no other JIT (vLLM's own,
torch) compiles during inference; the JIT monitor of a GPU run (scripts/gpu_vllm.sh) says that.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402
from vllm_test_utils import qwen3_layer_config  # noqa: E402

from rl_kernel import backends  # noqa: E402
from rl_kernel.backends.triton import activation, attention, gemm, norm, rope  # noqa: E402
from rl_kernel.integrations.vllm.model import kv_cache_views, paged_attention  # noqa: E402
from rl_kernel.integrations.vllm.warmup import dummy_batch, warm_up, warm_up_limit, warm_up_tokens  # noqa: E402
from rl_kernel.models.layers import Qwen3Model  # noqa: E402
from rl_kernel.models.qwen3 import Qwen3Config  # noqa: E402

KERNELS = [
    (norm, "_rms_norm_kernel"),
    (activation, "_silu_and_mul_kernel"),
    (rope, "_rope_kernel"),
    (rope, "_qk_norm_rope_kernel"),
    (rope, "_angle_table_kernel"),  # built once, at the warm-up's first rope
    (attention, "_attn_kernel"),
    (gemm, "_fused_kernel"),
    (gemm, "_split_kernel"),
    (gemm, "_tree_kernel"),
]
# An engine's limits (scheduler token budget past the norm's and the attention schedule's size thresholds).
LIMITS = dict(max_tokens=4096, max_seqs=64, block_size=16, max_model_len=4112)


def _key(spec) -> tuple:
    return tuple(s if isinstance(s, tuple) else (s,) for s in spec)


class Recorder:
    """Stands in for a JIT kernel: records the specialization key of every launch, under the kernel's own
    `do_not_specialize` (`keys`) and with every argument specialized (`keys_all`); launches nothing."""

    def __init__(self, kernel):
        self.names = [p.name for p in kernel.params]
        everything = [copy.copy(p) for p in kernel.params]
        for p in everything:
            p.do_not_specialize = False
        self.binders = {
            "keys": create_function_from_signature(kernel.signature, kernel.params, BaseBackend),
            "keys_all": create_function_from_signature(kernel.signature, everything, BaseBackend),
        }
        self.keys, self.keys_all = set(), set()

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **kwargs):
        for attr, binder in self.binders.items():
            _, spec, options = binder(*args, **kwargs)
            getattr(self, attr).add((_key(spec), tuple(sorted(options.items()))))


@pytest.fixture(scope="module")
def recorded():
    """(recorders by kernel name, the model, run(meta_batches)): the strict forward on CPU under the Triton
    backend, its launches recorded."""
    mp = pytest.MonkeyPatch()
    recorders = {}
    for module, name in KERNELS:
        recorders[name] = Recorder(getattr(module, name))
        mp.setattr(module, name, recorders[name])
    mp.setattr(backends, "strict_backend", lambda op, device: "triton")
    hf = qwen3_layer_config(256, 512, 32, 8, 128, vocab_size=256, max_position_embeddings=8192)
    config = Qwen3Config.from_hf(hf, "test")
    model = Qwen3Model(config, None, torch.bfloat16)
    yield recorders, model
    mp.undo()


class Serving:
    """vLLM's tensors for a batch: slices of persistent buffers (block table [max_seqs, width], query starts,
    sequence lengths, token ids, positions), the cache in FlashAttention's layout (blocks, block_size, Hkv, 2d)."""

    def __init__(self, model, limits):
        self.model, self.limits = model, limits
        width = -(-limits["max_model_len"] // limits["block_size"])
        s, d = model.shape, model.config.head_dim
        blocks = limits["max_seqs"] * width
        self.kv = torch.zeros(blocks, limits["block_size"], s.kv_heads, 2 * d, dtype=torch.bfloat16).transpose(1, 2)
        self.table = torch.arange(blocks, dtype=torch.int32).view(limits["max_seqs"], width)
        self.qsl = torch.zeros(limits["max_seqs"] + 1, dtype=torch.int32)
        self.lens = torch.zeros(limits["max_seqs"], dtype=torch.int32)
        self.ids = torch.zeros(limits["max_tokens"], dtype=torch.int64)
        self.pos = torch.zeros(limits["max_tokens"], dtype=torch.int64)

    def run(self, q_lens: list[int], ctx_lens: list[int], padded: int | None = None) -> None:
        """One step: sequence i brings q_lens[i] new tokens of ctx_lens[i] >= q_lens[i]; `padded`: the token count
        vLLM pads a CUDA-graph batch to."""
        from rl_kernel.integrations.vllm.model import kv_cache_views

        b, t = len(q_lens), sum(q_lens)
        n = padded or t
        self.qsl[1 : b + 1] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        self.lens[:b] = torch.tensor(ctx_lens, dtype=torch.int32)
        meta = SimpleNamespace(query_start_loc=self.qsl[: b + 1], seq_lens=self.lens[:b], block_table=self.table[:b])
        k_cache, v_cache = kv_cache_views(self.kv, "FLASH_ATTN", self.model.config.head_dim)

        def attn(layer, q, k, v):
            out = torch.zeros_like(q)
            out[:n] = paged_attention(q[:n], k_cache, v_cache, meta, self.model.scale)
            return out

        with torch.no_grad():
            hidden = self.model(self.ids[:n], self.pos[:n], attn)
            self.model.lm_head.logits(hidden[:b])


def _record(recorders, run) -> dict:
    """The keys recorded while `run()` runs, by kernel: (under do_not_specialize, everything specialized)."""
    for r in recorders.values():
        r.keys.clear()
        r.keys_all.clear()
    run()
    return {n: (set(r.keys), set(r.keys_all)) for n, r in recorders.items()}


@pytest.fixture(scope="module")
def warmed(recorded):
    recorders, model = recorded
    counts = []
    views = {"paged_attention": paged_attention, "kv_cache_views": kv_cache_views}
    keys = _record(recorders, lambda: counts.extend(warm_up(model, device=torch.device("cpu"), **views, **LIMITS)))
    assert counts == warm_up_tokens(LIMITS["max_tokens"])
    return keys


def _serving_keys(recorded, steps) -> dict:
    recorders, model = recorded
    serving = Serving(model, LIMITS)
    return _record(recorders, lambda: [serving.run(*step) for step in steps])


def _decode_and_prefill_steps() -> list:
    seqs, budget, ctx = LIMITS["max_seqs"], LIMITS["max_tokens"], LIMITS["max_model_len"] - 16
    steps = [([1] * b, [ctx - b] * b, None) for b in range(1, seqs + 1)]  # decode, every batch size
    steps += [([1] * b, [17 + i for i in range(b)], p) for b, p in ((3, 4), (5, 8), (13, 16), (50, 56))]  # padded
    steps += [
        ([t], [t], None)
        for t in sorted({*range(1, 70), 127, 128, 129, 1000, 1985, 1986, 2047, 2048, 2049, 3001, budget})
    ]  # one prompt
    steps += [([t, 1, 1], [t + 100, 7, 4000], None) for t in (61, 2045, budget - 2)]  # chunked prefill beside decodes
    return steps


@pytest.fixture(scope="module")
def serving_keys(recorded):
    return _serving_keys(recorded, _decode_and_prefill_steps())


# engines' sequence limits, block sizes and model lengths, for the warm-up's dummy batches
ENGINE_LIMITS = dict(
    max_seqs=st.integers(1, 256), block_size=st.sampled_from([16, 32]), max_model_len=st.integers(1, 4096)
)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 4096), **ENGINE_LIMITS)
def test_dummy_batch_stays_inside_max_model_len(tokens, max_seqs, block_size, max_model_len):
    """Every warm-up sequence fits the engine's max_model_len and its block-table row (a longer one read table
    entries past its row: an illegal address on the H200 when the token budget exceeded max_model_len)."""
    width = -(-max_model_len // block_size)
    max_len = min(max_model_len, width * block_size)
    seqs = min(tokens, max_seqs)
    if tokens > seqs * max_len:
        with pytest.raises(ValueError, match="do not fit"):
            dummy_batch(tokens, max_seqs, max_len, width, torch.device("cpu"))
        return
    meta = dummy_batch(tokens, max_seqs, max_len, width, torch.device("cpu"))
    q_lens = meta.query_start_loc.diff()
    assert int(meta.query_start_loc[-1]) == tokens and len(q_lens) == seqs
    assert torch.equal(q_lens, meta.seq_lens) and int(q_lens.min()) >= 1 and int(q_lens.max()) <= max_model_len
    assert int(q_lens.max()) == min(tokens - seqs + 1, max_len)  # the long sequence is as long as it may be


def test_warm_up_token_counts():
    assert warm_up_tokens(1) == [1]
    assert warm_up_tokens(5) == [1, 2, 3, 4, 5]
    counts = warm_up_tokens(4096)
    assert counts[0] == 1 and counts[-1] == 4096 and {2048, 2049, 1024, 1025} <= set(counts)
    with pytest.raises(ValueError, match="max_tokens"):
        warm_up_tokens(0)


def test_serving_keys_are_all_warmed(warmed, serving_keys):
    for name, (keys, _) in serving_keys.items():
        missing = keys - warmed[name][0]
        assert not missing, f"{name}: {len(missing)} specializations met in serving were not warmed: {missing}"
    # the paths that matter were exercised
    assert serving_keys["_attn_kernel"][0] and serving_keys["_rms_norm_kernel"][0]
    assert serving_keys["_qk_norm_rope_kernel"][0]


@pytest.fixture(scope="module")
def vllm_warmed(recorded):
    """What vLLM's own warm-up launches: its profiling forward at the token budget (attention skipped: no
    metadata) and its CUDA-graph captures of decode batches (padded to the capture sizes), those of an engine
    of 48 sequences: its decode batches all take the split attention schedule (the fused one starts at about
    62 sequences of these heads, `pick_schedule`)."""
    recorders, model = recorded
    serving = Serving(model, LIMITS)
    ctx = LIMITS["max_model_len"] - 16
    captures = [1, 2, 4, 8, *range(16, 49, 8)]

    def run():
        with torch.no_grad():
            n = LIMITS["max_tokens"]
            model(serving.ids[:n], serving.pos[:n], lambda layer, q, k, v: torch.zeros_like(q))
        for size in captures:
            serving.run([1] * size, [ctx] * size)

    return _record(recorders, run)


def test_vllm_warm_up_alone_leaves_keys_to_compile_in_serving(vllm_warmed, serving_keys):
    """The twin: vLLM's own warm-up leaves serving keys of the attention uncompiled: its fused schedule (a long
    prefill, beside decode graphs of at most 48 sequences) whatever the specialization, and, with every integer
    specialized (the kernel before `do_not_specialize`), counts of another class than the profiling run's. (The
    norm, whose tile depends on its width only, no longer shows this.)"""
    assert serving_keys["_attn_kernel"][0] - vllm_warmed["_attn_kernel"][0]
    assert serving_keys["_attn_kernel"][1] - vllm_warmed["_attn_kernel"][1], "_attn_kernel: the twin shows nothing"


def test_warm_up_covers_both_attention_schedules_and_norm_forms(warmed):
    """The split and fused attention schedules (chosen by the batch's size), the norm with and without its
    fused residual, and the QK-norm (its two weights) with RoPE in one kernel: the norm kernel's two-weight form
    no longer runs in the strict forward on Triton."""
    split = attention._attn_kernel.names.index("SPLIT")
    assert {spec[split][1] for spec, _ in warmed["_attn_kernel"][0]} == {True, False}
    residual = norm._rms_norm_kernel.names.index("HAS_RESIDUAL")
    assert {spec[residual][1] for spec, _ in warmed["_rms_norm_kernel"][0]} == {True, False}
    two_weights = norm._rms_norm_kernel.names.index("TWO_WEIGHTS")
    assert {spec[two_weights][1] for spec, _ in warmed["_rms_norm_kernel"][0]} == {False}
    assert warmed["_qk_norm_rope_kernel"][0] and not warmed["_rope_kernel"][0]


@pytest.mark.slow  # one forward per example: about 2 s each on a loaded 2-core machine
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3000)), min_size=1, max_size=LIMITS["max_seqs"]))
def test_mixed_batches_stay_within_warmed_keys(recorded, warmed, batch):
    q_lens = [q for q, _ in batch]
    if sum(q_lens) > LIMITS["max_tokens"]:
        q_lens = [1] * len(q_lens)
    ctx = [min(q + extra, LIMITS["max_model_len"]) for q, (_, extra) in zip(q_lens, batch)]
    keys = _serving_keys(recorded, [(q_lens, ctx, None)])
    for name, (got, _) in keys.items():
        assert got <= warmed[name][0], f"{name}: {got - warmed[name][0]}"


@settings(max_examples=60, deadline=None)
@given(max_tokens=st.integers(1, 16384), **ENGINE_LIMITS)
def test_every_warm_up_count_fits_the_engine(max_tokens, max_seqs, block_size, max_model_len):
    """Every token count the warm-up runs has a dummy batch, whatever the budget beside max_num_seqs x
    max_model_len (an engine of budget 8192, 8 sequences of 560 failed to start before the limit)."""
    width = -(-max_model_len // block_size)
    limit = warm_up_limit(max_tokens, max_seqs, max_model_len)
    assert limit == min(max_tokens, max_seqs * max_model_len)
    for tokens in warm_up_tokens(limit):
        meta = dummy_batch(tokens, max_seqs, max_model_len, width, torch.device("cpu"))
        assert int(meta.query_start_loc[-1]) == tokens
