"""Strict log-probs inside vLLM's V2 model runner (GPU): a `Sampler` whose processed logits are the strict ones.

vLLM 0.26 runs its V2 model runner (GPU-side input preparation, a Triton sampler: a few launches per step) only
for engines without custom logits processors; `StrictLogprobsProcessor` (sampling.py) keeps a strict engine on
the V1 runner, whose eager sampling step costs the strict engine host time per decode step (236 host launches per
step against native's 24 at batch 128: benchmarks/results/vllm_decode_profile_h200_b128.md). Here the strict
log-softmax moves into V2's own extension point instead: the strict model's `get_model_state_cls` gives V2 a
model state whose `custom_sampler` swaps vLLM's `Sampler` for `StrictSampler`, which
- takes each request's temperature T from `extra_args[TEMPERATURE_KEY]` (vLLM's own temperature stays 1.0) into
  a host table by request slot, and refuses at `add_request` what the
  strict contract does not cover (`sampling._rejections`; forced decoding, which needs the V1 runner);
- replaces vLLM's `apply_sampling_params` (logit bias, penalties, temperature, min-p: all neutral for a strict
  request) by `rk.log_softmax(logits, T)`: the processed logits are the strict full-vocab log-probs, whose entry
  t equals `rk.logprobs(hidden, lm_head, t, T)` in bits. vLLM's Gumbel sampling then draws from softmax(log p) = p,
  and `logprobs_mode="processed_logits"` returns log p[token] unchanged.

Written for vLLM 0.26's V2 runner (`strict_llm_kwargs(runner="v2")`); V2 needs Triton on a GPU, so this module
has not run on the CPU machine. Status in docs/vllm.md.
"""

from __future__ import annotations

import numpy as np
import torch

import rl_kernel as rk
from rl_kernel.integrations.vllm.sampling import FORCED_TOKENS_KEY, TEMPERATURE_KEY, _rejections

# request-id prefixes of the V2 runner's own warm-up requests at engine start (vllm/v1/worker/gpu/warmup.py in 0.26):
# they exercise every sampling feature and carry no strict temperature; no output of theirs leaves the engine
VLLM_WARMUP_REQUESTS = ("_warmup_", "_v2_mixed_warmup")


def strict_request_temperature(sampling_params) -> float:
    """A strict request's temperature (`extra_args[TEMPERATURE_KEY]`), after the strict contract's checks; raises
    StrictModeError (one line) naming what the request asks that a strict V2 engine cannot honour."""
    problems = _rejections(sampling_params)
    if (sampling_params.extra_args or {}).get(FORCED_TOKENS_KEY) is not None:
        problems.append("forced decoding (extra_args[FORCED_TOKENS_KEY]) runs on the V1 runner: use runner='v1'")
    if problems:
        raise rk.StrictModeError("logprobs", "vllm-v2", "; ".join(problems))
    return float(sampling_params.extra_args[TEMPERATURE_KEY])


def strict_sampler(base):
    """`StrictSampler` over vLLM's constructed V2 `Sampler` `base`: the same states, the strict processed logits."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    class StrictSampler(Sampler):
        def __init__(self, base: Sampler) -> None:  # adopt vLLM's states rather than build them twice
            self.__dict__.update(base.__dict__)
            # per request slot, on the host (read there each step: no device sync for the T > 0 check); slots no
            # request was added to (vLLM's dummy sampler runs at profiling) hold T = 1, their output dropped
            self.strict_temperature = np.ones(base.sampling_states.max_num_reqs, dtype=np.float64)

        def add_request(self, req_idx: int, *args) -> None:  # (prompt_len,) sampling_params: 0.26 passes both
            sampling_params = args[-1]
            req_id = self.req_states.index_to_req_id.get(req_idx, "")
            if req_id.startswith(VLLM_WARMUP_REQUESTS):  # vLLM's kernel warm-up at start: its tokens are dropped
                self.strict_temperature[req_idx] = 1.0
            else:
                self.strict_temperature[req_idx] = strict_request_temperature(sampling_params)
            super().add_request(req_idx, *args)

        def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping_np, *args, **kwargs):
            if logits.shape[0] != len(idx_mapping_np):
                raise rk.StrictModeError(
                    "logprobs", "vllm-v2", "one logits row per request only (speculative decoding is not strict)"
                )
            temps = torch.from_numpy(self.strict_temperature[idx_mapping_np])
            return rk.log_softmax(logits.float(), temps)

    return StrictSampler(base)


def strict_model_state_cls():
    """vLLM's V2 `DefaultModelState` with the strict sampler (`custom_sampler`), for the strict model's
    `get_model_state_cls`."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    class StrictModelState(DefaultModelState):
        def custom_sampler(self, sampler):
            self.model.strict_sampler = True  # the model's compute_logits refuses to serve V2 without it
            return strict_sampler(sampler), None

    return StrictModelState
