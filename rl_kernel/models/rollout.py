"""A paged-KV rollout engine over `Qwen3Reference`: continuous batching, chunked prefill, decode.

Each step the scheduler (vLLM v1 style) gives every running request, in arrival order, as many of
its not-yet-computed tokens as fit in the `max_num_batched_tokens` budget, so a prompt may be split
across steps at arbitrary boundaries while other requests decode. A request that has computed all
its tokens samples the next one from the strict full-vocab distribution (`rk.log_softmax`) with its
own seeded generator, and records that token's fp32 logprob from `rk.logprobs`. KV blocks come from
a shuffled free list, so block tables are not contiguous. Under TP every rank runs the same schedule
and draws the same samples (the logprobs are identical on all ranks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

import rl_kernel as rk
from rl_kernel.models.qwen3 import Qwen3Reference

DEFAULT_BLOCK_SIZE = 16  # tokens per KV page of the reference engine


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    arrival_step: int = 0  # the scheduler step at which the request becomes visible
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens (prompt excluded)
    logprobs: torch.Tensor  # fp32 [len(token_ids)]: log p(token | prefix) at the request's temperature
    finish_step: int = -1
    versions: list[int] = field(default_factory=list)  # weight version that sampled each token


@dataclass
class _Seq:
    index: int
    req: Request
    generator: torch.Generator
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache
    logprobs: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    finish_step: int = -1

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt_ids)

    @property
    def kv_capacity(self) -> int:
        # The last sampled token is never fed back, so its KV is never stored.
        return len(self.req.prompt_ids) + self.req.max_new_tokens - 1


class RolloutEngine:
    """Generate from `model` with a paged KV cache of `num_blocks` blocks of `block_size` tokens per
    layer ([num_blocks, block_size, Hkv_local, d]), at most `max_num_batched_tokens` tokens per step."""

    def __init__(
        self,
        model: Qwen3Reference,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_batched_tokens: int = 64,
        block_seed: int = 0,
    ):
        if min(num_blocks, block_size, max_num_batched_tokens) < 1:
            raise ValueError("num_blocks, block_size and max_num_batched_tokens must be >= 1")
        self.model, self.block_size, self.budget = model, block_size, max_num_batched_tokens
        c = model.config
        shape = (num_blocks, block_size, model.kv_heads, c.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(block_seed).shuffle(self.free)
        self.num_blocks = num_blocks
        # The last `generate`'s schedule: per step, (request index, first position, token count).
        self.trace: list[list[tuple[int, int, int]]] = []

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def generate(self, requests: list[Request], seed: int = 0, between_steps=None) -> list[Completion]:
        """Run all `requests` to completion; returns their completions in request order. Request i
        samples with a generator seeded from (seed, i), so its tokens do not depend on the batch.

        `between_steps(mid_prefill: bool, sampled: int) -> int`, when given, runs before every scheduler
        step (an in-flight weight update may land there: running requests keep their KV cache) and returns
        the weight version the step runs under, which every token the step samples records; `mid_prefill`
        says some running request has part of its prompt computed (an update then would split its
        prompt's K/V over two versions, which no token records), `sampled` is the fewest tokens any
        unfinished request has sampled. Without it every token records 0."""
        vocab = self.model.config.vocab_size
        for i, r in enumerate(requests):
            if not r.prompt_ids or r.max_new_tokens < 1 or r.temperature <= 0:
                raise ValueError(f"request {i}: needs a non-empty prompt, max_new_tokens >= 1 and temperature > 0")
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
                raise ValueError(f"request {i}: prompt token ids must lie in [0, {vocab})")
            if self._blocks_for(len(r.prompt_ids) + r.max_new_tokens - 1) > self.num_blocks:
                raise ValueError(
                    f"request {i} needs more than the cache's {self.num_blocks} blocks of "
                    f"{self.block_size} tokens: raise num_blocks or shorten it"
                )
        seqs = [
            _Seq(i, r, torch.Generator(device=self.model.device).manual_seed(seed * 1_000_003 + i), list(r.prompt_ids))
            for i, r in enumerate(requests)
        ]
        waiting = sorted(seqs, key=lambda s: (s.req.arrival_step, s.index))
        running: list[_Seq] = []
        reserved, step = 0, 0  # blocks promised to running requests (admission never over-commits)
        self.trace, self.version = [], 0
        while waiting or running:
            if between_steps is not None:
                self.version = int(
                    between_steps(
                        any(0 < s.computed < len(s.req.prompt_ids) for s in running),
                        min(s.generated for s in waiting + running),
                    )
                )
            while waiting and waiting[0].req.arrival_step <= step:
                need = self._blocks_for(waiting[0].kv_capacity)
                if reserved + need > self.num_blocks:
                    break
                reserved += need
                running.append(waiting.pop(0))
            self.trace.append(self._step(running, step) if running else [])
            for s in [s for s in running if s.done]:
                running.remove(s)
                reserved -= self._blocks_for(s.kv_capacity)
                self.free.extend(s.blocks)
                s.blocks = []
            step += 1
        return [
            Completion(s.tokens[len(s.req.prompt_ids) :], torch.stack(s.logprobs), s.finish_step, s.versions)
            for s in seqs
        ]

    def _schedule(self, running: list[_Seq]) -> list[tuple[_Seq, int]]:
        batch, budget = [], self.budget
        for s in running:
            n = min(len(s.tokens) - s.computed, budget)
            if n == 0:
                break
            while len(s.blocks) * self.block_size < s.computed + n:
                s.blocks.append(self.free.pop())
            batch.append((s, n))
            budget -= n
        return batch

    def _step(self, running: list[_Seq], step: int) -> list[tuple[int, int, int]]:
        batch = self._schedule(running)
        trace = [(s.index, s.computed, n) for s, n in batch]
        dev, bs = self.model.device, self.block_size
        ids, pos, slots = [], [], []
        for s, n in batch:
            p = range(s.computed, s.computed + n)
            ids += s.tokens[s.computed : s.computed + n]
            pos += p
            slots += [s.blocks[j // bs] * bs + j % bs for j in p]
        q_lens = torch.tensor([n for _, n in batch])
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(dev)
        seq_lens = torch.tensor([s.computed + n for s, n in batch], device=dev)
        width = max(len(s.blocks) for s, _ in batch)
        table = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s, _ in batch], device=dev)
        slot_mapping = torch.tensor(slots, device=dev)

        def attention(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            rk.write_kv_cache(k, v, self.k_cache[i], self.v_cache[i], slot_mapping)
            return rk.paged_attention(q, self.k_cache[i], self.v_cache[i], table, seq_lens, qsl, self.model.scale)

        with torch.no_grad():
            hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), attention)
        for s, n in batch:
            s.computed += n
        ready = [(b, s) for b, (s, _) in enumerate(batch) if s.computed == len(s.tokens)]
        if ready:
            self._sample([s for _, s in ready], hidden[qsl[1:][[b for b, _ in ready]] - 1], step)
        return trace

    def _sample(self, seqs: list[_Seq], hidden: torch.Tensor, step: int) -> None:
        m = self.model
        temps = torch.tensor([s.req.temperature for s in seqs], dtype=torch.float64, device=m.device)
        with torch.no_grad():
            logits = m.logits_fp32(hidden)  # full vocab on every rank, so every rank samples the same token
            probs = torch.exp(rk.log_softmax(logits, temps, vocab_size=m.config.vocab_size).to(torch.float64))
            tokens = torch.cat([torch.multinomial(probs[j], 1, generator=s.generator) for j, s in enumerate(seqs)])
            lps = m.logprobs(hidden, tokens, temps)
        for s, t, lp in zip(seqs, tokens.tolist(), lps):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.versions.append(self.version)
            if s.generated >= s.req.max_new_tokens or t in s.req.stop_token_ids:
                s.done, s.finish_step = True, step


def version_segments(prompt_len: int, versions: list[int]) -> list[tuple[int, int, int]]:
    """(first position, end position, weight version) runs of the positions a generation fed through the
    model, for a response whose token j was sampled under `versions[j]`: the forward that produced token j
    fed position prompt_len - 1 + j, and the prompt's other positions were prefilled with the first token's
    forward. The last response token is never fed."""
    if prompt_len < 1 or not versions:
        raise ValueError("need a non-empty prompt and at least one response token")
    per_position = [versions[0]] * prompt_len + list(versions[1:])
    runs, start = [], 0
    for p in range(1, len(per_position) + 1):
        if p == len(per_position) or per_position[p] != per_position[start]:
            runs.append((start, p, per_position[start]))
            start = p
    return runs


def mixed_version_logprobs(
    model: Qwen3Reference,
    prompt_ids: list[int],
    response_ids: list[int],
    versions: list[int],
    temperature: float,
    load_version,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """fp32 logprobs of a response whose tokens were produced under different weight versions (a weight
    update landed while the request ran, keeping its KV cache), as a paged engine produced them: the
    positions are fed in runs of one version (`version_segments`), `load_version(v)` puts version v's
    weights into `model` before each run, and every run attends over one paged KV cache that holds the
    K/V earlier runs computed under their own versions. Token j's logprob comes from the run of
    `versions[j]`. The strict ops make the bits independent of how positions are split into runs, so a
    single-version response gives the teacher-forcing bits."""
    if len(response_ids) != len(versions):
        raise ValueError(f"{len(response_ids)} response tokens but {len(versions)} versions")
    dev, c = model.device, model.config
    tokens = list(prompt_ids) + list(response_ids)
    fed = len(tokens) - 1
    blocks = -(-fed // block_size)
    shape = (blocks, block_size, model.kv_heads, c.head_dim)
    k_cache = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(c.num_layers)]
    v_cache = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(c.num_layers)]
    table = torch.arange(blocks, device=dev).unsqueeze(0)
    out: list[torch.Tensor] = []
    for start, end, version in version_segments(len(prompt_ids), versions):
        load_version(version)
        pos = torch.arange(start, end, device=dev)
        qsl = torch.tensor([0, end - start], device=dev)
        seq_lens = torch.tensor([end], device=dev)

        def attention(
            i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos=pos, qsl=qsl, seq_lens=seq_lens
        ) -> torch.Tensor:
            rk.write_kv_cache(k, v, k_cache[i], v_cache[i], pos)  # block j holds positions j*bs..: slot = position
            return rk.paged_attention(q, k_cache[i], v_cache[i], table, seq_lens, qsl, model.scale)

        with torch.no_grad():
            hidden = model.forward(torch.tensor(tokens[start:end], device=dev), pos, attention)
            first = max(start, len(prompt_ids) - 1)  # the positions whose next token is a response token
            if first < end:
                targets = torch.tensor(tokens[first + 1 : end + 1], device=dev)
                temps = torch.full((end - first,), float(temperature), dtype=torch.float64, device=dev)
                out.append(model.logprobs(hidden[first - start :], targets, temps).to(torch.float32))
    return torch.cat(out)
