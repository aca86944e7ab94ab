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


def check_new_tokens(cfg: VimeConfig) -> None:
    """`algo.max_new_tokens` must leave room for a prompt in `rollout.max_model_len`, whatever the prompts (the
    exact check with the longest prompt, `check_lengths`, needs the tokenizer): refused before any import."""
    if cfg.algo.max_new_tokens >= cfg.rollout.max_model_len:
        raise ConfigError(
            f"algo.max_new_tokens={cfg.algo.max_new_tokens} >= rollout.max_model_len={cfg.rollout.max_model_len}"
            f": no room for a prompt; lower algo.max_new_tokens below {cfg.rollout.max_model_len} (less the "
            "longest prompt) or raise rollout.max_model_len"
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
    """Logical Ray resources the layout reserves: the bundles of its placement groups
    (`vime.config.layout.ray_spec`, exactly what the driver asks of Ray: on GPUs one bundle per GPU)."""
    from vime.config.layout import ray_spec

    return ray_spec(cfg).totals()


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
    """vLLM engines on GPUs take weights only as a push of trainer rank 0: `ipc`, rl_kernel's push translated
    into vLLM's calls (rl_kernel.integrations.vllm.ipc; ran on one H200; with several trainer ranks each ships
    its own GPU's handles, vime.weights.sync), or `nccl`, vLLM's own nccl trainer engine driven from trainer
    rank 0 (rl_kernel.integrations.vllm.nccl; never run on a GPU: docs/vllm.md). Which GPUs each serves
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
    if not config.is_file():
        raise DataError(
            f"model.path={path} is not an HF checkpoint directory (no config.json); pass a Qwen3 "
            "checkpoint dir, or leave model.path unset to make a tiny one"
        )
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
    check_safetensors_index(path)  # a missing shard is named as such, before the shapes it would leave missing
    check_tensor_shapes(path, {f: check_safetensors(f) for f in files})


def check_safetensors_index(path: Path) -> None:
    """A sharded checkpoint's `model.safetensors.index.json` (when there is one) is readable and every file its
    weight map names is in the directory. Raises DataError naming the file."""
    index = Path(path) / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        files = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise DataError(f"cannot read the weight map of {index}: {e!r}; copy or download it again") from None
    missing = sorted(f for f in files if not (Path(path) / f).is_file())
    if missing:
        raise DataError(
            f"{index} names {len(missing)} file(s) not in {path}, e.g. {missing[0]}; copy or download them again"
        )


def check_tensor_shapes(path: Path, headers: dict[Path, dict]) -> None:
    """Every tensor of the checkpoint's safetensors `headers` (file -> header) has the shape its config.json gives
    it, and every tensor that config needs is there (rl_kernel's Qwen3 weight layout, the table every loader
    uses): a config.json that does not describe its weights is refused naming both numbers, instead of a run
    whose missing rows are made up. DataError naming the file and tensor."""
    from rl_kernel.models.qwen3 import read_config
    from rl_kernel.models.qwen3_layout import weight_layout

    try:
        config = read_config(path)
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{Path(path) / 'config.json'}: {e}; fix it or use the checkpoint's own config.json") from None
    layout = weight_layout(config)
    found = {name: (f, meta["shape"]) for f, h in headers.items() for name, meta in h.items() if name != "__metadata__"}
    if config.tie_word_embeddings and "lm_head.weight" in found:  # a tied head stored anyway: the embedding's shape
        layout = layout | {"lm_head.weight": layout["model.embed_tokens.weight"]}
    for name, (f, shape) in found.items():
        if name not in layout:
            raise DataError(
                f"{f}: tensor {name} is not a weight of the Qwen3 that {Path(path) / 'config.json'} describes "
                f"({config.num_layers} layers); fix config.json or use the checkpoint it came with"
            )
        want = list(layout[name].shape)
        if list(shape) != want:
            raise DataError(
                f"{f}: {name} has shape {list(shape)}, but {Path(path) / 'config.json'} gives it {want} "
                f"({_shape_fields(name, config)}); fix config.json or use the checkpoint it came with"
            )
    missing = [name for name in layout if name not in found]
    if missing:
        raise DataError(
            f"{path}: the safetensors files lack {len(missing)} tensor(s) that config.json's Qwen3 needs, e.g. "
            f"{', '.join(missing[:3])}; fix config.json (num_hidden_layers={config.num_layers}?) or copy the "
            "missing files"
        )


def _shape_fields(name: str, config) -> str:
    """The config.json fields that make tensor `name`'s shape, with their values."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return f"vocab_size={config.vocab_size}, hidden_size={config.hidden_size}"
    fields = {
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
    }
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def _check_moe_config(meta: dict, config: Path) -> None:
    """What the strict Qwen3-MoE model does not cover (another MoE family's options, top-k > num_experts)
    fails here in one line, before any engine starts."""
    from rl_kernel.models.qwen3_moe import Qwen3MoeConfig

    try:
        Qwen3MoeConfig.from_hf(meta, str(config))
    except ValueError as err:
        raise DataError(f"{err}; use a Qwen3-MoE checkpoint the strict model covers (docs/moe.md)") from None


def check_safetensors(file: Path) -> dict:
    """The file holds its whole header and every tensor its header lists (a truncated copy does not); returns
    the header (tensor name -> dtype, shape, data_offsets)."""
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
    return header


def check_device(cfg: VimeConfig) -> None:
    """`device=cuda` needs a CUDA device torch can see (the tiny-model maker would fail with a traceback); a plan
    (`plan=true`) checks a GPU layout on any machine and never touches CUDA."""
    if cfg.device != "cuda" or cfg.plan:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"device=cuda, but torch {torch.__version__} sees no CUDA device on this machine "
            f"(torch.cuda.is_available() is False, CUDA build: {torch.version.cuda or 'none'}); use device=cpu"
        )


