"""Reference models built only from rl_kernel ops (the yardstick both engine integrations are tested against)."""

from rl_kernel.models.qwen3 import Qwen3Config, Qwen3Reference
from rl_kernel.models.rollout import Completion, Request, RolloutEngine
from rl_kernel.models.tiny import make_tiny_qwen3

__all__ = ["Completion", "Qwen3Config", "Qwen3Reference", "Request", "RolloutEngine", "make_tiny_qwen3"]
