"""Checks that run before any engine starts: each one turns a late, obscure failure (a silently capped
response, a placement that waits forever, a loader traceback) into one line naming the value, the
file or the numbers, and what to do."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from vime.config.schema import KeptOn, RolloutBackend, VimeConfig, kept_versions
from vime.errors import ConfigError, DataError

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)  # tp 1 on both sides (expert parallelism 1)


def check_lengths(cfg: VimeConfig, prompts: list[list[int]]) -> None:
    """Every prompt plus `algo.max_new_tokens` must fit `rollout.max_model_len` (vLLM would cap the
    response without a word)."""
    check_context(cfg)
    longest = max((len(p) for p in prompts), default=0)
    need = longest + cfg.algo.max_new_tokens
    if need > cfg.rollout.max_model_len:
        raise ConfigError(
            f"algo.max_new_tokens={cfg.algo.max_new_tokens} + the longest prompt ({longest} tokens) = "
            f"{need} > rollout.max_model_len={cfg.rollout.max_model_len}; lower algo.max_new_tokens "
            f"to at most {cfg.rollout.max_model_len - longest} or raise rollout.max_model_len"
        )


def model_max_positions(cfg: VimeConfig) -> tuple[int | None, str]:
    """(the checkpoint's `max_position_embeddings`, where it was read); None when `model.path` has no
    readable config.json (`check_checkpoint` names that problem)."""
    if not cfg.model.path:
        from rl_kernel.models.tiny import MAX_POSITION_EMBEDDINGS

        return MAX_POSITION_EMBEDDINGS, "the tiny model vime makes (model.path unset)"
    config = Path(cfg.model.path) / "config.json"
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None, str(config)
    return (int(value) if isinstance(value, int) else None), str(config)


def check_context(cfg: VimeConfig) -> None:
    """`rollout.max_model_len` must not exceed the model's context (`max_position_embeddings`): vLLM
    refuses it only once its engine is up."""
    limit, where = model_max_positions(cfg)
    if limit is not None and cfg.rollout.max_model_len > limit:
        raise ConfigError(
            f"rollout.max_model_len={cfg.rollout.max_model_len} > the model's context "
            f"(max_position_embeddings={limit} in {where}); set rollout.max_model_len <= {limit}"
        )


def required_resources(cfg: VimeConfig) -> dict[str, float]:
    """Logical Ray resources the layout reserves: one bundle per trainer rank and per rollout engine."""
    gpus = cfg.ray.gpus_per_actor if cfg.device == "cuda" else 0.0
    actors = cfg.trainer.tp * cfg.trainer.cp + cfg.rollout.num_engines
    need = {"CPU": cfg.ray.cpus_per_actor * actors}
    if gpus:
        need["GPU"] = gpus * (cfg.trainer.tp * cfg.trainer.cp + cfg.rollout.num_engines * cfg.rollout.tp)
    return need


def check_resources(cfg: VimeConfig, available: dict[str, float], where: str) -> None:
    """Fail fast, with numbers, when the layout needs more Ray resources than `available` has."""
    need = required_resources(cfg)
    actors = cfg.trainer.tp * cfg.trainer.cp + cfg.rollout.num_engines
    short = {k: (v, float(available.get(k, 0.0))) for k, v in need.items() if v > available.get(k, 0.0)}
    if short:
        what = ", ".join(f"{v:g} {k}s (has {h:g})" for k, (v, h) in short.items())
        raise ConfigError(
            f"the layout needs {what} for {actors} actors ({cfg.trainer.tp * cfg.trainer.cp} trainer "
            f"rank(s) + {cfg.rollout.num_engines} rollout engine(s), ray.cpus_per_actor="
            f"{cfg.ray.cpus_per_actor:g}) but {where}; raise ray.num_cpus / ray.num_gpus, or lower "
            "ray.cpus_per_actor, trainer.tp x cp or rollout.num_engines"
        )


def check_local_resources(cfg: VimeConfig) -> None:
    """For a Ray this run starts itself (`ray.address` unset): the numbers are in the config."""
    if cfg.ray.address:
        return
    check_resources(
        cfg,
        {"CPU": float(cfg.ray.num_cpus), "GPU": float(cfg.ray.num_gpus)},
        f"ray.num_cpus={cfg.ray.num_cpus}, ray.num_gpus={cfg.ray.num_gpus}",
    )


def check_weight_transport(cfg: VimeConfig) -> None:
    """vLLM engines on GPUs take weights only as a push of trainer rank 0 (written, never run on a GPU:
    docs/vllm.md): `ipc`, rl_kernel's push translated into vLLM's calls (rl_kernel.integrations.vllm.ipc;
    with several trainer ranks each ships its own GPU's handles, vime.weights.sync), or `nccl`, vLLM's own
    nccl trainer engine driven from trainer rank 0 (rl_kernel.integrations.vllm.nccl). Which GPUs each serves
    (`ipc`: engines colocated on the trainer's; `nccl`: GPUs of their own) is `vime.config.layout`'s check."""
    if (
        cfg.device == "cuda"
        and RolloutBackend(cfg.rollout.engine) == RolloutBackend.vllm
        and cfg.weights.transport not in ("auto", "ipc", "nccl")
    ):
        raise ConfigError(
            f"rollout.engine=vllm with weights.transport={cfg.weights.transport} on GPUs: a vLLM engine "
            "on CUDA takes weights only as a push of trainer rank 0; use weights.transport=ipc with "
            "weights.colocate=true, or nccl with weights.colocate=false"
        )


def check_checkpoint(path: Path) -> None:
    """An HF checkpoint dir vime can run: readable config.json of a supported architecture, and
    safetensors files whose header and data are complete. Raises DataError naming the file."""
    path = Path(path)
    config = path / "config.json"
    try:
        meta = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {config}: {e}; point model.path at an HF checkpoint directory") from None
    archs = meta.get("architectures") or []
    if archs == list(MOE_ARCHITECTURES) and meta.get("model_type") == "qwen3_moe":
        _check_moe_config(meta, config)
    elif meta.get("model_type") != "qwen3" or not archs or not set(archs) <= set(SUPPORTED_ARCHITECTURES):
        raise DataError(
            f"{config}: model_type={meta.get('model_type')!r}, architectures={archs} is not supported; "
            f"vime runs Qwen3 dense checkpoints ({', '.join(SUPPORTED_ARCHITECTURES)}) and Qwen3-MoE "
            f"({', '.join(MOE_ARCHITECTURES)}): use one"
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DataError(
            f"{path} has no *.safetensors weights; save the checkpoint with safetensors "
            "(save_pretrained(..., safe_serialization=True))"
        )
    for f in files:
        check_safetensors(f)


def _check_moe_config(meta: dict, config: Path) -> None:
    """What the strict Qwen3-MoE model does not cover (another MoE family's options, top-k > num_experts)
    fails here in one line, before any engine starts."""
    from rl_kernel.models.qwen3_moe import Qwen3MoeConfig

    try:
        Qwen3MoeConfig.from_hf(meta, str(config))
    except ValueError as err:
        raise DataError(f"{err}; use a Qwen3-MoE checkpoint the strict model covers (docs/moe.md)") from None


def check_safetensors(file: Path) -> None:
    """The file holds its whole header and every tensor its header lists (a truncated copy does not)."""
    fix = "copy or download it again"
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = fh.read(n) if n is not None and 8 + n <= size else None
    except OSError as e:
        raise DataError(f"cannot read {file}: {e}; check the path and its permissions") from None
    if n is None:
        raise DataError(f"{file} is truncated ({size} bytes, no safetensors header); {fix}")
    if raw is None:
        raise DataError(f"{file} is truncated: its header needs {8 + n} bytes, the file has {size}; {fix}")
    try:
        header = json.loads(raw)
    except ValueError:
        raise DataError(f"{file} has an unreadable safetensors header (not JSON); {fix}") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise DataError(f"{file} is truncated: its tensors need {8 + n + end} bytes, the file has {size}; {fix}")


TRAINER_BYTES_PER_PARAM = 18  # bf16 weights, fp32 gradients, fp32 main weights, two fp32 Adam moments
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def qwen3_parameters(config: dict) -> int:
    """Parameters of a Qwen3 dense or Qwen3-MoE checkpoint from its HF config.json (a Qwen3-MoE's every layer
    sparse: its mlp_only_layers are counted as sparse, an upper bound)."""
    d_model, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or d_model // heads
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    mlp = (
        experts * 3 * d_model * config["moe_intermediate_size"] + experts * d_model  # experts and router
        if experts
        else 3 * d_model * config["intermediate_size"]
    )
    per_layer = (
        d_model * (heads + 2 * kv_heads) * head_dim + heads * head_dim * d_model + mlp + 2 * d_model + 2 * head_dim
    )
    embeddings = config["vocab_size"] * d_model * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * per_layer + d_model


def kept_bytes_per_parameter(cfg: VimeConfig) -> int:
    """GPU bytes per model parameter that a trainer rank spends on the asynchronous loop's kept weight versions:
    full copies (not TP shards) in the model dtype, on the device unless `trainer.kept_on=host`."""
    if cfg.trainer.kept_on != KeptOn.device:
        return 0
    return kept_versions(cfg) * DTYPE_BYTES[str(cfg.model.dtype)]


def check_gpu_memory(cfg: VimeConfig, config: dict, gpu_bytes: int) -> None:
    """A trainer rank's state (18 B per parameter of its TP x CP share) and its kept weight versions
    (`kept_bytes_per_parameter`) plus, with colocated vLLM engines, the `rollout.gpu_memory_utilization` share vLLM
    claims must fit one GPU of `gpu_bytes`; fail before any engine starts, naming how many layers would fit."""
    ranks = cfg.trainer.tp * cfg.trainer.cp
    vllm_share = (
        cfg.rollout.gpu_memory_utilization
        if (cfg.rollout.engine == RolloutBackend.vllm and cfg.weights.colocate)
        else 0.0
    )
    room = gpu_bytes * (1 - vllm_share)
    kept = kept_bytes_per_parameter(cfg)
    per_param = TRAINER_BYTES_PER_PARAM / ranks + kept
    need = per_param * qwen3_parameters(config)
    if need <= room:
        return
    no_layers = qwen3_parameters(config | {"num_hidden_layers": 0})
    per_layer = qwen3_parameters(config | {"num_hidden_layers": 1}) - no_layers
    fit = max(0, int((room - per_param * no_layers) // (per_param * per_layer)))
    raise ConfigError(
        f"the trainer's state for {config['num_hidden_layers']} layers ({need / 1e9:.0f} GB per rank: "
        f"{TRAINER_BYTES_PER_PARAM} B per parameter"
        + (f", and {kept} B for {kept_versions(cfg)} kept weight versions" if kept else "")
        + f") does not fit the {room / 1e9:.0f} GB a GPU of {gpu_bytes / 1e9:.0f} GB leaves"
        + (f" beside vLLM's share (rollout.gpu_memory_utilization={vllm_share})" if vllm_share else "")
        + f"; use at most {fit} layers (model.tiny.num_layers={fit}), more trainer ranks (trainer.tp)"
        + (", trainer.kept_on=host" if kept else "")
        + " or a smaller rollout.gpu_memory_utilization"
    )
