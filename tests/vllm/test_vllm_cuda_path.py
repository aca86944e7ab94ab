"""The vLLM CUDA path's pure logic, on CPU (no machine here runs vLLM on a GPU): engine arguments per
device and transport, the translation of rl_kernel's `ipc` push into vLLM's weight-update API, and the
strict model's attention on FlashAttention's KV-cache layout. The `llm` here is a stand-in that records
the calls and parses every payload with vLLM's own ipc dataclasses; the KV caches are allocated by vLLM's
own `create_kv_cache_views` in the layout vLLM resolves for the backend, and the attention metadata is
vLLM's `FlashAttentionMetadata`, padded as vLLM pads it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CompilationConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadata
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, get_supported_kv_cache_layouts
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm_test_utils import RecordingLLM, cuda_rollout

import rl_kernel as rk
from rl_kernel.bits import bits, same_bits
from rl_kernel.integrations.vllm import (
    LOGITS_PROCESSOR,
    STRICT_CUDA_BLOCK_SIZE,
    WEIGHT_TRANSFER_BACKEND,
    WORKER_EXTENSION,
    native_llm_kwargs,
    strict_llm_kwargs,
)
from rl_kernel.integrations.vllm.ipc import VllmIPCReceiver
from rl_kernel.integrations.vllm.model import (
    RLKernelQwen3ForCausalLM,
    _check_strict_sampling,
    _contiguous_blocks,
    _paged_attention_compact,
    _paged_attention_in_place,
    kv_cache_views,
    paged_attention,
    write_kv,
)
from rl_kernel.weights.transfer import TensorMeta, WeightSender, WeightVersionError
from vime.errors import WeightSyncError

pytestmark = pytest.mark.vllm

HANDLE = {"GPU-0000": ("rebuild_cuda_tensor args",)}


def test_cpu_kwargs_are_unchanged(tiny_qwen3_path):
    strict = strict_llm_kwargs(tiny_qwen3_path)
    assert strict["enforce_eager"] is True and "compilation_config" not in strict
    assert strict["weight_transfer_config"] == {"backend": WEIGHT_TRANSFER_BACKEND}
    assert strict["logits_processors"] == [LOGITS_PROCESSOR] and strict["worker_extension_cls"] == WORKER_EXTENSION
    assert native_llm_kwargs(tiny_qwen3_path, seed=3) == {
        "model": str(tiny_qwen3_path),
        "logprobs_mode": "processed_logprobs",
        "enforce_eager": True,
        "weight_transfer_config": {"backend": WEIGHT_TRANSFER_BACKEND},
        "worker_extension_cls": WORKER_EXTENSION,
        "seed": 3,
    }
    with pytest.raises(ValueError, match="enforce_eager=True"):
        strict_llm_kwargs(tiny_qwen3_path, enforce_eager=False)
    with pytest.raises(ValueError, match="on CPU weights go through 'rl_kernel_cpu'"):
        strict_llm_kwargs(tiny_qwen3_path, transport="ipc")


@pytest.mark.parametrize("transport, backend", [(None, "ipc"), ("ipc", "ipc"), ("nccl", "nccl")])
def test_cuda_kwargs(tiny_qwen3_path, transport, backend):
    strict = strict_llm_kwargs(tiny_qwen3_path, device="cuda", transport=transport)
    assert "enforce_eager" not in strict and strict["logprobs_mode"] == "processed_logits"
    assert strict["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    # the strict model loads in place: vLLM's ipc engine without its layerwise reload (rl_kernel_ipc)
    assert strict["weight_transfer_config"] == {"backend": "rl_kernel_ipc" if backend == "ipc" else backend}
    # KV blocks of one attention key chunk (one TMA box each) unless the caller picks another size
    assert strict["block_size"] == STRICT_CUDA_BLOCK_SIZE
    assert strict_llm_kwargs(tiny_qwen3_path, device="cuda", block_size=16)["block_size"] == 16
    native = native_llm_kwargs(tiny_qwen3_path, device="cuda:0", transport=transport)
    assert "enforce_eager" not in native and "compilation_config" not in native and "block_size" not in native
    assert native["weight_transfer_config"] == {"backend": backend}
    # vLLM's own config classes take these spellings
    assert CompilationConfig(**strict["compilation_config"]).cudagraph_mode.name == "FULL_DECODE_ONLY"
    assert WeightTransferConfig(**native["weight_transfer_config"]).backend == backend


def test_the_strict_cuda_block_is_one_attention_key_chunk():
    """The strict engine's KV block holds one key chunk of the Triton attention, whose TMA reads need it."""
    pytest.importorskip("triton")
    from rl_kernel.backends.triton import attention

    assert STRICT_CUDA_BLOCK_SIZE == attention.CHUNK
    assert None not in attention._descriptors(*torch.zeros(2, 3, STRICT_CUDA_BLOCK_SIZE, 2, 16).unbind(), 64)


