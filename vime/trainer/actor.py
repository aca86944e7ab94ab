"""Trainer actor: one trainer rank (Megatron, or the labelled reference fallback) in a Ray actor.

Every rank receives the same step batch; rank 0's results are the trainer's answer. The actor
scores samples by teacher forcing (returning what it scored: token ids, positions, version,
temperature, vocab range), runs the GRPO step (v -> v+1), exports HF-named weights for the sync,
and reports the rl_kernel evidence of its last scoring forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path

import torch

from vime.cluster.process import apply_modes, redirect_output
from vime.config.schema import KeptOn, TrainerBackend, TrainerConfig
from vime.engines import Sample, Scored, Trainer, one_temperature
from vime.faults import stops
from vime.trainer.grpo import LossConfig, TrainBatch

log = logging.getLogger(__name__)


class TrainerWorker:
    """Wrapped with `ray.remote` by the driver; plain class so it is testable in-process."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        cfg: TrainerConfig,
        model_path: str,
        dtype: str,
        device: str,
        modes: dict[str, str],
        seed: int,
        kl_coef: float,
        clip_eps: float,
        correction: dict | None = None,
        kept_versions: int = 0,
        truncation=None,
        entropy_coef: float = 0.0,
    ):
        """`correction`: LossConfig fields over `clip_eps` / `kl_coef` (the off-policy correction's: correction,
        is_cap, icepop_low/high; the objective's: `vime.config.schema.loss_fields`);
        `kept_versions`: how many weight versions to keep for `score_behaviour` (0: none), where
        `cfg.kept_on` says; `truncation`: the run's exact top-k / top-p / min-p (rl_kernel.ops.truncation), which
        every scoring and training forward rebuilds; `entropy_coef`: the loss's entropy bonus."""
        redirect_output()
        stops.forked_children_die_with_this_process()
        apply_modes(modes)
        self.rank, self.world_size, self.cfg, self.modes = rank, world_size, cfg, modes
        self._args = (model_path, dtype, device)
        self.loss = LossConfig(
            **(
                {"clip_low": clip_eps, "clip_high": clip_eps, "kl_coef": kl_coef, "entropy_coef": entropy_coef}
                | (correction or {})
            )
        )  # fixed for the run
        self.truncation = truncation
        self.kept_versions = kept_versions
        self.kept: dict[int, dict[str, torch.Tensor]] = {}  # version -> HF-named weights (`cfg.kept_on`)
        self._paged = None  # a Qwen3Reference for mixed-version re-scoring, made on first use
        torch.manual_seed(seed)
        self.engine: Trainer | None = None
        self.version = 0
        self._evidence: list[dict] = []
        self._push = None  # rank 0's EnginePush (ipc / nccl weight transports), made on the first push

    def address(self) -> tuple[str, int]:
        """(this node's Ray address, a port listening on that address only, kept for `start`): rank 0's
        answer is the rendezvous of the trainer's world across nodes."""
        import ray

        from vime.cluster import placement

        host = ray.util.get_node_ip_address()
        self._listen = placement.listen_socket(host)
        return host, self._listen.getsockname()[1]

    def start(self, init_method: str) -> dict:
        """Join the trainer's torch.distributed world at `init_method` (`file://...` on one node,
        `tcp://host:port` across nodes: rank 0 serves the store from the socket `address` bound, and every
        rank's gloo / NCCL sockets use the interface of its node's address) and load the policy; returns
        `info()`."""
        from vime.cluster import placement

        model_path, dtype, device = self._args
        store = placement.trainer_store(init_method, self.rank, self.world_size, getattr(self, "_listen", None))
        if store is not None:
            placement.bind_node_interface()
        if TrainerBackend(self.cfg.engine) == TrainerBackend.megatron:
            from vime.trainer.megatron_engine import MegatronTrainer

            self.engine = MegatronTrainer(
                self.cfg,
                model_path,
                dtype,
                device,
                self.loss,
                self.rank,
                self.world_size,
                init_method,
                store=store,
                truncation=self.truncation,
            )
        else:
            from vime.trainer.reference import ReferenceTrainer

            self.engine = ReferenceTrainer(self.cfg, model_path, dtype, device, self.loss, truncation=self.truncation)
        self._keep()
        return self.info() | release_cached_memory(self.device)

    @property
    def device(self) -> torch.device:
        """The device this rank trains on (a GPU; CPU in the gloo form the tests run)."""
        return torch.device(self._args[2])

    # ---- behaviour versions (the asynchronous loop) ---------------------------------------------------

    def _keep(self) -> None:
        """Keep this version's weights (HF-named, where `cfg.kept_on` says; collective) and drop versions beyond
        the last `kept_versions`. The HF conversion runs on the trainer's device either way: on the host it
        would be a single-threaded pass over every weight, seconds a step at Qwen3-8B scale."""
        if not self.kept_versions:
            return
        expired = [self.kept.pop(v) for v in sorted(self.kept) if v <= self.version - self.kept_versions]
        weights = self.engine.export_hf(device=self.device)
        if self.cfg.kept_on == KeptOn.host and self.device.type == "cuda":
            weights = to_pinned_host(weights, expired[0] if expired else None)
        self.kept[self.version] = weights

    def _weights_of(self, version: int) -> dict[str, torch.Tensor]:
        """Version `version`'s kept weights, on the trainer's device."""
        if version not in self.kept:
            from vime.errors import WeightSyncError

            raise WeightSyncError(
                f"a sample needs weight version {version}, but the trainer keeps only versions "
                f"{sorted(self.kept)} (trainer.kept_versions={self.kept_versions}): raise "
                "trainer.kept_versions or lower algo.max_staleness"
            )
        return {k: v.to(self.device, non_blocking=True) for k, v in self.kept[version].items()}

    def score_behaviour(self, samples: list[Sample]) -> list[Scored]:
        """Every token's logprob under the weight version(s) that produced it (collective): samples of one
        version by this trainer's own forward with that version's weights swapped in (the current ones
        are put back, bit for bit, after), mixed-version samples by rl_kernel's paged forward over one KV
        cache, each run of positions under its own version (`mixed_version_logprobs`). Returns one `Scored`
        per sample, with the versions it scored under."""
        temperature = one_temperature(samples)
        out: list[Scored | None] = [None] * len(samples)
        whole = {}
        for i, s in enumerate(samples):
            if len(set(s.versions)) == 1:
                whole.setdefault(s.versions[0], []).append(i)
        try:
            for version, idx in sorted(whole.items()):
                self.engine.load_scoring_weights(self._weights_of(version))
                part = [samples[i] for i in idx]
                logprobs, positions = self.engine.score(
                    [s.prompt_ids + s.response_ids for s in part], [len(s.prompt_ids) for s in part], temperature
                )
                for i, sc in zip(idx, self._scored(part, logprobs, positions, temperature)):
                    out[i] = dataclasses.replace(sc, version=version, versions=list(samples[i].versions))
        finally:
            if whole:
                self.engine.load_scoring_weights(self._weights_of(self.version))
        mixed = [i for i, s in enumerate(samples) if len(set(s.versions)) > 1]
        for i in mixed:
            s = samples[i]
            lp = self._paged_scorer().score(s, self._weights_of)
            n = len(s.prompt_ids)
            out[i] = Scored(
                token_ids=list(s.response_ids),
                positions=list(range(n, n + len(s.response_ids))),
                logprobs=lp,
                version=max(s.versions),
                temperature=temperature,
                vocab_size=self.engine.vocab_size,
                versions=list(s.versions),
            )
        return out if self.rank == 0 else []

    def _paged_scorer(self):
        if self._paged is None:
            from vime.trainer.behaviour import PagedScorer

            self._paged = PagedScorer(*self._args)
        return self._paged

    def info(self) -> dict:
        return {
            "rank": self.rank,
            "label": self.engine.label,
            "vocab_size": self.engine.vocab_size,
            "version": self.version,
            "modes": self.modes,
            "pid": os.getpid(),
        }

    def score(self, samples: list[Sample]) -> list[Scored]:
        """The trainer's no-grad teacher-forcing logprobs of `samples` (the separate scoring pass)."""
        import rl_kernel as rk

        temperature = one_temperature(samples)
        rk.evidence.reset()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with _capture_routes(self.engine) as captured:
            logprobs, positions = self.engine.score(
                [s.prompt_ids + s.response_ids for s in samples], [len(s.prompt_ids) for s in samples], temperature
            )
        self._evidence = rk.evidence.snapshot()
        return self._scored(samples, logprobs, positions, temperature, _per_sequence(captured, samples))

    def _scored(
        self,
        samples: list[Sample],
        logprobs: list[torch.Tensor],
        positions: list[list[int]],
        temperature: float,
        routes: list[torch.Tensor] | None = None,
    ) -> list[Scored]:
        return [
            Scored(
                token_ids=list(s.response_ids),
                positions=list(p),
                logprobs=lp.to(torch.float32).contiguous(),
                version=self.version,
                temperature=temperature,
                vocab_size=self.engine.vocab_size,
                **self._truncation_fields(),
                routes=None if routes is None else routes[i],
            )
            for i, (s, lp, p) in enumerate(zip(samples, logprobs, positions))
        ]

    def reference_kl(self, samples: list[Sample]) -> list[float]:
        """Per sample, the summed per-token KL (`algo.kl_estimator`) of its rollout logprobs to the reference
        policy's (the frozen initial weights; collective): the reward penalty of `algo.kl_in_reward`."""
        from vime.trainer.grpo import score
        from vime.trainer.losses import kl_penalty

        ref = score(
            self.engine.ref,
            [s.prompt_ids + s.response_ids for s in samples],
            [len(s.prompt_ids) for s in samples],
            one_temperature(samples),
            self.engine.micro_batch_size,
        )
        return [
            float(kl_penalty(torch.tensor(s.logprobs, dtype=torch.float32), r, self.loss.kl_estimator).sum())
            for s, r in zip(samples, ref)
        ]

    def _truncation_fields(self) -> dict:
        t = self.truncation
        return {} if t is None else {"top_k": t.top_k, "top_p": t.top_p, "min_p": t.min_p}

    def evidence(self) -> list[dict]:
        return self._evidence

    def set_modes(self, modes: dict[str, str]) -> dict[str, str]:
        """Switch this rank's per-boundary rl_kernel modes for later forwards (`vime.audit`)."""
        apply_modes(modes)
        self.engine.set_modes(modes)
        self.modes = dict(modes)
        return self.modes

    def train_step(self, samples: list[Sample], score: bool = False, fresh: list[bool] | None = None) -> dict:
        """One GRPO optimizer step on `samples` (old logprobs = the rollout's); version v -> v+1. The
        trainer's train-mode logprobs are also compared with the rollout's: a second, independent
        measurement, reported as train_mismatch_count / train_max_abs_diff / train_mean_abs_diff.
        With `score`, the step's training forward is also its scoring forward: the result holds
        "scored" (what `score` returns, at version v) and `evidence()` is that forward's. `fresh` marks the
        samples produced entirely by version v (None: all; the lag-0 ratio check covers those)."""
        import rl_kernel as rk

        temperature = one_temperature(samples)
        rk.evidence.reset()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with _capture_routes(self.engine if score else None) as captured:
            stats = self._train_forward(samples, temperature, score, fresh)
        # the packer takes response token j of sequence i at position prompt_lens[i] + j
        scored = (
            self._scored(
                samples,
                stats.pop("logprobs"),
                [list(range(len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids))) for s in samples],
                temperature,
                _per_sequence(captured, samples),
            )
            if score
            else None
        )
        return self._after_train_step(stats, scored, score)

    def _train_forward(self, samples: list[Sample], temperature: float, score: bool, fresh: list[bool] | None) -> dict:
        return self.engine.train_step(
            TrainBatch(
                [s.prompt_ids + s.response_ids for s in samples],
                [len(s.prompt_ids) for s in samples],
                [s.advantage for s in samples],
                [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
                temperature=temperature,
                keep_logprobs=score,
                fresh=fresh,
            )
        )

    def _after_train_step(self, stats: dict, scored: list[Scored] | None, score: bool) -> dict:
        import rl_kernel as rk

        if score:
            self._evidence = rk.evidence.snapshot()
        self.version += 1
        self._keep()
        measured = ("mismatch_count", "max_abs_diff", "mean_abs_diff")
        out = {k: v for k, v in stats.items() if k not in (*measured, "tokens")}
        return (
            out
            | {f"train_{k}": stats[k] for k in measured}
            | {"version": self.version}
            | ({"scored": scored} if score else {})
            | release_cached_memory(self.device)
        )

    def save_checkpoint(self, path: str) -> int:
        """Write this rank's part of checkpoint `path` (trainer/ and rng/; collective); returns the version."""
        from vime.state import checkpoint

        self.engine.save(Path(path) / "trainer")
        checkpoint.save_rank_rng(Path(path), self.rank)
        if self.kept_versions and self.rank == 0:  # every rank keeps the same full copies
            checkpoint.save_kept(Path(path), self.kept, self.version)
        return self.version

    def load_checkpoint(self, path: str) -> int:
        """Load checkpoint `path` into this rank (collective); returns the restored weight version."""
        import torch.distributed as dist

        from vime.state import checkpoint

        self.engine.load(Path(path) / "trainer")
        checkpoint.load_rank_rng(Path(path), self.rank)
        self.version = int(torch.load(Path(path) / checkpoint.STATE, weights_only=False)["version"])
        if self.kept_versions:  # the versions the rollouts in flight are re-scored under, then this one
            self.kept = checkpoint.load_kept(Path(path), self.device if self.cfg.kept_on == KeptOn.device else "cpu")
            self._keep()
        if dist.is_initialized():
            dist.barrier()
        return self.version

    def export_hf(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights (collective: TP shards are gathered); rank 0's answer is used."""
        tensors = self.engine.export_hf()
        return tensors if self.rank == 0 else {}

    def export_buckets(self, bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
        """HF-named full tensors (TP shards gathered), in buckets of about `bucket_bytes` each."""
        buckets, current, size = [], {}, 0
        for name, t in self.engine.export_hf().items():
            if current and size + t.numel() * t.element_size() > bucket_bytes:
                buckets.append(current)
                current, size = {}, 0
            current[name] = t.contiguous()
            size += t.numel() * t.element_size()
        if current:
            buckets.append(current)
        return buckets if self.rank == 0 else []

    def push_weights(
        self, engines: list, version: int, transport: str, bucket_bytes: int, in_flight: bool = False
    ) -> dict:
        """Push the HF-named full weights (collective: TP shards are gathered) as version `version` into the
        rollout actors `engines` over `transport` ("ipc", "nccl" or "vllm_nccl": vime.weights.sync); rank 0
        pushes and returns the engines' acknowledgement {version, tensors, bytes, buckets}, the other ranks {}.
        With `ipc` and several ranks, every rank ships the handles of its own GPU's copy (colocated engines on
        every trainer GPU). `in_flight` (rollout.partial, `nccl` on CPU: gloo): the push goes to the engines'
        "weights" concurrency group, beside a running rollout, and is acknowledged once it has landed there."""
        tensors = self.engine.export_hf(device=self.device)
        every_rank = transport == "ipc" and self.world_size > 1
        if self.rank != 0 and not every_rank:
            return {}
        if self._push is None:
            from vime.weights.sync import EnginePush

            self._push = EnginePush(self.device, dtype=self._args[1])
        ack = self._push.push(
            engines,
            tensors,
            version,
            transport,
            bucket_bytes,
            every_rank=every_rank,
            concurrency_group="weights" if in_flight else None,
        )
        del tensors
        release_cached_memory(self.device)
        return ack if self.rank == 0 else {}

    def export_to_store(self, bucket_bytes: int) -> dict:
        """`export_buckets`, put in Ray's object store by this rank (collective; rank 0's answer is used):
        {"buckets": [a reference to the list of buckets], "bytes": tensor bytes, "count": buckets}. The
        reference travels inside a list so that the driver passes it on without fetching the weights."""
        import ray

        buckets = self.export_buckets(bucket_bytes)
        nbytes = sum(t.numel() * t.element_size() for b in buckets for t in b.values())
        return {"buckets": [ray.put(buckets)] if self.rank == 0 else [], "bytes": nbytes, "count": len(buckets)}


def release_cached_memory(device: torch.device) -> dict[str, float]:
    """Give the blocks torch's caching allocator holds but no tensor uses back to the GPU, so that a colocated
    vLLM engine can map its memory again when it wakes (the optimizer step's temporaries alone are several GB
    a billion parameters); returns {"trainer_gpu_peak_gib": the most allocated since the last peak reset,
    "trainer_gpu_held_gib": what this process still holds} on CUDA, {} elsewhere."""
    if device.type != "cuda":
        return {}
    torch.cuda.empty_cache()
    gib = 1024**3
    return {
        "trainer_gpu_peak_gib": torch.cuda.max_memory_allocated() / gib,
        "trainer_gpu_held_gib": torch.cuda.memory_reserved() / gib,
    }


def to_pinned_host(tensors: dict[str, torch.Tensor], reuse: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Copies of the CUDA `tensors` in pinned host memory, written into `reuse` (an expired version's copies)
    when it has the same names, shapes and dtypes: pinning fresh memory every step costs more than the copy."""
    same = (
        reuse is not None
        and reuse.keys() == tensors.keys()
        and all(reuse[k].shape == v.shape and reuse[k].dtype == v.dtype for k, v in tensors.items())
    )
    out = reuse if same else {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in tensors.items()}
    for k, v in tensors.items():
        out[k].copy_(v, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return out


def _moe_root(engine):
    """The trainer engine's torch model when it has MoE layers (Megatron's GPTModel, the reference's modules)."""
    from rl_kernel.models.qwen3_moe import moe_blocks

    policy = getattr(engine, "policy", None)
    holder = policy if policy is not None else getattr(engine, "model", None)  # MegatronPolicy, Qwen3Reference
    root = getattr(holder, "model", None)
    return root if isinstance(root, torch.nn.Module) and moe_blocks(root) else None


@contextlib.contextmanager
def _capture_routes(engine):
    """Each MoE layer's expert ids of every forward of the block (`rl_kernel.models.qwen3_moe.capture_routes`),
    or None for no engine or a dense model."""
    root = None if engine is None else _moe_root(engine)
    if root is None:
        yield None
        return
    from rl_kernel.models.qwen3_moe import capture_routes

    with capture_routes(root) as captured:
        yield captured


def _per_sequence(captured, samples: list[Sample]) -> list[torch.Tensor] | None:
    """int16 [sequence length, MoE layers, k] per sample from the captured forwards, whose rows are the samples'
    sequences packed in order (micro-batches of consecutive samples); None when there is nothing to split, or
    the rows are not that (a context-parallel rank holds only part of them)."""
    if not captured or not captured[0]:
        return None
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    rows = torch.stack([torch.cat(layer) for layer in captured], dim=1).to("cpu", torch.int16)
    if rows.shape[0] != sum(lengths):
        log.warning("MoE routes: %d captured rows for %d sequence tokens: not compared", rows.shape[0], sum(lengths))
        return None
    return list(rows.split(lengths))
