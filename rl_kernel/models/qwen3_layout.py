"""Qwen3 weight layout: for every HF tensor name, how tensor parallelism shards it. One table, used by
the reference model, the vLLM model, HF <-> Megatron conversion and weight export.

- column-parallel (q/k/v, gate/up): output rows split contiguously per rank (dim 0);
- row-parallel (o_proj, down_proj): the K columns split contiguously per rank (dim 1);
- vocab-parallel (embedding, LM head): vocab rows split contiguously (dim 0), the vocab padded with
  zero rows to a multiple of `vocab_multiple * tp` (`padded_vocab`, Megatron's rule) and cut on export;
- KV replication: with tp > num_kv_heads, each kv head is held by tp / num_kv_heads consecutive ranks
  (rank r holds kv head r // (tp / num_kv_heads)), as vLLM does; export keeps one copy;
- replicated: norms;
- MoE layers (Qwen3-MoE, tp 1 only): the router `mlp.gate.weight` [E, D], and each expert j's gate/up/down
  held in the fused 3D parameters `experts.gate_up_proj` [E, 2I, D] (gate rows then up rows) and
  `experts.down_proj` [E, D, I] at index `expert` (the HF hub names are per expert).
`module` names the parameter of the shared modules (`rl_kernel.models.layers`) the tensor lives in
and `part` its segment there (q/k/v in the fused qkv_proj, gate/up in gate_up_proj).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB_DIVISOR = 128


def padded_vocab(vocab_size: int, tp: int = 1, multiple: int = VOCAB_DIVISOR) -> int:
    """The vocab padded to a multiple of `multiple * tp` (every rank holds the same number of rows;
    the padding rows are zeros and never score)."""
    m = multiple * tp
    return -(-vocab_size // m) * m


def check_tp(config, tp: int, *, kv_replication: bool = True) -> None:
    """Raise unless `tp` splits heads and MLP columns evenly, and divides num_kv_heads (or, with
    `kv_replication`, is a multiple of it)."""
    kv = config.num_kv_heads
    kv_ok = kv % tp == 0 or (kv_replication and tp % kv == 0)
    if not kv_ok or config.num_heads % tp or config.intermediate_size % tp:
        kv_rule = "divide or be a multiple of" if kv_replication else "divide"
        raise ValueError(
            f"tp={tp} must {kv_rule} num_kv_heads={kv}, divide num_heads={config.num_heads} "
            f"and intermediate_size={config.intermediate_size}"
        )


@dataclass(frozen=True)
class TPShape:
    """Per-rank sizes of a Qwen3 under tensor parallelism `tp`."""

    tp: int
    heads: int  # q heads per rank
    kv_heads: int  # kv heads per rank (1 when replicated)
    kv_replicas: int  # ranks holding each kv head (1 unless tp > num_kv_heads)
    inter: int  # MLP columns per rank
    vocab: int  # padded vocab rows per rank

    @classmethod
    def of(cls, config, tp: int = 1, vocab_multiple: int = VOCAB_DIVISOR) -> TPShape:
        check_tp(config, tp)
        replicas = max(1, tp // config.num_kv_heads)
        return cls(
            tp=tp,
            heads=config.num_heads // tp,
            kv_heads=config.num_kv_heads * replicas // tp,
            kv_replicas=replicas,
            inter=config.intermediate_size // tp,
            vocab=padded_vocab(config.vocab_size, tp, vocab_multiple) // tp,
        )


@dataclass(frozen=True)
class WeightLayout:
    """How the HF tensor `name` (full shape `shape`) is sharded: along `dim` (None: replicated),
    `vocab` rows padded, its `kv_heads` heads (k/v projections; 0: none) replicated when tp > kv_heads.
    Stored in `module` (a parameter name of `rl_kernel.models.layers.Qwen3Model`), segment `part`
    of it along dim 0."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    module: str
    part: int = 0
    vocab: bool = False
    kv_heads: int = 0
    expert: int | None = None  # MoE expert weights: the index into the fused 3D parameter

    def local_size(self, tp: int, vocab_multiple: int = VOCAB_DIVISOR) -> int:
        """Rows (dim 0) or columns (dim 1) of this rank's shard."""
        n = self.shape[self.dim]
        if self.vocab:
            return padded_vocab(n, tp, vocab_multiple) // tp
        return n // self._parts(tp)

    def _parts(self, tp: int) -> int:
        """Number of distinct shards (tp, or num_kv_heads when kv heads are replicated)."""
        return min(tp, self.kv_heads) if self.kv_heads else tp

    def shard(self, full: torch.Tensor, rank: int, tp: int, vocab_multiple: int = VOCAB_DIVISOR) -> torch.Tensor:
        """This rank's shard of the full HF tensor (a view, except for padded vocab rows)."""
        if self.dim is None:
            return full
        n = self.local_size(tp, vocab_multiple)
        if self.vocab and full.shape[0] < n * tp:
            full = torch.cat([full, full.new_zeros(n * tp - full.shape[0], *full.shape[1:])])
        index = rank // (tp // self._parts(tp))  # kv replicas: consecutive ranks share a head
        return full.narrow(self.dim, index * n, n)

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full HF tensor from every rank's shard (rank order): a bit copy, padding cut, one copy
        of each replicated kv head."""
        if self.dim is None:
            return shards[0]
        tp = len(shards)
        full = torch.cat(shards[:: tp // self._parts(tp)], dim=self.dim)
        return full.narrow(self.dim, 0, self.shape[self.dim])


def weight_layout(config) -> dict[str, WeightLayout]:
    """The layout of every HF tensor of a Qwen3 `config` (a `rl_kernel.models.qwen3.Qwen3Config`), by
    HF name, in checkpoint order (the LM head only when untied)."""
    c, d, D = config, config.head_dim, config.hidden_size
    t = {
        "model.embed_tokens.weight": WeightLayout(
            "model.embed_tokens.weight", (c.vocab_size, D), 0, "embed_tokens.weight", vocab=True
        ),
        "model.norm.weight": WeightLayout("model.norm.weight", (D,), None, "norm.weight"),
    }
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = WeightLayout("lm_head.weight", (c.vocab_size, D), 0, "lm_head.weight", vocab=True)
    for i in range(c.num_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        moe = is_moe_layer(c, i)
        rows = [
            ("input_layernorm.weight", (D,), None, "input_layernorm.weight", 0),
            ("post_attention_layernorm.weight", (D,), None, "post_attention_layernorm.weight", 0),
            ("self_attn.q_norm.weight", (d,), None, "self_attn.q_norm.weight", 0),
            ("self_attn.k_norm.weight", (d,), None, "self_attn.k_norm.weight", 0),
            ("self_attn.q_proj.weight", (c.num_heads * d, D), 0, "self_attn.qkv_proj.weight", 0),
            ("self_attn.k_proj.weight", (c.num_kv_heads * d, D), 0, "self_attn.qkv_proj.weight", 1),
            ("self_attn.v_proj.weight", (c.num_kv_heads * d, D), 0, "self_attn.qkv_proj.weight", 2),
            ("self_attn.o_proj.weight", (D, c.num_heads * d), 1, "self_attn.o_proj.weight", 0),
            ("mlp.gate_proj.weight", (c.intermediate_size, D), 0, "mlp.gate_up_proj.weight", 0),
            ("mlp.up_proj.weight", (c.intermediate_size, D), 0, "mlp.gate_up_proj.weight", 1),
            ("mlp.down_proj.weight", (D, c.intermediate_size), 1, "mlp.down_proj.weight", 0),
        ]
        for name, shape, dim, module, part in rows:
            if moe and name.startswith("mlp."):
                continue
            kv = c.num_kv_heads if name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight") else 0
            t[p + name] = WeightLayout(p + name, shape, dim, m + module, part, kv_heads=kv)
        if moe:
            t.update(_moe_rows(c, p, m))
    return t


def is_moe_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` of `config` is a sparse MoE block (Qwen3-MoE's rule; a dense config has
    no `num_experts`)."""
    experts = getattr(config, "num_experts", 0)
    step = getattr(config, "decoder_sparse_step", 1)
    return experts > 0 and layer not in getattr(config, "mlp_only_layers", ()) and (layer + 1) % step == 0