def test_cuda_kwargs_refuse_what_strict_mode_cannot_run(tiny_qwen3_path):
    assert strict_llm_kwargs(tiny_qwen3_path, device="cuda", enforce_eager=True)["enforce_eager"] is True
    assert strict_llm_kwargs(tiny_qwen3_path, device="cuda", compilation_config={"cudagraph_mode": "NONE"})[
        "compilation_config"
    ] == {"cudagraph_mode": "NONE"}
    with pytest.raises(ValueError, match="pure-decode batches only.*'PIECEWISE'"):
        strict_llm_kwargs(tiny_qwen3_path, device="cuda", compilation_config={"cudagraph_mode": "PIECEWISE"})
    with pytest.raises(ValueError, match="one of \\('ipc', 'nccl'\\), got 'object_store'"):
        native_llm_kwargs(tiny_qwen3_path, device="cuda", transport="object_store")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        native_llm_kwargs(tiny_qwen3_path, device="tpu")


def test_a_strict_model_on_vllms_v2_runner_refuses_to_start():
    """Fail closed: vLLM's V2 model runner (which takes no custom logits processor) would sample from its own
    log-softmax; the strict model refuses it, and with the strict processor on V1 it starts."""
    v1 = SimpleNamespace(use_v2_model_runner=False, model_config=SimpleNamespace(logits_processors=[LOGITS_PROCESSOR]))
    _check_strict_sampling(v1)
    v2 = SimpleNamespace(use_v2_model_runner=True, model_config=v1.model_config)
    with pytest.raises(rk.StrictModeError, match="V2 model runner samples without the strict logits processor"):
        _check_strict_sampling(v2)


def ipc_llm() -> RecordingLLM:
    """`vllm.LLM` with the `ipc` engine, recorded; payloads parsed by vLLM's ipc dataclasses."""
    return RecordingLLM(IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo)


class HandleSender(WeightSender):
    """rl_kernel's sender with a stand-in IPC handle (the buffer stays here: nothing reads it)."""

    def _ship(self, msg, buf):
        self._send({**msg, "ipc_handle": HANDLE})
        return buf


def _wire(handle) -> HandleSender:
    """A sender whose messages go to `handle` (a receiver's `handle`, an engine's `receive_weights`)."""
    replies: list[dict] = []

    def send(msg):
        ack = handle(msg)
        if ack is not None:
            replies.append(ack)

    return HandleSender("ipc", send, replies.pop, bucket_bytes=512)


WEIGHTS = {"a": torch.ones(8, 8), "b": torch.ones(2, 64, dtype=torch.bfloat16), "c": torch.ones(64)}  # 256 B each
EXPECTED = {n: TensorMeta.of(n, t) for n, t in WEIGHTS.items()}


