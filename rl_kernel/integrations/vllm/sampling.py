"""Strict log-probs inside vLLM's sampler, through vLLM's V1 logits-processor extension point.

The request's temperature T travels in `SamplingParams.extra_args[TEMPERATURE_KEY]`; vLLM's own
temperature stays 1.0. `StrictLogprobsProcessor` (not argmax-invariant, so it runs for greedy and
random rows alike, before vLLM's penalties, temperature and top-k/top-p) replaces each fp32 logits
row by `rk.log_softmax(logits, T)`: the strict full-vocab log-probs, entry t equal in bits to
`rk.logprobs(hidden, lm_head, t, T)`. vLLM then divides by its temperature 1.0 (exact), samples
from softmax(log p) = p, and with `logprobs_mode="processed_logits"` returns log p[token] unchanged.

Exact top-k / top-p / min-p: the request's `extra_args[TRUNCATION_KEY]` ({"top_k", "top_p", "min_p"}, built by
`strict_sampling_params`) has the processor replace each row by `rl_kernel.ops.truncation.truncate_log_softmax`
of its strict log-probs: the renormalised log-probs over the contract's support, -inf elsewhere, so vLLM can
sample only support tokens and returns their renormalised log-prob, which a trainer rebuilds in bits
(`rk.logprobs(..., truncation=...)`). vLLM's own top_k / top_p / min_p stay off.

Strict contract for vLLM's own top-k / top-p / min-p, penalties, logit bias, bad words, allowed tokens and
prompt logprobs: not supported. Each would change the distribution after the strict log-probs (and vLLM renormalises
those in its own, non-contract arithmetic), so a request that sets one is rejected with an error at
submission (`validate_params`), never silently sampled from another distribution.

Batch-invariant sampling (`extra_args[SAMPLER_KEY]`, {"seed": int or None}; `strict_sampling_params` sets it for
single-sample requests without top-logprobs): the processor samples the row itself, `rl_kernel.gumbel_sample_` from
the request's seed and the token's position in its response, and returns the row one-hot: -inf but the sampled
token, whose strict log-prob bits are kept. vLLM's temperature is 0 for these requests, so its sampler takes the
argmax (the token) and returns the row's entry unchanged, without its own softmax, exponential draw and division
over the vocab. The token does not depend on the batch, its order, preemption or what the engine drew before; the
rank vLLM reports for it is 1 (the row holds one finite entry).

Forced decoding (re-scoring fixed tokens, `vime.audit`): a request whose
`extra_args[FORCED_TOKENS_KEY]` lists token ids samples exactly those, one per decode step: the
processor keeps the strict log-prob of the forced token and sets every other entry of the row to
-inf, so vLLM's sampler can only pick it and returns its strict log-prob bits unchanged. The
tokens come out of the real decode path (paged KV cache, batching, chunked prefill), so their
log-probs are the ones sampling would have recorded.
"""

from __future__ import annotations

import torch

import rl_kernel as rk
from rl_kernel.ops.sampling import row_keys, seed_bits
from rl_kernel.ops.truncation import Truncation, truncate_log_softmax

TEMPERATURE_KEY = "rl_kernel_temperature"
FORCED_TOKENS_KEY = "rl_kernel_forced_tokens"
TRUNCATION_KEY = "rl_kernel_truncation"  # {"top_k": int, "top_p": float, "min_p": float}
SAMPLER_KEY = "rl_kernel_sampler"  # {"seed": int or None}: rl_kernel samples the request (vLLM's temperature 0)


def truncation_of(params) -> Truncation:
    """The exact truncation a strict request asks for (`extra_args[TRUNCATION_KEY]`; none: off). ValueError
    (one line) on bad values."""
    spec = (params.extra_args or {}).get(TRUNCATION_KEY) or {}
    if not isinstance(spec, dict) or not set(spec) <= {"top_k", "top_p", "min_p"}:
        raise ValueError(f"extra_args[{TRUNCATION_KEY!r}]={spec!r} must be a dict of top_k, top_p, min_p")
    return Truncation(**spec)


