"""The run's configuration: Hydra structured configs (dataclasses in the ConfigStore) plus the checks
a type cannot express. Hydra rejects unknown keys and wrong types; `validate` rejects values that
type-check but cannot run (with what to do instead).

`configs/config.yaml` is the embedded CPU default; `configs/experiment/*.yaml` are overlays
(`python -m vime.train +experiment=qwen3_8b_grpo`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, ValidationError

from vime.errors import ConfigError


def _rl_kernel_boundaries() -> tuple[str, ...]:
    """`rl_kernel.modes.BOUNDARIES`, read from that module's source (a literal) while rl_kernel is not imported:
    importing it imports torch (seconds), and the config is checked before any heavy import, so that a typo is
    answered at once (tests/vime/test_errors.py times it)."""
    if "rl_kernel.modes" in sys.modules:
        return sys.modules["rl_kernel.modes"].BOUNDARIES
    spec = importlib.util.find_spec("rl_kernel")  # a top-level find_spec imports nothing
    source = Path(spec.submodule_search_locations[0], "modes.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["BOUNDARIES"]:
            return tuple(ast.literal_eval(node.value))
    raise ImportError("rl_kernel/modes.py has no BOUNDARIES literal")


BOUNDARIES = _rl_kernel_boundaries()


class Mode(StrEnum):
    strict = "strict"
    native = "native"


class RolloutBackend(StrEnum):
    vllm = "vllm"  # vllm.LLM with the rl_kernel plugin (strict) or vLLM's own kernels (native)
    reference = "reference"  # FALLBACK: rl_kernel.models.rollout over Qwen3Reference


class TrainerBackend(StrEnum):
    megatron = "megatron"  # megatron-core GPTModel via rl_kernel.integrations.megatron
    reference = "reference"  # FALLBACK: Qwen3Reference + a plain torch optimizer


class KeptOn(StrEnum):
    """Where the trainer keeps the weight versions of the asynchronous loop (`trainer.kept_on`)."""

    device = "device"  # the trainer's own device: a kept version costs 2 bytes a parameter (bf16) of its memory
    host = "host"  # CPU memory (pinned and reused on CUDA): copied over PCIe to keep and to re-score


class StaleSamples(StrEnum):
    """What the asynchronous loop does with a GRPO group that has a token more than `algo.max_staleness`
    weight versions behind the trainer (the whole group goes: its advantages are normalised together)."""

    drop = "drop"  # not trained on; counted
    requeue = "requeue"  # its prompt is sampled again with the next rollout; counted


# Off-policy corrections of the asynchronous loop (vime/trainer/grpo.py, `behaviour_weight`): the weight
# w = pi_prox / pi_behaviour of each token, where pi_prox is the trainer's current weights and pi_behaviour
# the rollout's recorded logprob (reproduced in bits by the trainer under the version that produced it).
CORRECTIONS = {
    "none": "no correction: the PPO ratio is taken against the rollout logprobs (synchronous loop only)",
    "decoupled": "decoupled PPO: the loss is weighted by w; tokens with w > algo.is_cap are masked",
    "tis": "truncated importance sampling: the loss is weighted by min(w, algo.is_cap)",
    "icepop": "IcePop: the loss is weighted by w where algo.icepop_low <= w <= algo.icepop_high, else masked",
}


class Task(StrEnum):
    copy = "copy"  # "g=" -> "g": the embedded default, learnable by a tiny model in minutes
    arithmetic = "arithmetic"
    reverse = "reverse"


class Transport(StrEnum):
    auto = "auto"  # per engine, by locality (`engine_transports`)
    object_store = "object_store"  # Ray's object store (CPU runs; the trainer's rank 0 exports buckets)
    ipc = "ipc"  # CUDA IPC handles (vLLM `ipc` / rl_kernel.weights.transfer): colocated
    nccl = "nccl"  # NCCL broadcast from the trainer's rank 0 (vLLM `nccl`): separate GPUs
    gloo = "gloo"  # rl_kernel's push group on CPU (gloo broadcast over TCP): engines on other nodes


CPU_TRANSPORTS = (Transport.auto, Transport.object_store, Transport.gloo)


@dataclass
class WeightsConfig:
    transport: Transport = Transport.auto
    colocate: bool = False  # rollout engines on the trainer's nodes; on GPUs on its GPUs (time-shared, CUDA IPC)
    bucket_bytes: int = 1 << 30  # packed bucket size (vLLM's default packed buffer: 1 GiB)


@dataclass
class TinyModelConfig:
    """The Qwen3 checkpoint made on the fly when `model.path` is null (rl_kernel.models.tiny)."""

    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    chat: bool = False  # a tokenizer with Qwen3's special tokens and a chat template (for data.chat_template)
    # Qwen3-MoE (Qwen3MoeForCausalLM) when num_experts > 0: every layer a sparse block (docs/moe.md)
    num_experts: int = 0  # 0: a dense Qwen3
    num_experts_per_tok: int = 2  # top-k routed experts per token, 1 <= k <= num_experts
    moe_intermediate_size: int = 64  # each expert's SwiGLU width

    def __post_init__(self) -> None:
        _require(self.num_experts >= 0, f"model.tiny.num_experts={self.num_experts}", "use 0 (dense) or more")
        _require(
            not self.num_experts or 1 <= self.num_experts_per_tok <= self.num_experts,
            f"model.tiny.num_experts_per_tok={self.num_experts_per_tok} is outside [1, num_experts={self.num_experts}]",
            "route each token to at most num_experts experts",
        )
        _require(
            not self.num_experts or self.moe_intermediate_size > 0,
            f"model.tiny.moe_intermediate_size={self.moe_intermediate_size}",
            "give the experts a width > 0",
        )


class LogitsDtype(StrEnum):
    """The logprob contracts' logits (rl_kernel.set_logits_dtype), the same on every engine of a run."""

    float32 = "float32"  # the LM head's fp32 result as it is
    bfloat16 = "bfloat16"  # rounded once to bf16, as native F.linear returns them (less logits traffic on the GPU)


