"""rl_kernel inside Megatron-core: a strict Qwen3 trainer whose logprobs match the rollout bit for bit.

- `MegatronPolicy`: the engine adapter (model and optimizer from an HF checkpoint, packed teacher-forcing
  logprobs, gradient reductions and optimizer step, weight export/import). The RL algorithm that drives
  it (packing, the GRPO loss and step) is vime's: `vime.trainer.grpo`.
- `get_rl_kernel_layer_spec`: Megatron layer specs (strict: rl_kernel modules; native: Megatron's).
- `convert`: HF Qwen3 <-> Megatron GPTModel weights (TP-sharded), exact both ways.
See docs/megatron.md.
"""

from __future__ import annotations

import importlib

# Exports load on first use, so that `integrations.megatron.cp` (context-parallel attention, torch only)
# imports where megatron-core is absent (the GPU image).
_EXPORTS = {"MegatronPolicy": "policy", "get_rl_kernel_layer_spec": "spec"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