def _rejections(params) -> list[str]:
    """What in `params` a strict engine cannot honour (empty when the request is fine)."""
    extra = params.extra_args or {}
    problems = []
    temp = extra.get(TEMPERATURE_KEY)
    if temp is None:
        problems.append(
            f"extra_args[{TEMPERATURE_KEY!r}] is missing (build the request with "
            "rl_kernel.integrations.vllm.strict_sampling_params)"
        )
    elif not isinstance(temp, (int, float)) or not temp > 0:
        problems.append(
            f"extra_args[{TEMPERATURE_KEY!r}]={temp!r} must be a number > 0 (greedy decoding is not "
            "part of the strict contract; use a small temperature)"
        )
    sampler = extra.get(SAMPLER_KEY)
    if sampler is None and params.temperature != 1.0:
        problems.append(
            f"temperature={params.temperature} must be 1.0 (the real temperature goes in "
            f"extra_args[{TEMPERATURE_KEY!r}])"
        )
    if sampler is not None:
        problems += _sampler_rejections(params, sampler)
    own = f" (vLLM's own; exact truncation goes in extra_args[{TRUNCATION_KEY!r}], see strict_sampling_params)"
    if params.top_k not in (0, -1, None):
        problems.append(f"top_k={params.top_k}{own}")
    if params.top_p != 1.0:
        problems.append(f"top_p={params.top_p}{own}")
    if params.min_p != 0.0:
        problems.append(f"min_p={params.min_p}{own}")
    try:
        truncation_of(params)
    except (TypeError, ValueError) as e:
        problems.append(f"extra_args[{TRUNCATION_KEY!r}]: {e}")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(params, name) != neutral:
            problems.append(f"{name}={getattr(params, name)}")
    for name in ("logit_bias", "bad_words", "allowed_token_ids"):
        if getattr(params, name, None):
            problems.append(f"{name} is set")
    if params.prompt_logprobs is not None:
        problems.append(
            "prompt_logprobs is set (vLLM computes those with its own log_softmax, outside the "
            "contract; teacher-force the prompt with the reference model or the trainer)"
        )
    return problems


def _sampler_rejections(params, sampler) -> list[str]:
    """What in a request for rl_kernel's sampler (`extra_args[SAMPLER_KEY]`) it cannot honour."""
    where = f"extra_args[{SAMPLER_KEY!r}]"
    if not isinstance(sampler, dict) or set(sampler) != {"seed"} or type(sampler["seed"]) not in (int, type(None)):
        return [f"{where}={sampler!r} must be {{'seed': int or None}}"]
    problems = []
    if params.temperature != 0.0:
        problems.append(f"temperature={params.temperature} must be 0.0 with {where} (rl_kernel samples the row)")
    if params.n != 1:
        problems.append(f"n={params.n} must be 1 with {where} (send one request per sample, each with its seed)")
    if params.logprobs not in (None, 0):
        problems.append(f"logprobs={params.logprobs} must be 0 with {where} (its rows hold one finite entry)")
    if (params.extra_args or {}).get(FORCED_TOKENS_KEY) is not None:
        problems.append(f"{where} and extra_args[{FORCED_TOKENS_KEY!r}] exclude each other")
    return problems


def _seed_of(sampler: dict) -> int:
    """A request's seed bits: its own, else one drawn from this worker's global CPU generator as the request enters
    the batch (vLLM's engine `seed` seeds it, so unseeded runs repeat; a preempted unseeded request draws anew
    when it re-enters, still an exact sample)."""
    seed = sampler["seed"]
    return seed_bits(int(torch.randint(0, 2**63 - 1, ())) if seed is None else seed)


def _warm_up(device: torch.device, vocab_size: int) -> None:
    """Compile the strict log-softmax's kernels for the batch shapes Triton specialises on (one row, a multiple of
    16, neither) while the engine starts, not during the first sampling step (vLLM's warm-up never runs a
    logits processor)."""
    with rk.mode("strict", "logprob"):
        for rows in (1, 2, 16):
            rk.log_softmax(torch.zeros(rows, vocab_size, dtype=torch.float32, device=device), 1.0)


try:
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
except ImportError:  # vLLM not installed: the helpers in this package still import
    BatchUpdate, LogitsProcessor = None, object