@dataclass
class ModelConfig:
    path: str | None = None  # HF Qwen3 checkpoint dir; null: make a tiny one under <output_dir>/model
    dtype: str = "bfloat16"
    logits_dtype: LogitsDtype = LogitsDtype.float32
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self) -> None:
        _require(
            self.dtype in ("bfloat16", "float32", "float16"),
            f"model.dtype={self.dtype!r}",
            "use bfloat16, float16 or float32",
        )


@dataclass
class DataConfig:
    task: Task = Task.arithmetic
    num_prompts: int = 512  # size of the generated prompt pool (cycled through in order)
    letters: int = 8  # copy: letters a.. in the prompts
    max_operand: int = 99  # arithmetic: operands in [0, max_operand]
    min_len: int = 3  # reverse: string lengths in [min_len, max_len]
    max_len: int = 6
    seed: int = 0  # the generated tasks' draw, and the shuffle of data.path's rows
    # Dataset files (vime/data/files.py); null: the generated `task`. A file, a dir or a glob of .jsonl /
    # .json / .parquet shards, read offline with `datasets`.
    path: str | None = None
    prompt_key: str = "prompt"  # column of the prompt: a string, or chat messages [{"role", "content"}]
    answer_key: str = "answer"  # column of the label the reward gets; every other column is its metadata
    shuffle: bool = True  # reshuffle the rows every epoch (seeded by `seed` and the epoch)
    max_prompt_tokens: int | None = None  # drop longer prompts (counted at start-up); null: keep every one
    chat_template: bool = False  # render prompts with the tokenizer's chat template (a generation prompt)
    system_prompt: str | None = None  # with chat_template: a system message before each prompt
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # to the template, e.g. {enable_thinking: false}

    def __post_init__(self) -> None:
        _require(
            self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
            f"data.max_prompt_tokens={self.max_prompt_tokens}",
            "use null (keep every prompt) or a token count >= 1",
        )


# what a reward function's failure (exception, timeout, NaN / inf, not a number) does (`reward.on_error`)
ON_ERROR = {
    "raise": "stop the run with one line naming the sample, the function and the error",
    "zero": "the sample's reward is 0, counted in reward/errors",
}


@dataclass
class RewardConfig:
    """The reward of a response (vime/data/rewards.py). `fn`: a built-in (`task`: the generated task's; `math`,
    `exact`, `regex`) or the user's `module.path:function` / `path/to/file.py:function`, called as
    score(prompt: str, response: str, label, metadata: dict) -> float | dict (a dict: `score` plus extras logged
    as reward/<name>), plain or `async def`. null: `task` (with data.task; data.path needs a fn)."""

    fn: str | None = None
    pattern: str | None = None  # fn=regex: the response scores 1 when it has a match whose group 1 (else the
    # whole match) equals the label; `{label}` in the pattern is replaced by the escaped label first
    num_workers: int = 2  # Ray actors that score a step's samples in parallel (0: in the driver, one at a time)
    timeout_s: float = 30.0  # per sample; a slower call is an error (reward.on_error)
    on_error: str = "raise"  # raise | zero (ON_ERROR)
    # DAPO's overlong shaping: a response longer than algo.max_new_tokens - overlong_buffer tokens loses up to
    # overlong_penalty, linearly over the buffer (0: off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, f"reward.num_workers={self.num_workers}", "use 0 (in the driver) or more")
        _require(self.timeout_s > 0 and math.isfinite(self.timeout_s), f"reward.timeout_s={self.timeout_s}", "use > 0")
        _require(self.on_error in ON_ERROR, f"reward.on_error={self.on_error!r}", f"use one of {', '.join(ON_ERROR)}")
        _require(self.overlong_buffer >= 0, f"reward.overlong_buffer={self.overlong_buffer}", "use 0 (off) or more")
        _require(
            self.overlong_penalty >= 0 and math.isfinite(self.overlong_penalty),
            f"reward.overlong_penalty={self.overlong_penalty}",
            "use a finite penalty >= 0",
        )