def test_ipc_push_becomes_vllm_weight_update_calls():
    llm = ipc_llm()
    receiver = VllmIPCReceiver(llm, EXPECTED)
    ack = _wire(receiver.handle).push(WEIGHTS.items(), version=1)
    assert ack == {"version": 1, "tensors": 3, "bytes": 768, "buckets": 2}
    init, start, up0, up1, finish = llm.calls
    assert init == ("init", IPCWeightTransferInitInfo(packed=True)) and start == ("start",)
    assert finish == ("finish", "1") and receiver.version == 1
    assert (up0[1].names, up0[1].dtype_names, up0[1].shapes) == (["a", "b"], ["float32", "bfloat16"], [[8, 8], [2, 64]])
    assert (up0[1].ipc_handles, up0[1].tensor_sizes) == (HANDLE, [256, 256])
    assert (up1[1].names, up1[1].tensor_sizes) == (["c"], [256])


@pytest.mark.parametrize(
    "weights, version, error",
    [
        (WEIGHTS, 0, "version 0 offered to an engine serving 0"),
        ({"a": WEIGHTS["a"], "b": WEIGHTS["b"]}, 1, "lacks 1 weights, e.g. \\['c'\\]"),
        (WEIGHTS | {"d": torch.ones(64)}, 1, "no weight 'd'"),
        (WEIGHTS | {"c": torch.ones(64, dtype=torch.float16)}, 1, "c: pushed float16\\[64\\], engine holds float32"),
    ],
)
def test_ipc_push_that_does_not_fit_fails_before_vllm_sees_it(weights, version, error):
    llm = ipc_llm()
    with pytest.raises((WeightVersionError, KeyError, ValueError), match=error):
        _wire(VllmIPCReceiver(llm, EXPECTED).handle).push(weights.items(), version=version)
    assert [c[0] for c in llm.calls] == ["init"]


def test_padded_or_handleless_buckets_are_refused():
    odd = {"n": torch.ones(3)}  # 12 bytes in a 256-byte slot: vLLM's reader would misplace what follows
    llm = ipc_llm()
    with pytest.raises(ValueError, match="1 tensor\\(s\\) of bucket 0 are padded to 256 bytes, e.g. \\['n'\\]"):
        _wire(VllmIPCReceiver(llm, {"n": TensorMeta.of("n", odd["n"])}).handle).push(odd.items(), version=1)
    receiver = VllmIPCReceiver(ipc_llm(), EXPECTED)
    meta = EXPECTED["a"]
    start = {
        "op": "start",
        "version": 1,
        "names": list(EXPECTED),
        "dtype_names": [m.dtype_name for m in EXPECTED.values()],
        "shapes": [list(m.shape) for m in EXPECTED.values()],
    }
    receiver.handle(start)
    with pytest.raises(ValueError, match="bucket 0 has no ipc_handle: vLLM engines take the ipc transport only"):
        receiver.handle(
            {
                "op": "bucket",
                "version": 1,
                "bucket": 0,
                "names": ["a"],
                "dtype_names": ["float32"],
                "shapes": [[8, 8]],
                "tensor_sizes": [meta.nbytes],
            }
        )


def _cuda_rollout(model_path):
    return cuda_rollout(model_path, ipc_llm())


def test_vllm_rollout_on_cuda_fails_closed_with_weight_sync_errors(tiny_qwen3_path):
    from rl_kernel.models.qwen3 import load_hf_state_dict

    rollout = _cuda_rollout(tiny_qwen3_path)
    state = load_hf_state_dict(tiny_qwen3_path)
    start = {
        "op": "start",
        "version": 1,
        "names": list(state),
        "dtype_names": ["bfloat16"] * len(state),
        "shapes": [list(t.shape) for t in state.values()],
    }
    with pytest.raises(WeightSyncError, match="rollout engine 0: weight push refused: version 1 lacks 1 weights"):
        rollout.receive_weights(
            {
                **start,
                "names": start["names"][1:],
                "dtype_names": start["dtype_names"][1:],
                "shapes": start["shapes"][1:],
            }
        )
    assert rollout.receive_weights(start) is None and rollout.llm.calls[-1] == ("start",)
    with pytest.raises(WeightSyncError, match="push of version 2 started while version 1"):
        rollout.receive_weights({**start, "version": 2})
    with pytest.raises(
        WeightSyncError, match="asked to serve weight version 1; the last ipc push was version 0 and vLLM serves 0"
    ):
        rollout.set_version(1)
    with pytest.raises(WeightSyncError, match="only as trainer rank 0's ipc push \\(receive_weights\\)"):
        rollout.update_weights({}, 1)
    with pytest.raises(WeightSyncError, match="vLLM engines join no rl_kernel NCCL group"):
        rollout.join_weight_group("127.0.0.1", 1, 1, 2)