class StrictLogprobsProcessor(LogitsProcessor):
    """Replaces fp32 logits rows by strict log-probs at each request's temperature."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        problems = _rejections(sampling_params)
        if problems:
            raise ValueError(
                "rl_kernel strict vLLM engine cannot honour this request: "
                + "; ".join(problems)
                + ". Strict mode samples from the full-vocab softmax at the given temperature, or its exact "
                "top-k/top-p/min-p truncation (penalties, logit bias and token masks are not in its contract)."
            )

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.temperatures: dict[int, float] = {}
        self.truncations: dict[int, Truncation] = {}  # batch row -> its exact truncation (rows without: off)
        self.pin = is_pin_memory
        # the batch's temperatures as a host tensor (pinned: copied to the GPU without a wait), per distinct batch:
        # an RL batch keeps one for every step, so no decode step waits for the device
        self._batch_temps: dict[tuple[float, ...], torch.Tensor] = {}
        if torch.device(device).type == "cuda":
            _warm_up(torch.device(device), vllm_config.model_config.get_vocab_size())
        # batch row -> (forced token ids, the request's running output token list)
        self.forced: dict[int, tuple[list[int], list[int]]] = {}
        # batch row -> (the seed's int64 bits, the request's running output token list): rows rl_kernel samples
        self.sampled: dict[int, tuple[int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it must also run for greedy rows, and before vLLM's temperature

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.temperatures.pop(index, None)
            self.forced.pop(index, None)
            self.truncations.pop(index, None)
            self.sampled.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            extra = params.extra_args or {}
            self.temperatures[index] = float(extra[TEMPERATURE_KEY])
            self.forced.pop(index, None)
            self.truncations.pop(index, None)
            self.sampled.pop(index, None)
            truncation = truncation_of(params)
            if truncation.active:
                self.truncations[index] = truncation
            if extra.get(FORCED_TOKENS_KEY) is not None:
                self.forced[index] = ([int(t) for t in extra[FORCED_TOKENS_KEY]], output_ids)
            if extra.get(SAMPLER_KEY) is not None:
                self.sampled[index] = (_seed_of(extra[SAMPLER_KEY]), output_ids)
        for a, b, direction in batch_update.moved:
            for state in (self.temperatures, self.forced, self.truncations, self.sampled):
                ta, tb = state.pop(a, None), state.pop(b, None)
                if ta is not None:
                    state[b] = ta
                if tb is not None and direction.name == "SWAP":
                    state[a] = tb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        missing = [i for i in range(logits.shape[0]) if i not in self.temperatures]
        if missing:
            raise rk.StrictModeError("logprobs", "vllm", f"batch rows {missing} have no strict temperature")
        logprobs = rk.log_softmax(logits, self._temps(tuple(self.temperatures[i] for i in range(logits.shape[0]))))
        if any(i < logprobs.shape[0] for i in self.truncations):
            off = Truncation()
            logprobs = truncate_log_softmax(logprobs, [self.truncations.get(i, off) for i in range(logprobs.shape[0])])
        for row, (tokens, output_ids) in self.forced.items():
            j = len(output_ids)  # tokens generated so far: the next one is tokens[j]
            if row < logprobs.shape[0] and j < len(tokens):
                keep = logprobs[row, tokens[j]].clone()
                logprobs[row].fill_(float("-inf"))
                logprobs[row, tokens[j]] = keep
        if self.sampled:
            self._sample(logprobs)
        return logprobs

    def _sample(self, logprobs: torch.Tensor) -> None:
        """rl_kernel's sampler on its rows: each made one-hot in place at the token its seed and step draw (the
        step: the tokens the request has generated so far, so preemption and re-scheduling draw the same)."""
        rows = sorted(r for r in self.sampled if r < logprobs.shape[0])
        if rows:
            seeds = torch.tensor([self.sampled[r][0] for r in rows], dtype=torch.int64)
            steps = torch.tensor([len(self.sampled[r][1]) for r in rows], dtype=torch.int64)
            host = torch.stack([torch.tensor(rows, dtype=torch.int64), row_keys(seeds, steps)])
            rows_and_keys = (host.pin_memory() if self.pin else host).to(logprobs.device, non_blocking=True)
            rk.gumbel_sample_(logprobs, rows_and_keys[1], rows=rows_and_keys[0])

    def _temps(self, values: tuple[float, ...]) -> torch.Tensor:
        temps = self._batch_temps.get(values)
        if temps is None:
            if len(self._batch_temps) >= 64:
                self._batch_temps.clear()
            temps = torch.tensor(values, dtype=torch.float64)
            temps = self._batch_temps[values] = temps.pin_memory() if self.pin else temps
        return temps
