"""Issue 35 on one GPU: the seed layout's device path as far as one H200 allows.

    python tests/gpu/seed_path_gpu.py --json PATH [--device auto|cuda|cpu] [--parts tp,push] [--budget-s 80]

Three jobs run at once, each a pair of processes (this script with `--worker`) on the one device, each rank
writing what it saw (incrementally) to a JSON of its own; this process merges them into PATH:

tp_nccl  two ranks of one NCCL world on one GPU. NCCL refuses that ("Duplicate GPU detected"): the refusal is
         recorded with its message. Should NCCL ever accept, the tp checks below are run over it and judged.
tp_gloo  the strict TP reduction kernel sequence of the strict vLLM model's row-parallel layers (every rank's
         partials all-gathered in rank order, then `rl_kernel.ops.collective.tree_sum_ranks`: the strict
         rank-order sum), on CUDA tensors, over each transport that lets two ranks share a GPU:
           torch.distributed  gloo's `all_gather_into_tensor` on the CUDA tensors themselves;
           device_gather      a registered device gather (`use_gather`, the strict vLLM model's route) that
                              concatenates gloo's list all-gather of the CUDA tensors, as vLLM's
                              `GroupCoordinator.all_gather(t, dim=0)` gives it;
           cpu_staged         a registered gather that copies the partial to the host, all-gathers it over gloo
                              and copies the result back (what a CPU group costs, in one place).
         Checks (strict; mismatching elements, 0 required): `rk.all_reduce` (fp32 and bf16 partials) against the
         single-process rank-order sum of the same partials; `rk.row_parallel_linear` on K shards against the
         unsharded strict linear (TP invariance, canonical TP 2); the result's bytes equal on both ranks.
         Native twins (must differ, else the check proves nothing): the native row-parallel linear (`F.linear`
         on the shard, then the transport's all_reduce) against the unsharded native linear, and 4 partials
         summed sequentially against their rank-order tree. Reported, not judged: the native all_reduce
         against the tree (two ranks: one IEEE addition, commutative, so equal is expected).
push     two trainer ranks on the one GPU (a gloo world) each pack their full copy of new weights and push
         them with `vime.weights.sync.EnginePush.push(..., "ipc", every_rank=True)` (handles all-gathered over
         the trainer world) into one real strict vLLM engine (enforce_eager, tiny Qwen3: 2 layers, hidden 512)
         held by rank 0 (Ray's calls made in process). Recorded: what the handle merge allowed (both ranks'
         handles carry the one GPU's uuid: the merged dict keeps one, the last rank's), the acknowledgement,
         the version served, and logprob parity (fp32 bits) of the engine's sampled tokens against
         rl_kernel teacher forcing (`Qwen3Reference.sequence_logprobs`) before the push (checkpoint weights)
         and after it (the pushed weights); twin: the pushed weights change the logprobs.

On a machine without CUDA (`--device cpu`, the default there) tp_gloo runs on CPU tensors (cpu_staged is then a
host copy of a host tensor) and tp_nccl and push are recorded as skipped (they need a GPU). Exit status 0 when
every check that ran passed (a refusal is an outcome, not a failure), 1 otherwise (a failed check, a worker
error, a job past the budget), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rl_kernel.selftest.ranks import free_port  # noqa: E402
from tests.inprocess_ray import Method, get  # noqa: E402

WORLD = 2
PARTS = ("tp", "push")
ROUTES = ("torch.distributed", "device_gather", "cpu_staged")
TEMPERATURE = 0.8
# The shapes of the faults runs that have passed over IPC on the H200 (tests/gpu/test_vllm_train_gpu.py); every
# tensor a multiple of 256 bytes, as vLLM's packed IPC reader needs (no padding between tensors)
TINY = dict(
    vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128
)


# ---- shared helpers -----------------------------------------------------------------------------------------


def one_line(e: BaseException) -> str:
    """An exception as one line (type and the first 600 characters of its message)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:600]}"


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (to compare results across ranks without another collective)."""
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class Log:
    """One rank's record, rewritten to its file after every step (a killed job still shows how far it got)."""

    def __init__(self, path: str, **fields):
        self.path, self.data = path, {**fields, "steps": [], "checks": {}, "twins": {}, "reported": {}}

    def step(self, what: str, **fields) -> None:
        self.data["steps"].append({"step": what, "t_s": round(time.monotonic() - T0, 2), **fields})
        self.flush()

    def flush(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


T0 = time.monotonic()


def init_world(rank: int, port: int, backend: str, timeout_s: int, device_id=None) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(backend, rank=rank, world_size=WORLD, timeout=timedelta(seconds=timeout_s), **kwargs)


# ---- tp: the strict TP reduction kernel sequence -------------------------------------------------------------


def concat_gather(group):
    """vLLM's `GroupCoordinator.all_gather(t, dim=0)` as the strict model registers it, over gloo's list
    all-gather of the tensors where they are (CUDA tensors on the GPU)."""
    import torch.distributed as dist

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim=0)

    return gather