def test_vllm_rollout_on_cuda_serves_the_version_its_push_finished(tiny_qwen3_path):
    rollout = _cuda_rollout(tiny_qwen3_path)
    rollout._receiver = VllmIPCReceiver(rollout.llm, EXPECTED)
    _wire(rollout.receive_weights).push(WEIGHTS.items(), version=3)
    assert rollout.set_version(3) == 3 == rollout.version
    with pytest.raises(WeightSyncError, match="asked to serve weight version 4; the last ipc push was version 3"):
        rollout.set_version(4)


# ---- the strict model's attention on FlashAttention's KV-cache layout ------------------------------------------

BLOCKS, KV_HEADS, HEADS, BLOCK_SIZE, HEAD_DIM, SCALE = 16, 2, 4, 16, 32, 0.2
BACKENDS = {"CPU_ATTN": CPUAttentionBackend, "FLASH_ATTN": FlashAttentionBackend}


def _caches(backend: str, dtype: torch.dtype, layout: KVCacheLayout | None = None, seed: int = 0):
    """Two layers' caches as vLLM's worker allocates them (`create_kv_cache_views` over one int8 buffer) in
    `layout`, default the one vLLM resolves for `backend` alone; filled with random bytes. (raw, views)"""
    layout = layout or get_supported_kv_cache_layouts([BACKENDS[backend]])[0]
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=dtype)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=2 * BLOCKS * page,
        layers=["l0", "l1"],
        layer_stride=BLOCKS * page if layout.is_layer_compact else page,
        block_stride=page if layout.is_layer_compact else 2 * page,
    )
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (tensor.size,), dtype=torch.int8, generator=g)
    return raw, create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)