@dataclass
class EvalConfig:
    """Held-out evaluation on the rollout engines between steps (vime/eval.py): at step 0, every `every` steps
    and at the end; `n` samples per prompt at `temperature`; pass@1 (mean over the n), pass@n, response_len_mean
    as eval/* in W&B and on the console, rows in <output_dir>/eval.jsonl, completions in
    <output_dir>/eval/step_<N>.jsonl. The file's format and keys are data's (data.prompt_key, answer_key,
    chat_template). A sample passes when its reward is >= `pass_threshold`."""

    path: str | None = None  # null: no evaluation
    every: int = 0  # also every N steps (0: only at step 0 and at the end)
    n: int = 4
    temperature: float = 1.0
    max_prompts: int = 0  # the first this many rows (0: all)
    max_new_tokens: int | None = None  # null: algo.max_new_tokens
    pass_threshold: float = 1.0
    seed: int = 12345  # the eval sampling's seed, apart from the training's (eval does not move its RNG)

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"eval.every={self.every}", "use 0 (start and end only) or N >= 1")
        _require(self.n >= 1, f"eval.n={self.n}", "use n >= 1 samples per prompt")
        _require(self.max_prompts >= 0, f"eval.max_prompts={self.max_prompts}", "use 0 (all) or more")
        _require(
            math.isfinite(self.temperature) and self.temperature > 0,
            f"eval.temperature={self.temperature}",
            "use a finite temperature > 0",
        )


@dataclass
class AlgoConfig:
    """GRPO and its variants: `prompts_per_step` prompts x `group_size` samples per step, `mini_batches` optimizer
    steps per pass over them, `ppo_epochs` passes (docs/vime.md "Objectives")."""

    prompts_per_step: int = 4
    group_size: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # KL to the initial policy (kl_estimator; loss term or kl_in_reward); 0: no reference forward
    adv_eps: float = 1e-6  # grpo: advantages = (r - mean) / (std + adv_eps) within a group (reinforce_pp: the batch)
    # Asynchronous RL (vime/loop/async_loop.py). 0: the synchronous on-policy loop. N >= 1: the rollouts of the
    # next N steps run while the trainer trains and syncs; a token may be up to N weight versions old.
    max_staleness: int = 0
    stale_samples: StaleSamples = StaleSamples.drop  # a group older than max_staleness: drop or requeue it
    correction: str = "none"  # none | decoupled | tis | icepop (CORRECTIONS); async needs one other than none
    is_cap: float = 2.0  # tis: w truncated at is_cap; decoupled: tokens with w > is_cap masked
    icepop_low: float = 0.5  # icepop: tokens with w outside [icepop_low, icepop_high] masked
    icepop_high: float = 2.0
    behaviour_check: float = 1.0  # share of stale samples whose behaviour logprobs the trainer reproduces
    # (1.0: every token of every step; less: a seeded sample, rate logged)
    # Objectives (docs/vime.md "Objectives"; vime/trainer/advantages.py, losses.py, grpo.py)
    adv_estimator: str = "grpo"  # grpo | drgrpo | rloo | reinforce_pp (ADV_ESTIMATORS)
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    loss_norm_tokens: float | None = None  # seq_mean_token_sum_norm's constant divisor, in tokens (Dr.GRPO)
    policy_loss: str = "ppo"  # ppo (token ratios) | gspo (the sequence ratio)
    clip_low: float | None = None  # ppo: ratio clipped to [1 - clip_low, 1 + clip_high]; null: clip_eps
    clip_high: float | None = None  # (DAPO's clip-higher: clip_high > clip_low)
    gspo_clip_low: float = 3e-4  # gspo: the sequence ratio's range (the GSPO paper's defaults)
    gspo_clip_high: float = 4e-4
    clip_c: float | None = None  # dual clip: for A < 0 the term is bounded by -A * clip_c (> 1); null: off
    kl_estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl (KL_ESTIMATORS), of the kl_coef term
    kl_in_reward: bool = False  # the KL is a reward penalty (kl_coef x the sample's summed KL), not a loss term
    dynamic_sampling: bool = False  # drop groups whose rewards all tie; sample more prompts to fill the step
    max_sample_rounds: int = 3  # dynamic sampling: prompt batches a step may sample at most
    mini_batches: int = 1  # optimizer steps per rollout batch (consecutive slices of it)
    ppo_epochs: int = 1  # passes over the rollout batch
    # Exact truncated sampling on the strict engines (rl_kernel.ops.truncation; docs/vllm.md): the support is
    # cut from the strict log-probs, the recorded logprob is renormalised over it, the trainer rebuilds both.
    top_k: int = -1  # keep the k most likely tokens (ties by token id); -1 or 0: off
    top_p: float = 1.0  # then the smallest prefix whose (top-k renormalised) mass reaches top_p; 1.0: off
    min_p: float = 0.0  # then tokens with p >= min_p * p_max; 0.0: off
    entropy_coef: float = 0.0  # loss - entropy_coef * mean full-vocab entropy (train/entropy is logged always)

    def __post_init__(self) -> None:
        _require(self.prompts_per_step >= 1, f"algo.prompts_per_step={self.prompts_per_step}", "set it >= 1")
        _require(
            self.group_size >= 2,
            f"algo.group_size={self.group_size}",
            "GRPO normalises rewards within a group: set algo.group_size >= 2",
        )
        _require(self.max_new_tokens >= 1, f"algo.max_new_tokens={self.max_new_tokens}", "set it >= 1")
        _require(
            math.isfinite(self.temperature) and self.temperature > 0,
            f"algo.temperature={self.temperature}",
            "use a finite temperature > 0 (greedy decoding has no logprob to compare)",
        )
        _require(0 <= self.clip_eps < 1, f"algo.clip_eps={self.clip_eps}", "use 0 <= clip_eps < 1")
        _require(self.kl_coef >= 0, f"algo.kl_coef={self.kl_coef}", "use kl_coef >= 0")
        _require(self.top_k >= -1, f"algo.top_k={self.top_k}", "use -1 or 0 (off) or a token count >= 1")
        _require(0 < self.top_p <= 1, f"algo.top_p={self.top_p}", "use 0 < top_p <= 1 (1.0: off)")
        _require(0 <= self.min_p < 1, f"algo.min_p={self.min_p}", "use 0 <= min_p < 1 (0.0: off)")
        _require(
            math.isfinite(self.entropy_coef) and self.entropy_coef >= 0,
            f"algo.entropy_coef={self.entropy_coef}",
            "use entropy_coef >= 0 (0: entropy only logged)",
        )


