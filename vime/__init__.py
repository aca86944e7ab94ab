"""vime: the RL training timeline (Ray driver, vLLM rollout, Megatron trainer, weight sync) that measures,
on every active token of every step, whether rollout and trainer logprobs agree bit for bit.

Run it with `python -m vime.train` (embedded CPU default) or `python -m vime.train +experiment=...`.

Where things are (each folder's `__init__` says what it holds):
    train.py, audit.py  the two commands (a run; an audit of a checkpoint's two sides)
    config/             the typed config (schema), checks before anything starts, the cluster layout
    loop/               the RL step: the driver (synchronous loop), the asynchronous loop, versions, parity
    rollout/            rollout engines: the Ray actor, vLLM, rl_kernel's reference engine
    trainer/            trainer ranks: the Ray actor, Megatron, the reference trainer, GRPO and corrections
    weights/            the weight sync from trainer to engines, over every transport
    cluster/            Ray: start, placement groups, node addresses, remote calls that name the dead actor
    faults/             clean stops (signals, temporary files) and restarting a dead rollout engine
    state/              checkpoints, resume, the run directory, the Hugging Face export
    reporting/          metrics (JSONL, W&B), the console, the figure, the commands printed to the user
    data/               prompts and rewards
    engines.py          the engine contracts and the sample record they share
    errors.py           the errors a user sees
"""
