"""Moving weights from the trainer to the rollout engines: the versioned push protocol (`transfer`), which
rl_kernel's GPU rollout engine, the vLLM integration (`rl_kernel.integrations.vllm.ipc`, `.nccl`) and vime's
weight sync speak."""