@dataclass
class RolloutConfig:
    engine: RolloutBackend = RolloutBackend.vllm
    mode: Mode = Mode.strict
    boundary_modes: dict[str, Mode] = field(default_factory=dict)  # e.g. {attention: native}
    num_engines: int = 1
    tp: int = 1
    max_restarts: int = 3  # rollout engines that die are restarted (vime/faults/restart.py), this many a run
    max_model_len: int = 256
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.3
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    enforce_eager: bool = True
    # strict engines: vLLM's torch.compile of the strict model (its ops stay opaque custom ops); on CUDA
    # FULL_AND_PIECEWISE graphs, so steps that mix prefill chunks with decodes replay piecewise graphs instead of
    # running eager (the default strict engine graphs decode-only steps). Needs enforce_eager=false; native
    # engines compile whenever enforce_eager is false.
    compile: bool = False
    # vLLM on CUDA: release the GPU while the trainer works (vLLM's sleep mode), woken for the weight push.
    # 0: never; 1: weights offloaded to host memory and KV cache discarded; 2: both discarded (the push
    # reloads every weight)
    sleep_level: int = 0
    # KV page size in tokens. None: 16 in the reference engine; on CUDA each vLLM engine's own default (strict:
    # 64, a page per attention chunk, which its kernel reads by TMA; native: vLLM's)
    block_size: int | None = None
    # In-flight weight updates (algo.max_staleness >= 1): a weight push lands between engine steps without
    # waiting for running requests, which go on under the new version over their KV cache of the old one
    # (their tokens carry mixed versions); prefix caching is off.
    partial: bool = False
    partial_wait: int = 0  # k >= 1 (with partial): every rollout after the first waits, once each of its
    # requests has k tokens, for the next version: mixed versions at a fixed token,
    # reproducible runs (tests, studies); 0: an update lands whenever it arrives
    num_blocks: int = 256  # reference engine: KV pages per engine

    def __post_init__(self) -> None:
        _check_side("rollout", self.boundary_modes, self.tp)
        _require(
            not (self.compile and self.enforce_eager),
            "rollout.compile=true with rollout.enforce_eager=true",
            "set rollout.enforce_eager=false to compile the strict engine (or rollout.compile=false)",
        )
        _require(
            not self.compile or self.engine == RolloutBackend.vllm,
            f"rollout.compile=true with rollout.engine={self.engine.value}",
            "compile is vLLM's (rollout.engine=vllm); rl_kernel's reference engine runs eager",
        )
        _require(self.num_engines >= 1, f"rollout.num_engines={self.num_engines}", "use num_engines >= 1")
        _require(self.max_restarts >= 0, f"rollout.max_restarts={self.max_restarts}", "use 0 (never restart) or more")
        _require(
            self.sleep_level in (0, 1, 2),
            f"rollout.sleep_level={self.sleep_level}",
            "use 0 (never sleep), 1 (offload weights, drop the KV cache) or 2 (drop both)",
        )


@dataclass
class TrainerConfig:
    engine: TrainerBackend = TrainerBackend.megatron
    mode: Mode = Mode.strict
    boundary_modes: dict[str, Mode] = field(default_factory=dict)
    tp: int = 1
    cp: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 0  # sequences per micro-batch; 0 = the whole step in one micro-batch
    # The step's consistency metric comes from the training forward (on-policy: the same weights, the
    # same logprobs). true: also run the separate no-grad scoring forward first and compare that one
    # (it checks the trainer's inference path too, for one more forward per step).
    scoring_pass: bool = False
    # Weight versions kept (algo.max_staleness >= 1) to reproduce the behaviour logprobs of stale tokens;
    # 0: max_staleness + 1, the fewest that cover every allowed lag.
    kept_versions: int = 0
    # Where they are kept. device: swapping a version in to re-score is a copy at memory speed (Qwen3-8B: 16 GB
    # of GPU memory per version); host: no GPU memory, two PCIe copies of the weights per re-scored version.
    kept_on: KeptOn = KeptOn.device

    def __post_init__(self) -> None:
        _check_side("trainer", self.boundary_modes, self.tp)
        _require(self.cp >= 1, f"trainer.cp={self.cp}", "use cp >= 1")
        _require(self.lr > 0 and math.isfinite(self.lr), f"trainer.lr={self.lr}", "use a finite lr > 0")
        _require(
            self.micro_batch_size >= 0, f"trainer.micro_batch_size={self.micro_batch_size}", "use 0 (whole step) or > 0"
        )


