"""rl_kernel inside Megatron-core: a strict Qwen3 trainer whose logprobs match the rollout bit for bit.

- `MegatronPolicy` / `TrainBatch`: the trainer API (logprobs, train_step, weight export/import).
- `get_rl_kernel_layer_spec`: Megatron layer specs (strict: rl_kernel modules; native: Megatron's).
- `convert`: HF Qwen3 <-> Megatron GPTModel weights (TP-sharded), exact both ways.
- `loss.policy_loss`: the GRPO/PPO clipped policy loss (pure torch).
See docs/megatron.md.
"""

from rl_kernel.integrations.megatron.loss import PolicyLossConfig, policy_loss
from rl_kernel.integrations.megatron.policy import MegatronPolicy, TrainBatch
from rl_kernel.integrations.megatron.spec import get_rl_kernel_layer_spec

__all__ = ["MegatronPolicy", "PolicyLossConfig", "TrainBatch", "get_rl_kernel_layer_spec", "policy_loss"]
