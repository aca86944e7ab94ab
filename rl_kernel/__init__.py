"""rl_kernel: strict numerical ops under explicit numeric execution contracts.

In strict mode (the default) every op computes each output element by a fixed sequence of IEEE
operations that depends on that element's logical inputs only, so the trainer and the rollout
engine, calling the same ops, produce the same bits for the same token. See `rl_kernel.contracts`
for what a contract pins and `python -m rl_kernel.selftest` to check the guarantee on a machine.
"""

from rl_kernel import contracts, evidence
from rl_kernel.backends import get_backend, set_backend
from rl_kernel.errors import StrictModeError
from rl_kernel.modes import (
    BOUNDARIES,
    MODES,
    OP_BOUNDARY,
    canonical_tp,
    current_modes,
    get_mode,
    logits_dtype,
    mode,
    set_canonical_tp,
    set_logits_dtype,
    set_mode,
)
from rl_kernel.ops.activation import silu_and_mul
from rl_kernel.ops.attention import attention_varlen, paged_attention, write_kv_cache
from rl_kernel.ops.collective import all_reduce
from rl_kernel.ops.gemm import linear, linear_fp32, row_parallel_linear
from rl_kernel.ops.logprob import log_softmax, logprobs
from rl_kernel.ops.moe import moe, moe_combine, moe_experts, moe_route
from rl_kernel.ops.norm import qk_norm, rms_norm
from rl_kernel.ops.rope import qk_norm_rope, rope
from rl_kernel.ops.sampling import gumbel_sample_

__all__ = [
    "BOUNDARIES",
    "MODES",
    "OP_BOUNDARY",
    "StrictModeError",
    "all_reduce",
    "attention_varlen",
    "canonical_tp",
    "contracts",
    "current_modes",
    "evidence",
    "get_backend",
    "get_mode",
    "gumbel_sample_",
    "linear",
    "linear_fp32",
    "log_softmax",
    "logits_dtype",
    "logprobs",
    "mode",
    "moe",
    "moe_combine",
    "moe_experts",
    "moe_route",
    "paged_attention",
    "rms_norm",
    "qk_norm",
    "qk_norm_rope",
    "rope",
    "row_parallel_linear",
    "set_backend",
    "set_canonical_tp",
    "set_logits_dtype",
    "set_mode",
    "silu_and_mul",
    "write_kv_cache",
]