@dataclass
class RayConfig:
    address: str | None = None  # null: start a local Ray
    bind_address: str = "127.0.0.1"  # local Ray (address null): Ray and the trainer's gloo bind here only
    num_cpus: int = 4  # logical CPUs given to the local Ray (bundles reserve these)
    num_gpus: int = 0
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0  # not read: on GPUs each GPU is one bundle (vime.config.layout.ray_spec)
    # Across nodes (`ray.address`): a custom node resource marking the nodes each role may run on
    # (`ray start --resources='{"vime_trainer": 1}'`); null: any node. configs/placement/*.yaml set them.
    trainer_resource: str | None = None
    rollout_resource: str | None = None  # colocated engines (weights.colocate) take the trainer's nodes
    restart_wait_s: float = 60.0  # how long a lost engine waits for capacity to be restarted on before the run stops

    def __post_init__(self) -> None:
        _require(self.restart_wait_s > 0, f"ray.restart_wait_s={self.restart_wait_s}", "use a time > 0 (seconds)")


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "vime"
    name: str | None = None
    entity: str | None = None

    def __post_init__(self) -> None:
        _require(
            self.mode in ("offline", "online", "disabled"),
            f"wandb.mode={self.mode!r}",
            "use offline, online or disabled",
        )


@dataclass
class CheckpointConfig:
    """Checkpoints under `<output_dir>/checkpoints/` (vime/state/checkpoint.py); the end of a run saves one unless
    `final=false`."""

    every: int = 0  # also save after every `every` steps (0: only at the end)
    stop_after: int | None = None  # stop cleanly after this step (checkpoint saved), as a job limit; resume= goes on
    export_hf: bool = True  # write <output_dir>/hf_model (HF safetensors) at the end of the run
    final: bool = True  # save one after the last step (false: only `every` / `stop_after` ones; for
    # throwaway runs of a large model, e.g. the H200 preset)
    # SIGINT / SIGTERM while the steps run: finish the step in progress and save a checkpoint of it, within
    # `on_stop_s` seconds (past that, stop at once: the resume point is the last checkpoint). false: stop at once.
    on_stop: bool = True
    on_stop_s: float = 60.0

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"checkpoint.every={self.every}", "use 0 (end only) or >= 1")
        _require(self.on_stop_s > 0, f"checkpoint.on_stop_s={self.on_stop_s}", "use a time > 0 (seconds)")


@dataclass
class AuditConfig:
    """`python -m vime.audit`: which rungs of the ablation ladder to run, or an earlier run to read."""

    boundaries: list[str] = field(default_factory=lambda: list(BOUNDARIES))
    sides: list[str] = field(default_factory=lambda: ["rollout", "trainer"])
    run: str | None = None  # an earlier run's output_dir: summarise its per-step evidence instead


@dataclass
class VimeConfig:
    steps: int = 3
    seed: int = 0
    device: str = "cpu"  # cpu | cuda
    output_dir: str = "outputs/run"
    fail_on_mismatch: bool = False  # strict run: raise if any step shows mismatch_count > 0
    verbose: bool = False  # engine / framework logs on the console too (always in <output_dir>/engines.log),
    # and actor errors with their Ray traceback
    samples_every: int = 10  # print sample completions every N steps (0: never; W&B gets them every step)
    compare: str | None = None  # "native": also run the native twin; or a sibling run's output_dir to plot beside
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)  # weight sync transport (vime/config/layout.py)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: str | None = None  # an earlier run's output_dir: continue it from its last checkpoint
    audit: AuditConfig = field(default_factory=AuditConfig)
    # plan=true: every check that needs no engine, the placement groups with stand-in actors placed, a table and
    # <output_dir>/plan.json; exits 0 without starting an engine or touching CUDA (vime/cluster/plan.py)
    plan: bool = False
    plan_gpu_gib: float = 139.8  # the GPU size a plan checks memory against (H200: 139.8 GiB); no GPU is read
    reward: RewardConfig = field(default_factory=RewardConfig)  # the reward function (vime/data/rewards.py)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation (vime/eval.py)


def register_configs() -> None:
    """Register the schema so `configs/config.yaml` can list `vime_schema` in its defaults."""
    ConfigStore.instance().store(name="vime_schema", node=VimeConfig)


def unknown_keys(cfg: DictConfig, schema: type = None, prefix: str = "") -> list[str]:
    """Keys of `cfg` that `schema` (a config dataclass, default VimeConfig) does not declare, dotted.
    Hydra's `+group.key=...` adds such keys to a structured node without complaint."""
    schema = schema or VimeConfig
    fields = {f.name: f for f in dataclasses.fields(schema)}
    bad = []
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if key not in fields:
            bad.append(name)
        elif dataclasses.is_dataclass(
            fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        ):
            node = cfg._get_node(key)
            if isinstance(node, DictConfig) and not node._is_none():
                bad += unknown_keys(node, fields[key].default_factory, f"{name}.")
    return bad


