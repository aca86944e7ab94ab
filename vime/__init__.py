"""vime: the RL training timeline (Ray driver, vLLM rollout, Megatron trainer, weight sync) that measures,
on every active token of every step, whether rollout and trainer logprobs agree bit for bit.

Run it with `python -m vime.train` (embedded CPU default) or `python -m vime.train +experiment=...`.
"""
