"""Reference Qwen3 (dense) forward built only from rl_kernel ops: the yardstick for both engines.

Teacher forcing (`forward_packed`, `sequence_logprobs`) runs packed varlen attention; the rollout
engine (`rl_kernel.models.rollout`) runs the same layers over a paged KV cache through `forward`.
In strict mode both paths give the same fp32 logprob bits for the same token.

The layers are the shared `rl_kernel.models.layers` blocks (the vLLM model and the Megatron spec run
the same ones). Tensor parallelism (`group`) follows the one layout table,
`rl_kernel.models.qwen3_layout`: q heads and kv heads split contiguously per rank (column-parallel
q/k/v, gate/up; kv heads replicated when tp > num_kv_heads), o_proj and down_proj split along K
(row-parallel, `rk.row_parallel_linear`), embedding and LM head split by contiguous vocab rows,
the vocab padded to a multiple of `vocab_multiple * tp` with zero rows. With tp dividing 8, strict
TP gives the same bits as TP1.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import rl_kernel as rk
from rl_kernel.models.layers import AttentionFn, Qwen3Model
from rl_kernel.models.packing import pack
from rl_kernel.models.qwen3_layout import VOCAB_DIVISOR, weight_layout
from rl_kernel.ops.moe import check_top_k


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> Qwen3Config:
        """Validate an HF Qwen3 config dict; reject what this reference does not implement."""
        archs = cfg.get("architectures") or []
        if "Qwen3ForCausalLM" not in archs or cfg.get("model_type") not in (None, "qwen3"):
            raise ValueError(
                f"{source}: architecture {archs} / model_type {cfg.get('model_type')!r} is not a dense "
                "Qwen3ForCausalLM; Qwen3Reference implements only that"
            )
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise ValueError(
                f"{source}: an MoE config (num_experts) as a dense Qwen3; read it with "
                "rl_kernel.models.qwen3.read_config (Qwen3MoeForCausalLM: rl_kernel.models.qwen3_moe)"
            )
        unsupported = {
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "use_sliding_window": bool(cfg.get("use_sliding_window", False)),
            "hidden_act != silu": cfg.get("hidden_act", "silu") != "silu",
        }
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            unsupported[f"rope_type={rope.get('rope_type', rope.get('type'))}"] = True
        if any(unsupported.values()):
            raise ValueError(f"{source}: unsupported Qwen3 options {[k for k, v in unsupported.items() if v]}")
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise ValueError(f"{source}: no rope_theta (neither rope_parameters.rope_theta nor rope_theta)")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=float(theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        )


@dataclass
class _Shard:
    """Where an HF tensor lives on this rank: `local` (a view into the model's storage) holds the
    contiguous slice [rank * n, (rank + 1) * n) of the full tensor along `dim` (None: replicated);
    `full_shape` is the HF shape (vocab rows unpadded)."""

    local: torch.Tensor
    dim: int | None
    full_shape: tuple[int, ...]


# HF Qwen3-MoE keys this model reads (beyond the dense Qwen3's); their meaning is transformers' Qwen3MoeConfig's.
MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "output_router_logits",
)
# Options of other MoE families (Qwen2-MoE's shared expert, DeepSeek's grouped routing and biased router) that
# the strict model does not implement: a config that sets one is refused.
UNSUPPORTED_KEYS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "topk_method",
    "scoring_func",
)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> Qwen3MoeConfig:
        """Validate an HF Qwen3-MoE config dict; a one-line ValueError naming the key for what the strict
        model does not cover (another architecture, another MoE family's options, top-k > num_experts)."""
        archs = cfg.get("architectures") or []
        if "Qwen3MoeForCausalLM" not in archs or cfg.get("model_type") not in (None, "qwen3_moe"):
            raise ValueError(
                f"{source}: architecture {archs} / model_type {cfg.get('model_type')!r} is not a "
                "Qwen3MoeForCausalLM; rl_kernel's MoE model implements only that"
            )
        unsupported = [k for k in UNSUPPORTED_KEYS if cfg.get(k)]
        if unsupported:
            raise ValueError(f"{source}: MoE options {unsupported} are not implemented by the strict Qwen3-MoE model")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not experts or not cfg.get("moe_intermediate_size"):
            raise ValueError(f"{source}: a Qwen3-MoE config needs num_experts and moe_intermediate_size > 0")
        try:
            check_top_k(int(cfg.get("num_experts_per_tok", 0)), int(experts))
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"{source}: decoder_sparse_step={step} must be >= 1")
        dense = {k: v for k, v in cfg.items() if k not in MOE_KEYS}
        base = Qwen3Config.from_hf(dense | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, source)
        return cls(
            **dataclasses.asdict(base),
            num_experts=int(experts),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=step,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )


def read_config(path: str | Path) -> Qwen3Config:
    """Shape of the HF Qwen3 checkpoint in directory `path` (config.json): a `Qwen3Config`, or a
    `Qwen3MoeConfig` for a Qwen3MoeForCausalLM; clear errors otherwise."""
    cfg_file = _config_file(path)
    cfg = json.loads(cfg_file.read_text())
    if "Qwen3MoeForCausalLM" in (cfg.get("architectures") or []) or cfg.get("model_type") == "qwen3_moe":
        return Qwen3MoeConfig.from_hf(cfg, str(cfg_file))
    return Qwen3Config.from_hf(cfg, str(cfg_file))


def _config_file(path: str | Path) -> Path:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"no Qwen3 checkpoint at {path}: {cfg_file} is missing (expected a directory with "
            "config.json and *.safetensors; rl_kernel.models.tiny.make_tiny_qwen3 makes one)"
        )
    return cfg_file


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors file(s) in checkpoint directory `path`, by HF name (`lm_head.weight`
    added as the embedding when config.json ties them and the files omit it)."""
    from safetensors.torch import load_file

    _config_file(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (only safetensors checkpoints are supported)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if "lm_head.weight" not in state and read_config(path).tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _mlp_weights(mlp) -> dict[str, torch.Tensor]:
    if hasattr(mlp, "experts"):  # an MoE block
        return dict(router=mlp.gate.weight, gate_up=mlp.experts.gate_up_proj, down=mlp.experts.down_proj)
    return dict(gate_up=mlp.gate_up_proj.weight, down=mlp.down_proj.weight)


class Qwen3Reference:
    """Qwen3ForCausalLM inference forward from rl_kernel ops, optionally tensor-parallel over `group`:
    the shared `Qwen3Model` blocks (`self.model`) with HF weight loading and export."""

    def __init__(
        self,
        config: Qwen3Config,
        dtype: torch.dtype = torch.bfloat16,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        vocab_multiple: int = VOCAB_DIVISOR,
    ):
        self.config = config
        self.dtype, self.group, self.device = dtype, group, torch.device(device)
        self.model = Qwen3Model(config, group, dtype, self.device, vocab_multiple)
        self.tp, self.rank, self.vocab_multiple = self.model.tp, self.model.rank, vocab_multiple
        shape = self.model.shape
        self.heads, self.kv_heads, self.inter = shape.heads, shape.kv_heads, shape.inter
        self.padded_vocab = shape.vocab * self.tp
        self.scale = self.model.scale
        self._layout = weight_layout(config)
        views = self.model.hf_views()
        self._shards = {n: _Shard(views[n], w.dim, w.shape) for n, w in self._layout.items()}

    # ---- weights -------------------------------------------------------------------------------

    @property
    def embed(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    @property
    def norm(self) -> torch.Tensor:
        return self.model.norm.weight

    @property
    def layers(self) -> list[dict[str, torch.Tensor]]:
        """Each layer's weight tensors by short name (the parameters of `self.model.layers`)."""
        return [
            dict(
                input_norm=b.input_layernorm.weight,
                post_norm=b.post_attention_layernorm.weight,
                q_norm=b.self_attn.q_norm.weight,
                k_norm=b.self_attn.k_norm.weight,
                qkv=b.self_attn.qkv_proj.weight,
                o=b.self_attn.o_proj.weight,
                **_mlp_weights(b.mlp),
            )
            for b in self.model.layers
        ]

    def load_hf_weights(self, weights: dict[str, torch.Tensor], strict: bool = False) -> None:
        """Copy full (unsharded) HF-named tensors into this rank's shards, in place. Any subset of
        names may be given (bucketed weight sync); `strict=True` requires all of them."""
        unknown = sorted(set(weights) - set(self._shards))
        if unknown:
            raise KeyError(f"unknown Qwen3 weight names {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        missing = sorted(set(self._shards) - set(weights))
        if strict and missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
        for name, full in weights.items():
            w = self._layout[name]
            if tuple(full.shape) != w.shape:
                raise ValueError(f"{name}: shape {tuple(full.shape)} does not match the config's {w.shape}")
            full = full.to(device=self.device, dtype=self.dtype)
            with torch.no_grad():
                self._shards[name].local.copy_(w.shard(full, self.rank, self.tp, self.vocab_multiple))

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (shards gathered from every rank: a bit copy), in the model dtype."""
        out = {}
        for name, s in self._shards.items():
            parts = [s.local]
            if s.dim is not None and self.tp > 1:
                parts = [torch.empty_like(s.local) for _ in range(self.tp)]
                dist.all_gather(parts, s.local.contiguous(), group=self.group)
            out[name] = self._layout[name].unshard(parts).clone()
        return out

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.bfloat16,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        vocab_multiple: int = VOCAB_DIVISOR,
    ) -> Qwen3Reference:
        """Load an HF Qwen3 checkpoint directory (config.json + *.safetensors), sharded for `group`."""
        weights = load_hf_state_dict(path)
        config = read_config(path)
        model = cls(config, dtype=dtype, group=group, device=device, vocab_multiple=vocab_multiple)
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        model.load_hf_weights(weights, strict=True)
        return model

    # ---- forward -------------------------------------------------------------------------------

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup of token ids (checked against the model vocab)."""
        ids = input_ids.to(device=self.device, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}) (the model vocab); got "
                f"[{int(ids.min())}, {int(ids.max())}]: tokenizer and checkpoint disagree?"
            )
        return self.model.embed_tokens(ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Final-norm hidden states [T, D] of tokens `input_ids` [T] at `positions` [T]; `attention`
        supplies the attention of each layer (packed varlen, or paged over a KV cache)."""
        return self.model(None, positions.to(self.device), attention, inputs_embeds=self.embed_tokens(input_ids))

    def forward_packed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Teacher-forcing forward of packed sequences: input_ids [T], cu_seqlens [B+1] (0, ..., T);
        sequence b holds positions 0..len_b-1. Returns the final hidden states [T, D]."""
        cu = cu_seqlens.to(device=self.device, dtype=torch.int64)
        if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != input_ids.shape[0] or bool((cu.diff() < 0).any()):
            raise ValueError(f"cu_seqlens must be [0, ..., T={input_ids.shape[0]}] non-decreasing; got {cu.tolist()}")
        lens = cu.diff()
        positions = torch.arange(input_ids.shape[0], device=self.device) - cu[:-1].repeat_interleave(lens)
        return self.forward(input_ids, positions, lambda i, q, k, v: rk.attention_varlen(q, k, v, cu, self.scale))

    def logprobs(
        self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0, **options
    ) -> torch.Tensor:
        """fp32 log p(targets[t] | hidden[t]) at `temperature` over the real vocab (vocab-parallel; `options`:
        `rk.logprobs`' `truncation` / `with_entropy`)."""
        return self.model.lm_head.logprobs(hidden, targets.to(self.device), temperature, **options)

    def logits_fp32(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, padded vocab] of the whole vocab on every rank (columns >= vocab_size: padding)."""
        return self.model.lm_head.logits(hidden)

    def sequence_logprobs(
        self,
        sequences: list[list[int]],
        prompt_lens: list[int],
        temperature: float | list[float] = 1.0,
        truncation=None,
    ) -> list[torch.Tensor]:
        """Teacher-forcing fp32 logprobs: entry i holds log p(sequences[i][j] | sequences[i][:j]) for
        j in [prompt_lens[i], len(sequences[i])), all sequences packed into one varlen batch.
        `temperature` is one float or one per sequence; `truncation` (`rl_kernel.ops.truncation.Truncation`):
        under the exact top-k / top-p / min-p renormalised distribution."""
        temps = [temperature] * len(sequences) if isinstance(temperature, int | float) else list(temperature)
        packed = pack(sequences, prompt_lens)
        rows = packed.rows
        with torch.no_grad():
            hidden = self.forward_packed(packed.ids, packed.cu_seqlens)
            out = self.logprobs(hidden[rows], packed.targets[rows], packed.per_row(temps)[rows], truncation=truncation)
        return list(out.cpu().split(packed.counts))
