"""Rollout actor: one rollout engine (vLLM, or the labelled reference fallback) in a Ray actor.

The actor sets this side's rl_kernel modes in its process and passes them to its engine explicitly,
generates GRPO groups (every token stamped with the weight version the engine serves), loads weight
buckets and acknowledges versions, and reports the rl_kernel evidence of its last rollout.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

from vime.cluster.process import apply_modes, redirect_output
from vime.config.schema import RolloutBackend, RolloutConfig
from vime.engines import Rollout, Sample, one_temperature


def _engine_call(method):
    """A RolloutWorker method that uses the engine: when one of the engine's TP worker processes has died
    (before or during the call), shut the engine down (removing its temporary files) and raise the
    death ("rollout engine i, TP rank r died"), which the driver treats as the engine's death."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        death = getattr(self.engine, "worker_death", None)
        if death is None:
            return method(self, *args, **kwargs)
        dead = death()
        if dead is None:
            try:
                return method(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised as is unless a TP worker died under it
                dead = death(wait_s=10.0)
                if dead is None:
                    raise
                self.engine.shutdown()
                raise dead from e
        self.engine.shutdown()
        raise dead

    return call


class RolloutWorker:
    """Wrapped with `ray.remote` by the driver; plain class so it is testable in-process."""

    def __init__(
        self,
        engine_id: int,
        cfg: RolloutConfig,
        model_path: str,
        dtype: str,
        device: str,
        modes: dict[str, str],
        seed: int,
        transport: str = "ipc",
        truncation=None,
    ):
        """`transport` (this engine's weight path, vime.config.layout.engine_transports): how a vLLM engine on CUDA
        takes weights, `ipc` or `nccl`; `gloo` on CPU: rl_kernel's push group, received here (GroupReceiver).
        `truncation`: the run's exact top-k / top-p / min-p (`rl_kernel.ops.truncation.Truncation`; vLLM only)."""
        redirect_output()
        apply_modes(modes)
        self.engine_id, self.cfg, self.modes, self.seed = engine_id, cfg, modes, seed
        torch.manual_seed(seed + engine_id)
        self.engine: Rollout
        if RolloutBackend(cfg.engine) == RolloutBackend.vllm:
            from vime.rollout.vllm_engine import VllmRollout

            self.engine = VllmRollout(
                cfg, model_path, dtype, device, modes, seed + engine_id, engine_id, transport, truncation
            )
        else:
            from vime.rollout.reference import ReferenceRollout

            self.engine = ReferenceRollout(cfg, model_path, dtype, device)
        self._evidence: list[dict] = []
        # in-flight weight updates (rollout.partial): a version staged by `stage_weights` (the actor's
        # "weights" concurrency group) lands between two engine steps of a running `generate`
        self._cv = threading.Condition()
        self._staged: tuple[list, int] | None = None
        self._generating = False
        # vLLM on CPU over `gloo`: the push is received by the actor; with in-flight updates any engine's is
        # (into a staging buffer, landing as `stage_weights` does)
        self._group_receiver = None
        if str(transport) == "gloo" and (RolloutBackend(cfg.engine) == RolloutBackend.vllm or cfg.partial):
            from vime.weights.sync import GroupReceiver

            self._group_receiver = GroupReceiver(
                self.engine, model_path, dtype, stage=self.stage_weights if cfg.partial else None
            )

    @_engine_call
    def info(self) -> dict:
        return {
            "engine": self.engine_id,
            "label": self.engine.label,
            "vocab_size": self.engine.vocab_size,
            "version": self.engine.version,
            "modes": self.modes,
            "pid": os.getpid(),
        }

    @_engine_call
    def generate(
        self,
        groups: list[tuple[int, list[int]]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        step: int,
        wait_version: int = 0,
        with_evidence: bool = False,
    ) -> list[Sample] | tuple[list[Sample], list[dict]]:
        """`groups`: (group index, prompt ids); each prompt is sampled `group_size` times on this engine.
        `wait_version` (rollout.partial_wait): the version this rollout waits for in flight (0: none);
        `with_evidence`: also return this rollout's rl_kernel evidence (the asynchronous loop queues the
        next rollout before it asks, so a later `evidence()` would be the next one's)."""
        prompts = [ids for _, ids in groups for _ in range(group_size)]
        seed = (self.seed * 1_000_003 + step) * 4099 + self.engine_id
        self.engine.evidence(reset=True)
        if self.cfg.partial:
            outs = self._generate_partial(prompts, max_new_tokens, temperature, stop_token_ids, seed, wait_version)
        else:
            outs = self.engine.generate(prompts, max_new_tokens, temperature, stop_token_ids, seed)
        self._evidence = self.engine.evidence(reset=True)
        routes = getattr(self.engine, "last_routes", None) or [None] * len(outs)
        samples = []
        for (g, ids), (tokens, logprobs, versions), route in zip(
            [gp for gp in groups for _ in range(group_size)], outs, routes
        ):
            samples.append(
                Sample(
                    group=g,
                    prompt_ids=list(ids),
                    response_ids=list(tokens),
                    logprobs=list(logprobs),
                    versions=list(versions),
                    engine=self.engine_id,
                    temperature=temperature,
                    top_k=self.engine.top_k,
                    top_p=self.engine.top_p,
                    min_p=getattr(self.engine, "min_p", 0.0),
                    vocab_size=self.engine.vocab_size,
                    finish_reason="stop" if tokens and tokens[-1] in stop_token_ids else "length",
                    routes=route,
                )
            )
        return (samples, self._evidence) if with_evidence else samples

    def _generate_partial(self, prompts, max_new_tokens, temperature, stop_token_ids, seed, wait_version):
        """`generate` with in-flight weight updates: before every engine step a staged version is loaded
        (unless a prompt is half prefilled); with `rollout.partial_wait` = k and a `wait_version`, the
        rollout waits, once every request has k tokens, until that version is staged or served, and loads
        none before."""
        waited = not self.cfg.partial_wait or wait_version <= 0

        def between_steps(mid_prefill: bool, sampled: int) -> int:
            nonlocal waited
            with self._cv:
                if not waited and sampled >= self.cfg.partial_wait and not mid_prefill:

                    def arrived() -> bool:  # the version waited for: loaded, or staged to land here
                        staged = self._staged is not None and self._staged[1] >= wait_version
                        return self.engine.version >= wait_version or staged

                    if not self._cv.wait_for(arrived, timeout=600):
                        raise TimeoutError(
                            f"rollout engine {self.engine_id}: weight version {wait_version} did not "
                            "arrive within 600 s (rollout.partial_wait)"
                        )
                    waited = True
                # with rollout.partial_wait, not before the wait: the version lands at that token, however early it
                # arrives (the first version a rollout can receive is the one it waits for)
                if self._staged is not None and not mid_prefill and waited:
                    self._apply_staged()
                return self.engine.version

        with self._cv:
            self._generating = True
        try:
            return self.engine.generate(
                prompts, max_new_tokens, temperature, stop_token_ids, seed, between_steps=between_steps
            )
        finally:
            with self._cv:
                self._generating = False
                if self._staged is not None:  # arrived after the last engine step
                    self._apply_staged()

    def _apply_staged(self) -> None:
        """Load the staged version into the engine and serve it (the caller holds `_cv`)."""
        buckets, version = self._staged
        for bucket in buckets:
            self.engine.update_weights(bucket, version)
        self.engine.set_version(version)
        self._staged = None
        self._cv.notify_all()

    def stage_weights(self, buckets: list[dict[str, torch.Tensor]], version: int) -> int:
        """In-flight weight update (rollout.partial; runs in the actor's "weights" concurrency group, beside a
        running `generate`): the buckets of `version` land at the next step boundary of the running rollout,
        or now when none runs. Returns the version the engine serves once they are in."""
        with self._cv:
            if self._staged is not None:
                raise RuntimeError(f"weight version {version} staged while version {self._staged[1]} is not loaded")
            self._staged = (buckets, version)
            self._cv.notify_all()  # a rollout waiting for this version (rollout.partial_wait)
            if not self._generating:
                self._apply_staged()
            elif not self._cv.wait_for(lambda: self._staged is None, timeout=600):
                raise TimeoutError(
                    f"rollout engine {self.engine_id}: weight version {version} did not land within 600 s"
                )
            return self.engine.version

    @_engine_call
    def set_modes(self, modes: dict[str, str]) -> dict[str, str]:
        """Switch this engine's per-boundary rl_kernel modes (operator ablation, `vime.audit`)."""
        apply_modes(modes)
        self.engine.set_modes(modes)
        self.modes = dict(modes)
        return self.modes

    @_engine_call
    def rescore(self, samples: list[Sample]) -> list[list[float]]:
        """The engine's fp32 logprobs of each sample's fixed response tokens (forced decoding), under
        the current modes; the rl_kernel evidence of this pass replaces that of the last rollout."""
        self.engine.evidence(reset=True)
        out = self.engine.rescore(
            [s.prompt_ids for s in samples], [s.response_ids for s in samples], one_temperature(samples)
        )
        self._evidence = self.engine.evidence(reset=True)
        return out

    def evidence(self) -> list[dict]:
        """rl_kernel evidence of the last `generate` or `rescore` (engine workers included)."""
        return self._evidence

    @_engine_call
    def load_weights(self, bucket: dict[str, torch.Tensor], version: int) -> int:
        """Load one bucket of HF-named full tensors of weight version `version`; returns how many tensors."""
        self.engine.update_weights(bucket, version)
        return len(bucket)

    @_engine_call
    def load_buckets(self, buckets: list[dict[str, torch.Tensor]], version: int) -> int:
        """`load_weights` of every bucket in order (Ray resolves the driver's object reference here, from
        the store); returns how many tensors."""
        return sum(self.load_weights(b, version) for b in buckets)

    @_engine_call
    def join_weight_group(self, host: str, port: int, rank: int, world: int) -> None:
        """Join the trainer's NCCL weight-push group (rank `rank` of `world`, store at host:port; gloo on CPU)."""
        if self._group_receiver is not None:
            return self._group_receiver.join(host, port, rank, world)
        from vime.cluster import placement

        placement.bind_node_interface()
        self.engine.join_weight_group(host, port, rank, world)

    @_engine_call
    def receive_weights(self, msg: dict) -> dict | int | None:
        """One control message of an `ipc` / `nccl` weight push; returns the acknowledgement after `finish` (a
        vLLM engine on `nccl`: also its transfer-group ranks, asked with `ranks`)."""
        if self._group_receiver is not None:
            return self._group_receiver.handle(msg)
        return self.engine.receive_weights(msg)

    @_engine_call
    def set_version(self, version: int) -> int:
        """All buckets of `version` are in: serve it from now on. Returns the version the engine reports."""
        return self.engine.set_version(version)

    @_engine_call
    def sleep(self) -> None:
        """Release the GPU while the trainer works (vLLM's sleep mode, `rollout.sleep_level`)."""
        self.engine.sleep()

    @_engine_call
    def wake_up(self) -> None:
        """Take the GPU back before the weight push."""
        self.engine.wake_up()

    def shutdown(self) -> None:
        self.engine.shutdown()