WANDB_HOST = "api.wandb.ai"


def check_wandb(cfg: VimeConfig, timeout_s: float = 3.0) -> None:
    """`wandb.mode=online` needs an API key (WANDB_API_KEY, or a `wandb login` entry in ~/.netrc) and a reachable
    W&B server (WANDB_BASE_URL, default https://api.wandb.ai), checked here in at most `timeout_s` rather than by
    W&B's own retries after every engine has started."""
    if cfg.wandb.mode != "online":
        return
    import netrc
    import os
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("WANDB_BASE_URL") or f"https://{WANDB_HOST}")
    host, port = url.hostname or WANDB_HOST, url.port or (80 if url.scheme == "http" else 443)
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        try:
            key = (netrc.netrc().authenticators(host) or (None, None, None))[2]
        except (OSError, netrc.NetrcParseError):
            key = None
    fix = "use wandb.mode=offline (and `wandb sync` the run's wandb/ dir later)"
    if not key:
        raise ConfigError(
            f"wandb.mode=online: no W&B API key (WANDB_API_KEY unset, none for {host} in ~/.netrc); {fix}"
        )
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"wandb.mode=online: cannot reach {host}:{port} ({e}); {fix}") from None


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


REFERENCE_BYTES_PER_PARAM = 6  # the KL reference policy: a Megatron policy's bf16 weights and fp32 main copy
# (its Adam moments and gradients are never made: it takes no step)


def memory_per_parameter(cfg: VimeConfig) -> dict[str, float]:
    """GPU bytes per model parameter on one trainer rank's GPU, by what holds them. Megatron here keeps no
    distributed optimizer, so a CP rank holds its TP shard's whole state: the state divides by `trainer.tp`
    only. `push_buffers`: the weight push exports the full HF tensors on the GPU in the model dtype (every rank
    with `ipc` and several ranks, rank 0 otherwise; counted on every GPU) and keeps them until the engines'
    acknowledgement."""
    dtype = DTYPE_BYTES[str(cfg.model.dtype)]
    tp = cfg.trainer.tp
    return {
        "trainer_state": TRAINER_BYTES_PER_PARAM / tp,
        "reference_policy": REFERENCE_BYTES_PER_PARAM / tp if cfg.algo.kl_coef > 0 else 0.0,
        "push_buffers": float(dtype),
        "kept_versions": float(kept_bytes_per_parameter(cfg)),
    }


def vllm_gpu_share(cfg: VimeConfig) -> float:
    """The fraction of a trainer GPU that colocated vLLM engines claim (`rollout.gpu_memory_utilization`; 0 when
    the engines have GPUs of their own or are not vLLM)."""
    colocated = cfg.rollout.engine == RolloutBackend.vllm and cfg.weights.colocate
    return cfg.rollout.gpu_memory_utilization if colocated else 0.0