def test_vllm_resolves_the_layouts_the_views_take():
    assert get_supported_kv_cache_layouts([FlashAttentionBackend])[0] == KVCacheLayout.LBNHC
    assert get_supported_kv_cache_layouts([CPUAttentionBackend]) == [KVCacheLayout.LBHNC]
    assert _caches("FLASH_ATTN", torch.float32)[1][1].shape == (BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    fa = kv_cache_views(_caches("FLASH_ATTN", torch.float32)[1][1], "FLASH_ATTN", HEAD_DIM)
    cpu = kv_cache_views(_caches("CPU_ATTN", torch.float32)[1][1], "CPU_ATTN", HEAD_DIM)
    assert all(v.shape == (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for v in (*fa, *cpu))
    assert all(_contiguous_blocks(v) for v in fa) and not any(_contiguous_blocks(v) for v in cpu)


def _expected_write(layer: torch.Tensor, backend: str, k, v, slots) -> None:
    """The writes of `slots` (-1 skipped) straight into the logical [B, Hkv, N, 2d] layer cache, read as
    `backend` reads it (FLASH_ATTN: [k | v] per token; CPU_ATTN: a block's key rows, then its value rows)."""
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        b, off = divmod(slot, BLOCK_SIZE)
        if backend == "FLASH_ATTN":
            layer[b, :, off] = torch.cat([k[t], v[t]], dim=-1)
        else:
            rows = layer[b].view(KV_HEADS, 2 * BLOCK_SIZE, HEAD_DIM)
            rows[:, off], rows[:, BLOCK_SIZE + off] = k[t], v[t]


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "CPU_ATTN"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "slots",
    [
        [5, -1, 40, 17, -1, -1],  # real tokens, then vLLM's CUDA-graph padding (and one in between)
        [-1, 33, 2, 0],  # a padded token first; a real write to slot 0
        [-1, -1, -1],  # CUDA-graph capture: every slot -1
    ],
)
def test_writer_puts_the_bits_where_the_views_read_them_and_nothing_else(backend, dtype, slots):
    raw, layers = _caches(backend, dtype)
    expected_raw, expected_layers = _caches(backend, dtype)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = kv_cache_views(layers[1], backend, HEAD_DIM)
    write_kv(k, v, k_cache, v_cache, torch.tensor(slots))
    _expected_write(expected_layers[1], backend, k, v, slots)
    assert torch.equal(raw, expected_raw)  # both layers, every byte: padded slots wrote nothing
    for t, slot in enumerate(slots):
        if slot >= 0:
            b, off = divmod(slot, BLOCK_SIZE)
            assert torch.equal(bits(k_cache[b, off]), bits(k[t])) and torch.equal(bits(v_cache[b, off]), bits(v[t]))


def _decode_batch(dtype: torch.dtype, seed: int = 0):
    """(q, layer cache, FlashAttentionMetadata) of a batch as vLLM builds it: sequences (context
    length, new tokens) of a decode, chunked prefills and a prefill over random distinct physical blocks
    (block 0 is vLLM's null block); the block table wider than needed with stale block ids past each
    sequence's blocks; two padded requests (no token, seq_len 0, table row NULL_BLOCK_ID)."""
    g = torch.Generator().manual_seed(seed)
    _, layers = _caches("FLASH_ATTN", dtype, seed=seed)
    for layer in layers:
        layer.copy_(torch.randn(layer.shape, generator=g).to(dtype))
    seqs = [(37, 1), (70, 5), (16, 16), (1, 1)]
    need = [-(-n // BLOCK_SIZE) for n, _ in seqs]
    width = max(need) + 3
    table = torch.randint(1, BLOCKS, (len(seqs) + 2, width), generator=g, dtype=torch.int32)
    physical = (torch.randperm(BLOCKS - 1, generator=g) + 1).to(torch.int32)
    for row, n in enumerate(need):
        table[row, :n], physical = physical[:n], physical[n:]
    table[len(seqs) :] = NULL_BLOCK_ID
    q_lens = [q for _, q in seqs] + [0, 0]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in seqs] + [0, 0], dtype=torch.int32)
    tokens = int(qsl[-1])
    meta = FlashAttentionMetadata(
        num_actual_tokens=tokens,
        max_query_len=max(q_lens),
        query_start_loc=qsl,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),
    )
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, layers[0], meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_attention_equals_the_compacting_call_bitwise(dtype):
    q, layer, meta = _decode_batch(dtype)
    k_cache, v_cache = kv_cache_views(layer, "FLASH_ATTN", HEAD_DIM)
    with rk.mode("strict"):
        in_place = _paged_attention_in_place(q, k_cache, v_cache, meta, SCALE)
        compact = _paged_attention_compact(q, k_cache, v_cache, meta, SCALE)
        assert same_bits(paged_attention(q, k_cache, v_cache, meta, SCALE), in_place)  # the path FLASH_ATTN takes
    assert same_bits(in_place, compact)


def test_a_wrong_block_table_changes_the_bits():
    """The twin that shows the comparison above can fail: one block of a sequence's table pointing at another
    sequence's block. (Swapping two of its blocks inside one 64-key chunk can keep the bits: the chunk's
    pairwise tree adds the two 16-key halves commutatively.)"""
    q, layer, meta = _decode_batch(torch.float32)
    k_cache, v_cache = kv_cache_views(layer, "FLASH_ATTN", HEAD_DIM)
    with rk.mode("strict"):
        right = _paged_attention_compact(q, k_cache, v_cache, meta, SCALE)
        meta.block_table[1, 0] = meta.block_table[0, 0]
        wrong = _paged_attention_in_place(q, k_cache, v_cache, meta, SCALE)
    assert not same_bits(right, wrong)


