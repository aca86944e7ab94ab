"""Qwen3-MoE for vLLM: the strict dense model class with Qwen3-MoE's shape.

Registered as `RLKernelQwen3MoeForCausalLM` (`rl_kernel.integrations.vllm.register`); `strict_llm_kwargs` selects
it for a Qwen3MoeForCausalLM checkpoint. Everything but the shape is `RLKernelQwen3ForCausalLM`'s: the forward
is `rl_kernel.models.layers.Qwen3Model`, whose sparse layers are `SparseMoeBlock`s over the strict MoE ops
(`rk.moe_route`, `rk.moe_experts`, `rk.moe_combine`), so a token's route and output in vLLM's batches are the
ones the reference and the trainer compute for it alone; weights load from the HF hub's per-expert names by the
one layout table (`rl_kernel.models.qwen3_layout`). vLLM's fused-MoE kernels never run. Each sparse block writes
its expert ids into a device route buffer allocated here, before vLLM captures its CUDA graphs, so that
`rl_kernel.integrations.vllm.routes.RouteRecorder` reads the routes of replayed decode steps too.

Under `strict_llm_kwargs(compile=True)` each sparse block is one opaque `rl_kernel::moe` node and its route-buffer
write a copy in the compiled graph. Limit (a one-line ValueError at engine start): tensor parallelism 1 (expert
parallelism 1).
"""

from __future__ import annotations

from rl_kernel.integrations.vllm.model import RLKernelQwen3ForCausalLM
from rl_kernel.integrations.vllm.routes import allocate_route_buffers, route_buffer_rows
from rl_kernel.models.qwen3_moe import Qwen3MoeConfig


class RLKernelQwen3MoeForCausalLM(RLKernelQwen3ForCausalLM):
    """vLLM model class for Qwen3MoeForCausalLM checkpoints under rl_kernel's strict ops (see the module doc)."""

    model_types = ("qwen3_moe",)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError("rl_kernel's strict Qwen3-MoE model runs at tensor_parallel_size=1 (expert parallelism 1)")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        allocate_route_buffers(self.model, route_buffer_rows(vllm_config))

    @staticmethod
    def read_shape(config) -> Qwen3MoeConfig:
        return Qwen3MoeConfig.from_hf({**config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}, "hf_config")