def staged_gather(group):
    """A gather through host memory: the partial copied to the CPU, gathered over gloo, copied back."""
    import torch.distributed as dist

    def gather(t: torch.Tensor) -> torch.Tensor:
        host = t.cpu()
        out = torch.empty(dist.get_world_size(group) * host.shape[0], *host.shape[1:], dtype=t.dtype)
        dist.all_gather_into_tensor(out, host, group=group)
        return out.to(t.device)

    return gather


def tp_checks(rank: int, group, dev: torch.device) -> tuple[dict, dict, dict, dict]:
    """(strict checks: mismatches, twins: mismatches, reported: mismatches, digests) of the strict TP reduction
    over `group` (same inputs on every rank, drawn from one seed)."""
    import rl_kernel as rk
    from rl_kernel.bits import bit_mismatches
    from rl_kernel.ops.collective import gather_ranks, tree_sum_ranks

    gen = torch.Generator(device=dev).manual_seed(0)
    checks, twins, reported, digests = {}, {}, {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        parts = (torch.randn(WORLD, 8192, generator=gen, device=dev) * 100).to(dtype)
        with rk.mode("strict"):
            got = rk.all_reduce(parts[rank], group)
        name = f"strict all_reduce {str(dtype)[6:]} == single-process rank-order sum"
        checks[name] = bit_mismatches(got, tree_sum_ranks(parts))
        digests[name] = digest(got)
        name = f"native all_reduce {str(dtype)[6:]} == rank-order sum (2 ranks: equal expected)"
        try:  # the transport's own all_reduce (gloo's, on CUDA tensors on a GPU): reported, not judged
            with rk.mode("native"):
                reported[name] = bit_mismatches(rk.all_reduce(parts[rank], group), tree_sum_ranks(parts))
        except Exception as e:  # noqa: BLE001 - recorded
            reported[name] = one_line(e)
    four = torch.randn(4, 8192, generator=gen, device=dev) * 100
    twins["sequential sum of 4 partials == their rank-order tree"] = bit_mismatches(
        ((four[0] + four[1]) + four[2]) + four[3], tree_sum_ranks(four)
    )
    m, n, k = 64, 256, 2048
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    kl = k // WORLD
    xs, ws = x[:, rank * kl : (rank + 1) * kl].contiguous(), w[:, rank * kl : (rank + 1) * kl].contiguous()
    with rk.mode("strict"):
        full, shard = rk.row_parallel_linear(x, w, None), rk.row_parallel_linear(xs, ws, group)
    name = f"strict row_parallel_linear TP2 == unsharded  M={m} N={n} K={k}"
    checks[name], digests[name] = bit_mismatches(shard, full), digest(shard)
    with rk.mode("native"):
        full = rk.row_parallel_linear(x, w, None)
        name = f"native row_parallel_linear TP2 == unsharded  M={m} N={n} K={k}"
        try:  # F.linear on the shard, then the transport's all_reduce
            twins[name] = bit_mismatches(rk.row_parallel_linear(xs, ws, group), full)
        except Exception as e:  # noqa: BLE001 - the transport refused its all_reduce: the same sum, gathered
            partials = gather_ranks(rk.row_parallel_linear(xs, ws, None), group)
            twins[f"{name} (partials gathered, summed in bf16: {one_line(e)[:120]})"] = bit_mismatches(
                partials[0] + partials[1], full
            )
    return checks, twins, reported, digests


def tp_worker(args: argparse.Namespace) -> None:
    """One rank of job tp_nccl or tp_gloo."""
    import torch.distributed as dist

    import rl_kernel as rk
    from rl_kernel.ops.collective import GATHERS_RUN, use_gather

    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    log = Log(args.out, rank=args.rank, job=args.worker, device=str(dev), routes={})
    backend = "nccl" if args.worker == "tp_nccl" else "gloo"
    try:  # NCCL: eager init (device_id) so that a refusal comes here, not in a later collective
        init_world(args.rank, args.port, backend, 30, device_id=dev if backend == "nccl" else None)
        if backend == "nccl":
            dist.barrier()
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        log.data["refused"] = one_line(e)
        log.step("init refused", backend=backend)
        hold(args.scratch, log)
        return
    log.step("init", backend=backend)
    rk.set_canonical_tp(WORLD)  # the row-parallel K groups of TP 2: then TP 2 equals TP 1 bit for bit
    log.data["backend"] = rk.get_backend()
    routes = {"nccl": None} if backend == "nccl" else {r: None for r in ROUTES}
    for route in routes:
        group = dist.new_group(list(range(WORLD)), backend=backend)
        makers = {"device_gather": concat_gather, "cpu_staged": staged_gather}
        if route in makers:
            use_gather(group, makers[route](group))
        before = dict(GATHERS_RUN)
        try:
            checks, twins, reported, digests = tp_checks(args.rank, group, dev)
            log.data["routes"][route] = {
                "checks": checks,
                "twins": twins,
                "reported": reported,
                "digests": digests,
                "gathers_run": {k: GATHERS_RUN[k] - before[k] for k in GATHERS_RUN},
            }
        except Exception as e:  # noqa: BLE001 - recorded; the ranks fail alike (same code, same transport)
            log.data["routes"][route] = {"error": one_line(e), "traceback": traceback.format_exc()[-3000:]}
        finally:
            use_gather(group, None)
        log.step(f"route {route}")
    log.step("done")
    hold(args.scratch, log)
    dist.destroy_process_group()


def hold(scratch: str, log: Log) -> None:
    """Keep this process (and its GPU memory) until the orchestrator writes `release`: vLLM measures the GPU's
    free memory while its engine starts, and memory that another process frees meanwhile fails that profiling
    ("other processes sharing the same container release GPU memory")."""
    while not os.path.exists(os.path.join(scratch, "release")):
        time.sleep(0.2)
    log.step("released")


# ---- push: two trainer ranks on one GPU, every_rank IPC into one vLLM engine ---------------------------------


class InProcessEngine:
    """The rollout actor's `receive_weights` on rank 0, over a real engine's `VllmIPCReceiver`."""

    def __init__(self, receiver):
        self.receive_weights = Method(receiver.handle)


def new_weights(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, every tensor scaled by its own factors (seed 7): the same bits on every rank."""
    from rl_kernel.models.qwen3 import load_hf_state_dict

    old = load_hf_state_dict(path)
    gen = torch.Generator(device="cuda").manual_seed(7)
    out = {}
    for name in sorted(old):
        t = old[name].to("cuda", torch.float32)
        out[name] = (t * (1 + 0.05 * torch.rand(t.shape, generator=gen, device="cuda"))).to(torch.bfloat16)
    return out


def prompts(n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(10, TINY["vocab_size"], (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def sample(llm, ps: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    from rl_kernel.integrations.vllm import strict_sampling_params

    params = [
        strict_sampling_params(temperature=TEMPERATURE, max_tokens=16, seed=i, ignore_eos=True) for i in range(len(ps))
    ]
    tokens, logprobs = [], []
    for out in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False):
        c = out.outputs[0]
        tokens.append(list(c.token_ids))
        logprobs.extend(step[t].logprob for step, t in zip(c.logprobs, c.token_ids))
    return tokens, torch.tensor(logprobs, dtype=torch.float32)


def teacher_forcing(reference, ps: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    seqs = [p + t for p, t in zip(ps, tokens)]
    return torch.cat(reference.sequence_logprobs(seqs, [len(p) for p in ps], TEMPERATURE)).float().cpu()


def watched_merge(log: Log):
    """vime's handle merge (`_all_gathered`), recording how many ranks' handles it saw and how many it kept."""
    import torch.distributed as dist

    from vime.weights import sync

    original = sync._all_gathered

    def merge(handles: dict) -> dict:
        keys: list = [None] * dist.get_world_size()
        dist.all_gather_object(keys, sorted(handles))
        merged = original(handles)
        log.data.setdefault("merges", []).append({"rank_uuids": keys, "merged_uuids": sorted(merged)})
        return merged

    sync._all_gathered = merge


def push_worker(args: argparse.Namespace) -> None:
    """One trainer rank of job push; rank 0 also holds the engine and the teacher-forcing reference."""
    import ray
    import torch.distributed as dist

    from rl_kernel.bits import bit_mismatches
    from vime.weights.sync import EnginePush

    torch.cuda.set_device(0)
    log = Log(args.out, rank=args.rank, job="push", device="cuda:0")
    init_world(args.rank, args.port, "gloo", 240)
    log.step("init")
    ckpt = os.path.join(args.scratch, "tiny_qwen3")
    llm = reference = None
    try:
        if args.rank == 0:
            from rl_kernel.models.tiny import make_tiny_qwen3

            make_tiny_qwen3(ckpt, device="cuda", init_std=0.02, **TINY)
            log.step("checkpoint", shape=TINY)
            llm = start_engine(ckpt, args.graphs)
            log.step("engine started", enforce_eager=not args.graphs)
        dist.barrier()  # rank 1 packs only once the engine holds its memory (vLLM sizes its cache at start)
        ps = prompts()
        if args.rank == 0:
            tokens0, logprobs0 = sample(llm, ps)
            log.step("sampled before push", tokens=sum(map(len, tokens0)))
        copy = new_weights(ckpt)
        log.data["copy_digest"] = digest(torch.cat([t.reshape(-1) for t in copy.values()]))
        log.step("packed own copy", tensors=len(copy), bytes=sum(t.numel() * t.element_size() for t in copy.values()))
        engines = []
        if args.rank == 0:
            from rl_kernel.integrations.vllm.ipc import VllmIPCReceiver
            from rl_kernel.models.qwen3 import read_config
            from rl_kernel.weights.transfer import expected_weights

            engines = [InProcessEngine(VllmIPCReceiver(llm, expected_weights(read_config(ckpt), "bfloat16")))]
        ray.get = get  # the engine answers in process (no Ray cluster in this script)
        watched_merge(log)
        ack = EnginePush(torch.device("cuda", 0)).push(engines, copy, 1, "ipc", bucket_bytes=1 << 20, every_rank=True)
        log.data["ack"] = ack
        log.step("pushed", buckets=ack.get("buckets"))
        if args.rank == 0:
            from rl_kernel.integrations.vllm.compat import get_weight_version
            from rl_kernel.models.qwen3 import Qwen3Reference

            log.data["served_version"] = int(get_weight_version(llm))
            tokens1, logprobs1 = sample(llm, ps)
            log.step("sampled after push", tokens=sum(map(len, tokens1)))
            reference = Qwen3Reference.from_pretrained(ckpt, device="cuda")
            log.data["checks"]["engine == teacher forcing, checkpoint weights (before push)"] = bit_mismatches(
                logprobs0, teacher_forcing(reference, ps, tokens0)
            )
            reference.load_hf_weights(copy)
            log.data["checks"]["engine == teacher forcing, pushed weights (after push)"] = bit_mismatches(
                logprobs1, teacher_forcing(reference, ps, tokens1)
            )
            log.data["checks"]["served weight version == 1"] = int(log.data["served_version"] != 1)
            n = min(logprobs0.numel(), logprobs1.numel())
            log.data["twins"]["logprobs after push == before push (the push changed the weights)"] = bit_mismatches(
                logprobs0[:n], logprobs1[:n]
            )
            log.data["tokens_compared"] = [int(logprobs0.numel()), int(logprobs1.numel())]
            log.step("teacher forcing")
        dist.barrier()
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
    log.step("done")


def start_engine(ckpt: str, graphs: bool):
    import vllm

    from rl_kernel.integrations.vllm import strict_llm_kwargs

    kwargs = dict(
        dtype="bfloat16",
        seed=0,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        block_size=16,
        gpu_memory_utilization=0.2,
    )
    if not graphs:
        kwargs["enforce_eager"] = True
    return vllm.LLM(**strict_llm_kwargs(ckpt, device="cuda", **kwargs))


# ---- the orchestrator ----------------------------------------------------------------------------------------


class Job:
    """A pair of worker processes (one per rank), each in a session of its own (so that its children, vLLM's
    engine core among them, are ended with it)."""

    def __init__(self, name: str, args: argparse.Namespace, scratch: str, limit_s: float):
        self.name, self.limit_s, self.start = name, limit_s, time.monotonic()
        port = free_port()
        self.outs = [os.path.join(scratch, f"{name}.{r}.json") for r in range(WORLD)]
        self.logs = [open(os.path.join(scratch, f"{name}.{r}.log"), "w") for r in range(WORLD)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", name, "--rank", str(r), "--port", str(port)]
                + ["--out", self.outs[r], "--scratch", scratch, "--device", args.device]
                + (["--graphs"] if args.graphs else []),
                stdout=self.logs[r],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for r in range(WORLD)
        ]
        self.timed_out = False
        self.failed_at: float | None = None

    def poll(self) -> bool:
        """Whether the job is over (both ranks exited, or ended here: past its limit, or a rank failed 10 s ago)."""
        codes = [p.poll() for p in self.procs]
        if all(c is not None for c in codes):
            return True
        now = time.monotonic()
        if any(c not in (None, 0) for c in codes) and self.failed_at is None:
            self.failed_at = now
        if now - self.start > self.limit_s or (self.failed_at is not None and now - self.failed_at > 10):
            self.timed_out = now - self.start > self.limit_s
            self.end()
            return True
        return False

    def end(self) -> None:
        import signal

        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the session this job started for this rank
                except ProcessLookupError:
                    pass
                p.wait()

    def result(self) -> dict:
        ranks = []
        for r, (p, out) in enumerate(zip(self.procs, self.outs)):
            self.logs[r].close()
            rec = json.load(open(out)) if os.path.exists(out) else {"rank": r}
            rec["exit"] = p.returncode
            if p.returncode != 0:
                with open(self.logs[r].name) as f:
                    rec["log_tail"] = f.read()[-4000:]
            ranks.append(rec)
        return {
            "name": self.name,
            "seconds": round(time.monotonic() - self.start, 1),
            "timed_out": self.timed_out,
            "limit_s": self.limit_s,
            "ranks": ranks,
        }


def judge_tp(job: dict) -> tuple[dict, list[str]]:
    """Per-route verdicts of a tp job merged over its ranks, and the failures."""
    ranks, failures = job["ranks"], []
    if any("refused" in r for r in ranks):
        return {"refused": sorted({r.get("refused", "") for r in ranks} - {""})}, []
    finished = all(any(s["step"] in ("done", "init refused") for s in r.get("steps", [])) for r in ranks)
    if finished:  # a rank ended here while holding (`hold`) had finished its work
        job = {**job, "timed_out": False, "ranks": [{**r, "exit": 0} for r in ranks]}
    reached_init = any(s["step"] == "init" for r in ranks for s in r.get("steps", []))
    if job["timed_out"] and job["name"] == "tp_nccl" and not reached_init:
        return {"refused": [f"no answer: the NCCL world did not form within {job['limit_s']:.0f} s (hung)"]}, []
    if job["timed_out"] or any(r["exit"] != 0 for r in ranks):
        return {"error": "timed out" if job["timed_out"] else "a rank failed (see ranks' log_tail)"}, [
            "worker did not finish"
        ]
    routes = {}
    for route in ranks[0].get("routes", {}):
        per = [r["routes"][route] for r in ranks]
        if any("error" in p for p in per):
            routes[route] = {"error": sorted({p.get("error", "") for p in per} - {""})}
            failures.append(f"{route}: {routes[route]['error']}")
            continue
        checks = {n: sum(p["checks"][n] for p in per) for n in per[0]["checks"]}
        checks.update(
            {f"{n}: same bytes on every rank": int(len({p["digests"][n] for p in per}) != 1) for n in per[0]["digests"]}
        )
        twins = {n: sum(p["twins"][n] for p in per) for n in per[0]["twins"]}
        reported = {n: sum(p["reported"][n] for p in per) for n in per[0]["reported"]}
        failures += [f"{route}: {n}: {v} mismatches" for n, v in checks.items() if v != 0]
        failures += [f"{route}: twin {n}: 0 mismatches (the check cannot fail)" for n, v in twins.items() if v == 0]
        routes[route] = {"checks": checks, "twins": twins, "reported": reported, "gathers_run": per[0]["gathers_run"]}
    staged = routes.get("cpu_staged", {})
    if "checks" in staged and not any(f.startswith("cpu_staged:") for f in failures):
        # the routes run the same strict code and differ only in the transport moving the partials: where the
        # staged one passed, another route's error is that transport's refusal (an outcome, not a failure)
        for route in [r for r, v in routes.items() if "error" in v]:
            routes[route] = {"refused": routes[route]["error"]}
            failures = [f for f in failures if not f.startswith(f"{route}:")]
    if not any("checks" in v for v in routes.values()):
        failures.append("no route ran its checks")
    return routes, failures


def judge_push(job: dict) -> tuple[dict, list[str]]:
    ranks = job["ranks"]
    lead = ranks[0]
    verdict = {
        k: lead.get(k)
        for k in ("checks", "twins", "ack", "served_version", "merges", "tokens_compared")
        if lead.get(k) is not None
    }
    verdict["copy_digests_equal"] = len({r.get("copy_digest") for r in ranks}) == 1
    verdict["steps"] = [[s["step"], s["t_s"]] for s in lead.get("steps", [])]
    if job["timed_out"] or any(r["exit"] != 0 for r in ranks):
        verdict["error"] = "timed out" if job["timed_out"] else "a rank failed (see ranks' log_tail)"
        return verdict, [f"push: {verdict['error']}"]
    failures = [f"push: {n}: {v}" for n, v in verdict.get("checks", {}).items() if v != 0]
    failures += [f"push: twin {n}: 0 mismatches" for n, v in verdict.get("twins", {}).items() if v == 0]
    if not verdict["copy_digests_equal"]:
        failures.append("push: the two ranks packed different copies")
    if not verdict.get("checks"):
        failures.append("push: no check ran")
    return verdict, failures


def engine_up(job: Job) -> bool:
    """Whether the push job's engine has started (or the job is over)."""
    try:
        steps = json.load(open(job.outs[0]))["steps"]
    except (OSError, ValueError, KeyError):
        steps = []
    return any(s["step"] == "engine started" for s in steps) or all(p.poll() is not None for p in job.procs)


def run_jobs(names: list[str], args: argparse.Namespace, scratch: str) -> dict[str, Job]:
    """Run the jobs side by side within the budget (counted from this process's start). The tp jobs' processes
    hold on (`hold`) until the push job's engine is up, then exit: no GPU memory is freed while vLLM profiles."""
    left = max(1.0, args.budget_s - (time.monotonic() - T0))
    import signal

    jobs = {n: Job(n, args, scratch, left) for n in names}
    release = os.path.join(scratch, "release")
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda sig, _: stop.append(sig))  # `timeout`: end the jobs, still report
    while True:
        if stop:
            for j in jobs.values():
                j.limit_s = 0.0
        if not os.path.exists(release) and ("push" not in jobs or engine_up(jobs["push"])):
            open(release, "w").close()
            if "tp_nccl" in jobs:  # a world that never forms (a hang, not a refusal) gets 40 s, counted from here
                nccl = jobs["tp_nccl"]
                nccl.limit_s = min(nccl.limit_s, max(40.0, time.monotonic() - nccl.start + 5))
        if all([j.poll() for j in jobs.values()]):
            return jobs
        time.sleep(0.2)


def orchestrate(args: argparse.Namespace) -> int:
    report: dict = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "torch": torch.__version__,
        "parts": args.parts,
        "budget_s": args.budget_s,
        "jobs": {},
        "skipped": {},
    }
    try:  # not imported here: the workers import it
        from importlib.metadata import version

        report["vllm"] = version("vllm")
    except Exception as e:  # noqa: BLE001 - recorded
        report["vllm"] = one_line(e)
    scratch = tempfile.mkdtemp(prefix="seed_path_")
    names = []
    if "tp" in args.parts:
        names.append("tp_gloo")
        if args.device == "cuda":
            names.append("tp_nccl")
        else:
            report["skipped"]["tp_nccl"] = "needs CUDA (two NCCL ranks on one GPU)"
    if "push" in args.parts:
        if args.device == "cuda":
            names.append("push")
        else:
            report["skipped"]["push"] = "needs CUDA (CUDA IPC handles into a vLLM engine on a GPU)"
    jobs = run_jobs(names, args, scratch)
    failures: list[str] = []
    for name, job in jobs.items():
        raw = job.result()
        verdict, bad = (judge_push if name == "push" else judge_tp)(raw)
        report["jobs"][name] = {
            "verdict": verdict,
            "seconds": raw["seconds"],
            "timed_out": raw["timed_out"],
            "raw": raw,
        }
        failures += [f"{name}: {b}" for b in bad]
    report["failures"] = failures
    report["pass"] = not failures
    report["seconds"] = round(time.monotonic() - T0, 1)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
    for name, job in report["jobs"].items():
        print(f"== {name} ({job['seconds']} s): {json.dumps(job['verdict'], default=str)[:2000]}")
    verdict = failures or "every check that ran passed"
    print(f"seed path {'PASS' if not failures else 'FAIL'} in {report['seconds']} s: {verdict}")
    return 0 if not failures else 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="where the merged record goes (required unless --worker)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--budget-s", type=float, default=80.0, help="wall-clock limit of the whole run (seconds)")
    p.add_argument("--graphs", action="store_true", help="the push's engine with CUDA graphs (default eager)")
    p.add_argument("--worker", choices=("tp_gloo", "tp_nccl", "push"), help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    parts = [s for s in args.parts.split(",") if s]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        p.error(f"--parts: {unknown or 'nothing'} is not among {list(PARTS)}; pass a comma-separated subset of them")
    args.parts = parts
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here; run on a GPU machine or pass --device cpu")
    if args.worker is None and not args.json:
        p.error("--json PATH is required: where the merged record goes")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive seconds, got {args.budget_s}")
    return args


# As scripts/gpu_vllm.sh sets them: never NVLink multicast; FlashInfer is not in the GPU bundle
ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the push's IPC handles reach vLLM's engine core as pickles
    "TOKENIZERS_PARALLELISM": "false",
}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if args.worker is None:
        return orchestrate(args)
    (push_worker if args.worker == "push" else tp_worker)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