class _Layer:
    """vLLM's `Attention` layer as the strict model's `_attention` uses it."""

    layer_name = "model.layers.0.self_attn.attn"

    @staticmethod
    def get_attn_backend():
        return FlashAttentionBackend


def test_model_attention_writes_then_reads_the_flash_attn_cache(monkeypatch):
    import vllm.model_executor.layers.attention.attention as vllm_attention

    q, layer, meta = _decode_batch(torch.float32)
    k_cache, v_cache = kv_cache_views(layer, "FLASH_ATTN", HEAD_DIM)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(q.shape[0], KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[: q.shape[0]]
    meta.slot_mapping = slots
    monkeypatch.setattr(vllm_attention, "get_attention_context", lambda name: (meta, _Layer(), layer, None))
    model = SimpleNamespace(
        attn=[_Layer()],
        shape=SimpleNamespace(head_dim=HEAD_DIM),  # what _attention reads
        model=SimpleNamespace(scale=SCALE),
        _flash_writer=None,
    )  # no vLLM CUDA op on CPU
    with rk.mode("strict"):
        out = RLKernelQwen3ForCausalLM._attention(model, 0, q, k, v)
        expected = _paged_attention_compact(q, k_cache, v_cache, meta, SCALE)
    assert torch.equal(bits(k_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots]), bits(k))
    assert torch.equal(bits(v_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots]), bits(v))
    assert same_bits(out, expected)


@pytest.mark.parametrize(
    "backend, layout, shape, error",
    [
        (
            "TRITON_ATTN",
            None,
            None,
            "the TRITON_ATTN KV cache .*: unknown backend; supported: CPU_ATTN, and FLASH_ATTN",
        ),
        ("FLASH_ATTN", KVCacheLayout.LBHNC, None, "FLASH_ATTN KV cache .*: its blocks are not contiguous"),
        ("FLASH_ATTN", KVCacheLayout.BLNHC, None, "FLASH_ATTN KV cache .*: its blocks are not contiguous"),
        (
            "FLASH_ATTN",
            None,
            (2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),  # the FlashAttention layout of older vLLMs
            "expected \\[num_blocks, kv_heads, block_size, 64\\]",
        ),
    ],
)
def test_other_layouts_are_refused_in_one_line(backend, layout, shape, error):
    cache = torch.zeros(shape) if shape else _caches("FLASH_ATTN", torch.float32, layout)[1][1]
    with pytest.raises(ValueError, match=error) as refused:
        kv_cache_views(cache, backend, HEAD_DIM)
    assert "\n" not in str(refused.value)


def test_strict_ipc_engine_skips_layerwise_reload_for_the_strict_model_only(monkeypatch):
    """vLLM's ipc engine reloads layer by layer through vLLM's weight loaders (parameters moved to meta first); the
    strict model loads in place, so `rl_kernel_ipc` skips that session for it and keeps it for any other model."""
    import vllm.model_executor.model_loader.reload as reload

    from rl_kernel.integrations.vllm.ipc_engine import StrictIPCWeightTransferEngine

    calls = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: calls.append(("start", model)))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: calls.append(("finish", model)))
    engine = StrictIPCWeightTransferEngine.__new__(StrictIPCWeightTransferEngine)
    engine.model_config = None
    engine._packed_importer = SimpleNamespace(close=lambda: calls.append(("close", None)))
    engine.model = RLKernelQwen3ForCausalLM.__new__(RLKernelQwen3ForCausalLM)
    engine.start_weight_update()
    engine.finish_weight_update()
    assert calls == [("close", None)]  # no layerwise session; the update's IPC exports released as vLLM does
    calls.clear()
    engine.model = torch.nn.Linear(2, 2)  # any other model: vLLM's session as before
    engine.start_weight_update()
    engine.finish_weight_update()
    assert [c[0] for c in calls] == ["start", "finish", "close"]
