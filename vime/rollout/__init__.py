"""Rollout engines: the Ray actor a run drives (`actor`), vLLM with the rl_kernel plugin (`vllm_engine`),
and rl_kernel's own paged engine (`reference`)."""
