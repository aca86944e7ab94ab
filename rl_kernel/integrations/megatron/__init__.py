"""rl_kernel inside Megatron-core: a strict Qwen3 trainer whose logprobs match the rollout bit for bit.

- `MegatronPolicy` / `TrainBatch`: the trainer API (logprobs, train_step, weight export/import).
- `get_rl_kernel_layer_spec`: Megatron layer specs (strict: rl_kernel modules; native: Megatron's).
- `convert`: HF Qwen3 <-> Megatron GPTModel weights (TP-sharded), exact both ways.
- `loss.policy_loss`: the GRPO/PPO clipped policy loss (pure torch).
See docs/megatron.md.
"""

from __future__ import annotations

import importlib

# Exports load on first use, so that `integrations.megatron.cp` (context-parallel attention, torch only)
# imports where megatron-core is absent (the GPU image).
_EXPORTS = {"PolicyLossConfig": "loss", "policy_loss": "loss", "MegatronPolicy": "policy", "TrainBatch": "policy",
            "get_rl_kernel_layer_spec": "spec"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