# What a Qwen3-MoE run held beyond the per-parameter plan, on the H200 at 7 Qwen3-30B-A3B layers (6bfe2d0, out of
# memory at the first weight push): 10.3 GiB of the trainer's process outside PyTorch's allocator and 2.7 GiB of
# the awake vLLM engine beyond its share. Counted for every MoE checkpoint, whatever its size: a measured floor.
MOE_UNPLANNED_BYTES = 13.0 * 2**30


def gpu_memory_plan(cfg: VimeConfig, config: dict, gpu_bytes: float) -> dict[str, float]:
    """Bytes on the most loaded GPU (a trainer rank's, beside its colocated vLLM worker), by what holds them,
    with the total `need`, the GPU's size and what is `free`. Activations are not counted; for a MoE checkpoint
    `moe_unplanned` is what such a run held beyond the rest (`MOE_UNPLANNED_BYTES`)."""
    params = qwen3_parameters(config)
    plan = {k: v * params for k, v in memory_per_parameter(cfg).items()}
    plan["moe_unplanned"] = MOE_UNPLANNED_BYTES if config.get("num_experts") or config.get("num_local_experts") else 0
    plan["vllm"] = vllm_gpu_share(cfg) * gpu_bytes
    need = sum(plan.values())
    return plan | {"need": need, "gpu": float(gpu_bytes), "free": gpu_bytes - need}


def check_gpu_memory(cfg: VimeConfig, config: dict, gpu_bytes: int) -> None:
    """Everything `gpu_memory_plan` counts (a trainer rank's state of its TP share, the KL reference policy when
    `algo.kl_coef > 0`, the push buffers, the kept weight versions) plus colocated vLLM's
    `rollout.gpu_memory_utilization` share must fit one GPU of `gpu_bytes`; else fail before any engine starts,
    in one line naming the values to change and how many layers would fit."""
    plan = gpu_memory_plan(cfg, config, gpu_bytes)
    if plan["free"] >= 0:
        return
    per = memory_per_parameter(cfg)
    per_param, vllm_share = sum(per.values()), vllm_gpu_share(cfg)
    room = gpu_bytes * (1 - vllm_share)
    no_layers = qwen3_parameters(config | {"num_hidden_layers": 0})
    per_layer = qwen3_parameters(config | {"num_hidden_layers": 1}) - no_layers
    fit = max(0, int((room - plan["moe_unplanned"] - per_param * no_layers) // (per_param * per_layer)))
    kept = per["kept_versions"]
    trainer_bytes = plan["need"] - plan["vllm"]
    util = int((gpu_bytes - trainer_bytes) / gpu_bytes * 100) / 100  # the vLLM share that leaves the trainer room
    parts = [f"{TRAINER_BYTES_PER_PARAM} B per parameter / trainer.tp={cfg.trainer.tp}"]
    if per["reference_policy"]:
        ref = plan["reference_policy"] / 1e9
        parts.append(f"the KL reference policy (algo.kl_coef={cfg.algo.kl_coef:g}) {ref:.0f} GB")
    parts.append(f"push buffers {plan['push_buffers'] / 1e9:.0f} GB")
    if kept:
        parts.append(f"and {kept:g} B for {kept_versions(cfg)} kept weight versions")
    if plan["moe_unplanned"]:
        parts.append(f"{plan['moe_unplanned'] / 1e9:.0f} GB a MoE run held outside that plan on the H200")
    raise ConfigError(
        f"the trainer's state for {config['num_hidden_layers']} layers ({trainer_bytes / 1e9:.0f} GB per rank: "
        + ", ".join(parts)
        + f") does not fit the {room / 1e9:.0f} GB a GPU of {gpu_bytes / 1e9:.0f} GB leaves"
        + (f" beside vLLM's share (rollout.gpu_memory_utilization={vllm_share})" if vllm_share else "")
        + (f"; set rollout.gpu_memory_utilization <= {util:.2f}" if vllm_share and util >= 0.1 else "")
        + f"; or use at most {fit} layers (model.tiny.num_layers={fit}), more trainer ranks (trainer.tp)"
        + (", trainer.kept_on=host" if kept else "")
        + (", algo.kl_coef=0" if per["reference_policy"] else "")
    )