def to_object(cfg: DictConfig | VimeConfig) -> VimeConfig:
    """The composed Hydra config as a `VimeConfig`; ConfigError when a required value (`???`) is unset
    or a key is not in the schema."""
    if isinstance(cfg, VimeConfig):
        return cfg
    bad = unknown_keys(cfg)
    if bad:
        raise ConfigError(
            f"unknown config key(s) {', '.join(bad)}: not in the schema (vime/config/schema.py); "
            "check the spelling (`python -m vime.train --cfg job` lists every key)"
        )
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if not missing:
            return OmegaConf.to_object(cfg)
    except InterpolationResolutionError as e:
        key = getattr(e, "full_key", "?")
        raise ConfigError(
            f"cannot resolve {key}: {e.msg if hasattr(e, 'msg') else e}; set {key}=... on the "
            "command line (or the environment variable it reads)"
        ) from None
    raise ConfigError(
        f"required but not set: {', '.join(missing)}; pass them on the command line, e.g. {missing[0]}=..."
    )


def side_modes(mode: Mode, overrides: dict[str, Mode]) -> dict[str, str]:
    """Per-boundary modes of one side: `mode` everywhere, then the per-boundary overrides."""
    modes = {b: Mode(mode).value for b in BOUNDARIES}
    modes.update({b: Mode(m).value for b, m in overrides.items()})
    return modes


def modes_label(modes: dict[str, str]) -> str:
    """'strict', 'native', or 'strict except attention=native, ...' for one side's modes."""
    values = set(modes.values())
    if len(values) == 1:
        return values.pop()
    base = max(("strict", "native"), key=lambda m: sum(v == m for v in modes.values()))
    return f"{base} except " + ", ".join(f"{b}={m}" for b, m in modes.items() if m != base)