def _moe_rows(c, p: str, m: str) -> dict[str, WeightLayout]:
    """The router and every expert's gate/up/down of one MoE layer (HF prefix `p`, module prefix `m`)."""
    D, inter = c.hidden_size, c.moe_intermediate_size
    rows = {p + "mlp.gate.weight": WeightLayout(p + "mlp.gate.weight", (c.num_experts, D), None, m + "mlp.gate.weight")}
    for j in range(c.num_experts):
        e = f"{p}mlp.experts.{j}."
        for name, shape, module, part in (
            ("gate_proj.weight", (inter, D), "mlp.experts.gate_up_proj", 0),
            ("up_proj.weight", (inter, D), "mlp.experts.gate_up_proj", 1),
            ("down_proj.weight", (D, inter), "mlp.experts.down_proj", 0),
        ):
            rows[e + name] = WeightLayout(e + name, shape, None, m + module, part, expert=j)
    return rows


def local_views(
    layout: dict[str, WeightLayout], param, tp: int, vocab_multiple: int = VOCAB_DIVISOR
) -> dict[str, torch.Tensor]:
    """This rank's storage of every HF tensor: a view into `param(layout.module)` (the fused
    parameters hold their parts one after the other along dim 0)."""
    views, offsets = {}, {}
    for name, w in layout.items():
        p = param(w.module)
        if w.expert is not None:  # tp 1: the expert's whole rows of the fused 3D parameter
            views[name] = p[w.expert].narrow(0, w.part * w.shape[0], w.shape[0])
        elif w.dim == 0:
            n, start = w.local_size(tp, vocab_multiple), offsets.get(w.module, 0)
            views[name], offsets[w.module] = p.narrow(0, start, n), start + n
        else:
            views[name] = p
    return views
