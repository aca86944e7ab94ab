"""Tiny random Qwen3 checkpoints with a matching tokenizer, for tests and CPU demos (no downloads).

The checkpoint is a plain Hugging Face one (config.json + model.safetensors), so transformers,
vLLM, Megatron's HF loader and `Qwen3Reference` all load it. The tokenizer is character-level:
special tokens, printable ASCII, then filler tokens `<t{i}>` up to the model vocab, so every id the
model can sample decodes to something. `chat=True` adds a newline and Qwen3's special tokens (`<|endoftext|>`
as eos, `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`) before the fillers, and a Qwen3-style chat template.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
QWEN3_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's template, less tools: turns as <|im_start|>role\n...<|im_end|>\n; the generation prompt opens the
# assistant's turn, with an empty think block when enable_thinking is false
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


def _tokenizer(vocab_size: int, chat: bool = False):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]  # 95 printable, incl. space
    words = list(SPECIAL_TOKENS) + chars + (["\n", *QWEN3_SPECIAL_TOKENS] if chat else [])
    if vocab_size < len(words):
        raise ValueError(f"vocab_size={vocab_size} is below the {len(words)} tokens of the char tokenizer")
    words += [f"<t{i}>" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    # one token per character ("[\\s\\S]": the newline too, which "." does not match)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]" if chat else "."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if not chat:
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL_TOKENS])
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<|endoftext|>"
    )
    out.chat_template = CHAT_TEMPLATE
    return out


MAX_POSITION_EMBEDDINGS = 4096  # the context of every tiny checkpoint


def make_tiny_qwen3(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: str = "bfloat16",
    device: str = "cpu",
    init_std: float = 0.1,
    chat: bool = False,
    num_experts: int = 0,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
) -> Path:
    """Write a randomly initialised (seeded) Qwen3ForCausalLM checkpoint and its tokenizer to `path`.

    Untied LM head, rope theta 1e6, 4096 max positions; weights stored in `dtype` ("bfloat16",
    "float32" or "float16"); linear and embedding weights drawn with standard deviation `init_std`. The same
    arguments give the same bytes. `chat=True`: the tokenizer with Qwen3's special tokens and a chat template
    (`_tokenizer`). Returns `path`.
    `device="cpu"` initialises the weights as transformers does; another device (a GPU: seconds for
    billions of parameters, where transformers' CPU init takes minutes) draws them there from one seeded
    generator with the same distributions (linear and embedding weights normal(0, init_std), norm weights
    uniform [0.5, 1.5]), so its bytes depend on that device's generator.
    `num_experts` > 0 makes a Qwen3MoeForCausalLM instead: every layer a sparse block of `num_experts`
    experts of `moe_intermediate_size`, `num_experts_per_tok` routed per token, norm_topk_prob on (as
    Qwen3-30B-A3B), the HF hub's per-expert weight names.
    """
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype must be 'bfloat16', 'float32' or 'float16', got {dtype!r}")
    if num_experts < 0 or (num_experts and not 1 <= num_experts_per_tok <= num_experts):
        raise ValueError(
            f"num_experts={num_experts} must be >= 0 and num_experts_per_tok={num_experts_per_tok} in "
            f"[1, num_experts] (0 experts: a dense Qwen3)"
        )
    config_cls, model_cls = _classes(num_experts)
    moe = (
        dict(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=True,
        )
        if num_experts
        else {}
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(vocab_size, chat)
    config = config_cls(
        **moe,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[model_cls.__name__],
    )
    if torch.device(device).type != "cpu":
        _save_random_on(torch.device(device), config, seed, getattr(torch, dtype), path)
        tokenizer.save_pretrained(path)
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        # Non-trivial norm weights, so a wrong norm placement or a missed weight shows in the logits.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.uniform_(0.5, 1.5)
        # HF zeroes the padding row; a sampled <pad> would then feed RMSNorm an all-zero vector, whose
        # gradient is scaled by 1/sqrt(eps). Real checkpoints have no such row.
        model.model.embed_tokens.weight.data[config.pad_token_id].normal_(0.0, config.initializer_range)
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _classes(num_experts: int):
    """transformers' (config class, model class): Qwen3-MoE when there are experts, else dense Qwen3."""
    if num_experts:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3Config, Qwen3ForCausalLM


def _save_random_on(device: torch.device, config, seed: int, dtype: torch.dtype, path: Path) -> None:
    """config.json + model.safetensors of the config's model with weights drawn on `device` (see
    make_tiny_qwen3), under the HF hub's names (rl_kernel's layout table: per-expert names for MoE)."""
    from safetensors.torch import save_file

    if getattr(config, "num_experts", 0):
        from rl_kernel.models.qwen3_layout import weight_layout
        from rl_kernel.models.qwen3_moe import Qwen3MoeConfig

        names = {n: w.shape for n, w in weight_layout(Qwen3MoeConfig.from_hf(config.to_dict(), "tiny")).items()}
    else:
        from transformers import Qwen3ForCausalLM

        with torch.device("meta"):
            names = {n: tuple(p.shape) for n, p in Qwen3ForCausalLM(config).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in names.items():
        if name.endswith("norm.weight"):
            t = torch.rand(shape, generator=gen, device=device) + 0.5
        else:
            t = torch.randn(shape, generator=gen, device=device) * config.initializer_range
        tensors[name] = t.to(dtype).cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = dtype
    config.save_pretrained(path)