def _require(ok: bool, what: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{what}; {fix}")


def _check_side(side: str, boundary_modes: dict, tp: int) -> None:
    bad = sorted(set(boundary_modes) - set(BOUNDARIES))
    _require(not bad, f"{side}.boundary_modes has unknown boundaries {bad}", f"use keys from {BOUNDARIES}")
    _require(
        tp >= 1 and 8 % tp == 0,
        f"{side}.tp={tp}",
        "strict GEMMs split K into 8 groups, so TP must divide 8 (1, 2, 4 or 8)",
    )


def validate(cfg: VimeConfig) -> VimeConfig:
    """Reject configurations that type-check but cannot run, where the settings of several groups meet
    (each group's own values are checked when it is built: its `__post_init__`). Returns `cfg`."""
    a, r = cfg.algo, cfg.rollout
    _require(cfg.steps >= 1, f"steps={cfg.steps}", "set steps >= 1")
    _require(cfg.device in ("cpu", "cuda"), f"device={cfg.device!r}", "use device=cpu or device=cuda")
    _require(
        a.prompts_per_step * a.group_size <= r.max_num_seqs * r.num_engines,
        f"{a.prompts_per_step * a.group_size} samples per step > rollout.max_num_seqs x num_engines",
        "raise rollout.max_num_seqs or lower algo.prompts_per_step / group_size",
    )
    _require(
        r.sleep_level == 0 or (cfg.device == "cuda" and r.engine == RolloutBackend.vllm),
        f"rollout.sleep_level={r.sleep_level} with device={cfg.device}, rollout.engine={r.engine.value}",
        "sleep mode is vLLM's, on CUDA: set rollout.sleep_level=0",
    )
    marked = [k for k in ("trainer_resource", "rollout_resource") if getattr(cfg.ray, k)]
    _require(
        not marked or cfg.ray.address,
        f"ray.{marked[0] if marked else ''} without ray.address",
        "node resources mark the nodes of a running cluster: set ray.address (auto after `ray start`), or "
        "unset them for a local run",
    )
    _require(
        not (cfg.weights.colocate and cfg.ray.rollout_resource not in (None, cfg.ray.trainer_resource)),
        f"weights.colocate=true with ray.rollout_resource={cfg.ray.rollout_resource}",
        "colocated engines run on the trainer's nodes: unset ray.rollout_resource (or set weights.colocate=false)",
    )
    _validate_async(cfg)
    _validate_objectives(cfg)
    _validate_data(cfg)
    _validate_truncation(cfg)
    if cfg.device == "cpu":
        _require(
            r.engine != RolloutBackend.vllm or r.tp <= 2,
            f"rollout.tp={r.tp} on CPU",
            "this CPU build runs at most TP2 per engine",
        )
    return cfg


def _validate_truncation(cfg: VimeConfig) -> None:
    """Exact top-k / top-p / min-p (algo.top_k, top_p, min_p) run on the vLLM rollout engine, synchronously."""
    a = cfg.algo
    if a.top_k <= 0 and a.top_p == 1.0 and a.min_p == 0.0:
        return
    what = f"algo.top_k={a.top_k}, top_p={a.top_p}, min_p={a.min_p}"
    _require(
        cfg.rollout.engine == RolloutBackend.vllm,
        f"{what} with rollout.engine={cfg.rollout.engine.value}",
        "truncated sampling runs on vLLM's strict sampler: set rollout.engine=vllm (or top_k=-1 top_p=1 min_p=0)",
    )
    _require(
        a.max_staleness == 0,
        f"{what} with algo.max_staleness={a.max_staleness}",
        "the asynchronous loop's behaviour re-scoring has no truncated form yet: use algo.max_staleness=0",
    )


def _validate_async(cfg: VimeConfig) -> None:
    """The asynchronous loop's settings (algo.max_staleness, correction, rollout.partial, kept versions)."""
    a, n = cfg.algo, cfg.algo.max_staleness
    _require(n >= 0, f"algo.max_staleness={n}", "staleness counts weight versions: use 0 (synchronous) or N >= 1")
    _require(
        a.correction in CORRECTIONS,
        f"algo.correction={a.correction!r} does not exist",
        f"use one of {', '.join(CORRECTIONS)}",
    )
    _require(
        n == 0 or a.correction != "none",
        f"algo.max_staleness={n} with algo.correction=none (asynchronous training without an off-policy correction)",
        "set algo.correction=decoupled, tis or icepop",
    )
    _require(
        not cfg.rollout.partial or n >= 1,
        "rollout.partial=true with algo.max_staleness=0",
        "in-flight weight updates make tokens stale: set algo.max_staleness >= 1, or rollout.partial=false",
    )
    wait = cfg.rollout.partial_wait
    _require(
        wait == 0 or (cfg.rollout.partial and 1 <= wait < a.max_new_tokens),
        f"rollout.partial_wait={cfg.rollout.partial_wait}",
        "use it with rollout.partial=true, below "
        "algo.max_new_tokens (the token count at which a rollout waits for the next version)",
    )
    # in-flight updates are staged in host memory and land at an engine-step boundary: from Ray's object store,
    # or from rl_kernel's gloo push group (`auto` on CPU is one of the two per engine)
    staged = str(cfg.weights.transport) in ("object_store", "gloo") or (
        str(cfg.weights.transport) == "auto" and cfg.device == "cpu"
    )
    _require(
        not cfg.rollout.partial or staged,
        f"rollout.partial=true with weights.transport={cfg.weights.transport} on {cfg.device}",
        "in-flight updates are staged in host memory and swapped in between engine steps, but the CUDA pushes "
        "(ipc, nccl) land through vLLM's weight-update API straight in the weights of the engine that runs "
        "the rollout, with no staging buffer: use weights.transport=object_store or gloo on CPU",
    )
    _require(
        n == 0 or cfg.rollout.sleep_level == 0,
        f"rollout.sleep_level={cfg.rollout.sleep_level} with algo.max_staleness={n}",
        "the asynchronous engine generates the next batch while the trainer trains, so it cannot sleep: "
        "set rollout.sleep_level=0",
    )
    _require(a.is_cap >= 1.0 and math.isfinite(a.is_cap), f"algo.is_cap={a.is_cap}", "use a finite cap >= 1")
    _require(
        0 < a.icepop_low <= 1.0 <= a.icepop_high and math.isfinite(a.icepop_high),
        f"algo.icepop_low={a.icepop_low}, algo.icepop_high={a.icepop_high}",
        "use 0 < icepop_low <= 1 <= icepop_high (a finite band around 1)",
    )
    _require(
        0 < a.behaviour_check <= 1.0,
        f"algo.behaviour_check={a.behaviour_check}",
        "use a share in (0, 1]; 1.0 checks every token",
    )
    kept = cfg.trainer.kept_versions
    _require(kept >= 0, f"trainer.kept_versions={kept}", "use 0 (max_staleness + 1) or a count >= 1")
    _require(
        kept == 0 or kept >= n + 1,
        f"trainer.kept_versions={kept} cannot cover algo.max_staleness={n} (a "
        f"token {n} versions old needs its version kept beside the current one)",
        f"keep at least {n + 1} versions or lower algo.max_staleness",
    )
    if n >= 1:
        _require(
            not cfg.trainer.scoring_pass,
            "trainer.scoring_pass=true with algo.max_staleness >= 1",
            "the asynchronous loop checks stale tokens by re-scoring them under their own versions: "
            "drop trainer.scoring_pass",
        )


def _validate_objectives(cfg: VimeConfig) -> None:
    """The objective's settings (advantages, loss, clips, KL, dynamic sampling, mini-batches)."""
    from vime.trainer.advantages import ADV_ESTIMATORS
    from vime.trainer.grpo import POLICY_LOSSES
    from vime.trainer.losses import KL_ESTIMATORS, LOSS_AGGS

    a = cfg.algo
    for key, names in (
        ("adv_estimator", ADV_ESTIMATORS),
        ("loss_agg", LOSS_AGGS),
        ("policy_loss", POLICY_LOSSES),
        ("kl_estimator", KL_ESTIMATORS),
    ):
        value = getattr(a, key)
        _require(value in names, f"algo.{key}={value!r} does not exist", f"use one of {', '.join(names)}")
    for key in ("clip_low", "clip_high", "gspo_clip_low", "gspo_clip_high"):
        value = getattr(a, key)
        _require(
            value is None or (math.isfinite(value) and value >= 0),
            f"algo.{key}={value}",
            "use a finite clip range >= 0 (null clip_low / clip_high: algo.clip_eps)",
        )
    for key in ("clip_low", "gspo_clip_low"):
        _require((getattr(a, key) or 0.0) < 1, f"algo.{key}={getattr(a, key)}", "use a value < 1 (ratio > 0)")
    _require(
        a.clip_c is None or (math.isfinite(a.clip_c) and a.clip_c > 1),
        f"algo.clip_c={a.clip_c}",
        "the dual-clip bound is a ratio > 1 (3 is usual); null turns it off",
    )
    _require(
        a.loss_agg != "seq_mean_token_sum_norm" or (a.loss_norm_tokens is not None and a.loss_norm_tokens > 0),
        f"algo.loss_agg=seq_mean_token_sum_norm with algo.loss_norm_tokens={a.loss_norm_tokens}",
        "set algo.loss_norm_tokens to the constant divisor in tokens (Dr.GRPO: algo.max_new_tokens)",
    )
    _require(
        not a.kl_in_reward or a.kl_coef > 0,
        f"algo.kl_in_reward=true with algo.kl_coef={a.kl_coef}",
        "the penalty is kl_coef x the KL: set algo.kl_coef > 0",
    )
    _require(a.max_sample_rounds >= 1, f"algo.max_sample_rounds={a.max_sample_rounds}", "use >= 1")
    _require(a.ppo_epochs >= 1, f"algo.ppo_epochs={a.ppo_epochs}", "use >= 1 passes over the batch")
    batch = a.prompts_per_step * a.group_size
    _require(
        a.mini_batches >= 1 and batch % a.mini_batches == 0,
        f"algo.mini_batches={a.mini_batches} does not divide the {batch} samples of a step "
        f"(algo.prompts_per_step x group_size)",
        "use a divisor of prompts_per_step x group_size",
    )
    for key in ("dynamic_sampling", "kl_in_reward"):
        _require(
            not getattr(a, key) or a.max_staleness == 0,
            f"algo.{key}=true with algo.max_staleness={a.max_staleness}",
            "it runs in the synchronous loop only: set algo.max_staleness=0",
        )


def loss_fields(cfg: VimeConfig) -> dict[str, Any]:
    """The trainer's objective settings (vime.trainer.grpo.LossConfig fields; clip_low / clip_high default to
    algo.clip_eps)."""
    a = cfg.algo
    return {
        "clip_low": a.clip_eps if a.clip_low is None else a.clip_low,
        "clip_high": a.clip_eps if a.clip_high is None else a.clip_high,
        **{
            k: getattr(a, k)
            for k in (
                "policy_loss",
                "gspo_clip_low",
                "gspo_clip_high",
                "clip_c",
                "kl_estimator",
                "kl_in_reward",
                "loss_agg",
                "loss_norm_tokens",
                "mini_batches",
                "ppo_epochs",
            )
        },
    }


def _validate_data(cfg: VimeConfig) -> None:
    """Data, reward and eval settings that meet (issue 36)."""
    _require(
        not cfg.data.path or cfg.reward.fn not in (None, "task"),
        f"data.path={cfg.data.path} with reward.fn={cfg.reward.fn or 'null'} (the generated task's reward)",
        "set reward.fn: math, exact, regex or your module.path:function",
    )
    _require(
        not cfg.eval.path or cfg.reward.fn not in (None, "task"),
        f"eval.path={cfg.eval.path} with reward.fn={cfg.reward.fn or 'null'} (the generated task's reward)",
        "set reward.fn: math, exact, regex or your module.path:function",
    )
    _require(
        cfg.reward.fn != "regex" or bool(cfg.reward.pattern),
        "reward.fn=regex without reward.pattern",
        "set reward.pattern (e.g. 'answer: (\\d+)')",
    )
    _require(
        cfg.reward.overlong_buffer < cfg.algo.max_new_tokens,
        f"reward.overlong_buffer={cfg.reward.overlong_buffer} >= algo.max_new_tokens={cfg.algo.max_new_tokens}",
        "use a buffer below algo.max_new_tokens (or 0: off)",
    )
    _require(
        not cfg.eval.path or cfg.algo.max_staleness == 0,
        f"eval.path with algo.max_staleness={cfg.algo.max_staleness}",
        "evaluation runs between the synchronous loop's steps: set algo.max_staleness=0 or unset eval.path",
    )


def kept_versions(cfg: VimeConfig) -> int:
    """How many weight versions the trainer keeps (0 in the synchronous loop, which needs none)."""
    n = cfg.algo.max_staleness
    return 0 if n == 0 else (cfg.trainer.kept_versions or n + 1)


def as_dict(cfg: VimeConfig) -> dict[str, Any]:
    """Plain JSON-able dict (enums as their values) for logs and W&B."""

    def plain(x):
        if isinstance(x, Enum):
            return x.value
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))


def config_or_exit(dcfg: DictConfig) -> VimeConfig:
    """The validated config of an entry point (`vime.train`, `vime.audit`); a bad one ends the process
    with one line: `config error: ...`."""
    try:
        return validate(to_object(dcfg))
    except (ValidationError, ConfigError) as e:
        raise SystemExit(f"config error: {e}") from None
