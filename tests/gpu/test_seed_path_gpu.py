"""The seed layout's device path on one GPU (issue 35, tests/gpu/seed_path_gpu.py), and that script on CPU.

On a GPU (marked gpu, skipped without CUDA): the script's three jobs (two NCCL ranks on one GPU, refused and
recorded; the strict TP reduction over every transport two ranks of one GPU allow; two trainer ranks pushing
over CUDA IPC into one strict vLLM engine, then logprob parity) must all pass. On CPU: the script's gloo
fallback runs the same strict reduction kernel sequence on two CPU ranks, bit for bit with its single-process
rank-order sum, with native twins that differ; and its argument errors are one line naming the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "seed_path_gpu.py"


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.slow
def test_cpu_fallback_runs_the_strict_reduction_over_gloo_bit_for_bit(tmp_path):
    out = tmp_path / "seed.json"
    proc = _run("--json", str(out), "--device", "cpu", "--parts", "tp,push")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["pass"] and report["failures"] == []
    assert set(report["skipped"]) == {"tp_nccl", "push"}  # they need a GPU: recorded, not run
    routes = report["jobs"]["tp_gloo"]["verdict"]
    assert set(routes) == {"torch.distributed", "device_gather", "cpu_staged"}
    for route, got in routes.items():
        assert len(got["checks"]) == 6 and all(v == 0 for v in got["checks"].values()), (route, got)
        assert len(got["twins"]) == 2 and all(v > 0 for v in got["twins"].values()), (route, got)
    assert routes["device_gather"]["gathers_run"]["device"] > 0  # the registered gather is what ran
    assert routes["torch.distributed"]["gathers_run"]["device"] == 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--json", "x.json", "--parts", "tp,nope"], "--parts: ['nope'] is not among ['tp', 'push']"),
        (["--parts", "tp"], "--json PATH is required"),
        (["--json", "x.json", "--budget-s", "0"], "--budget-s must be positive"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        _script().parse(args)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    import seed_path_gpu

    return seed_path_gpu


def _tp_rank(rank: int, route_results: dict, steps=("init", "done")) -> dict:
    return {"rank": rank, "exit": 0, "steps": [{"step": s} for s in steps], "routes": route_results}


def _route(check: int = 0, twin: int = 5, digest: str = "d") -> dict:
    return {
        "checks": {"strict c": check},
        "twins": {"native t": twin},
        "reported": {},
        "digests": {"strict c": digest},
        "gathers_run": {},
    }


def test_judge_tp_fails_on_a_mismatch_a_silent_twin_or_ranks_that_disagree():
    judge = _script().judge_tp
    job = dict(name="tp_gloo", timed_out=False, limit_s=80)
    ok = [_tp_rank(r, {"cpu_staged": _route()}) for r in range(2)]
    assert judge({**job, "ranks": ok})[1] == []
    bad = [_tp_rank(r, {"cpu_staged": _route(check=r)}) for r in range(2)]
    assert judge({**job, "ranks": bad})[1] == ["cpu_staged: strict c: 1 mismatches"]
    silent = [_tp_rank(r, {"cpu_staged": _route(twin=0)}) for r in range(2)]
    assert "twin native t: 0 mismatches" in judge({**job, "ranks": silent})[1][0]
    apart = [_tp_rank(r, {"cpu_staged": _route(digest=str(r))}) for r in range(2)]
    assert judge({**job, "ranks": apart})[1] == ["cpu_staged: strict c: same bytes on every rank: 1 mismatches"]


def test_judge_tp_records_a_transport_refusal_only_where_the_staged_route_passed():
    judge = _script().judge_tp
    job = dict(name="tp_gloo", timed_out=False, limit_s=80)
    refused = {"error": "RuntimeError: no CUDA support"}
    ranks = [_tp_rank(r, {"torch.distributed": refused, "cpu_staged": _route()}) for r in range(2)]
    routes, failures = judge({**job, "ranks": ranks})
    assert failures == [] and routes["torch.distributed"] == {"refused": ["RuntimeError: no CUDA support"]}
    ranks = [_tp_rank(r, {"torch.distributed": refused, "cpu_staged": _route(check=1)}) for r in range(2)]
    assert len(judge({**job, "ranks": ranks})[1]) == 2  # the staged route failed: the error counts too


def test_judge_tp_nccl_refusal_and_hang_are_outcomes_a_late_rank_is_not():
    judge = _script().judge_tp
    refusal = [
        {"rank": r, "exit": 0, "refused": "DistBackendError: Duplicate GPU detected", "steps": []} for r in (0, 1)
    ]
    assert judge(dict(name="tp_nccl", timed_out=False, limit_s=40, ranks=refusal)) == (
        {"refused": ["DistBackendError: Duplicate GPU detected"]},
        [],
    )
    hung = [{"rank": r, "exit": -9, "steps": []} for r in (0, 1)]
    routes, failures = judge(dict(name="tp_nccl", timed_out=True, limit_s=40, ranks=hung))
    assert failures == [] and "did not form within 40 s" in routes["refused"][0]
    late = [_tp_rank(0, {}, steps=("init",)), _tp_rank(1, {}, steps=("init",))]
    assert judge(dict(name="tp_gloo", timed_out=True, limit_s=80, ranks=late))[1] == ["worker did not finish"]


def test_judge_push_needs_every_check_and_the_twin():
    judge = _script().judge_push
    lead = {"exit": 0, "copy_digest": "a", "checks": {"parity": 0}, "twins": {"changed": 3}, "steps": []}
    job = dict(timed_out=False, ranks=[lead, {"exit": 0, "copy_digest": "a"}])
    assert judge(job)[1] == []
    assert judge({**job, "ranks": [{**lead, "checks": {"parity": 2}}, job["ranks"][1]]})[1] == ["push: parity: 2"]
    assert judge({**job, "ranks": [{**lead, "twins": {"changed": 0}}, job["ranks"][1]]})[1] == [
        "push: twin changed: 0 mismatches"
    ]
    assert judge({**job, "ranks": [lead, {"exit": 0, "copy_digest": "b"}]})[1] == [
        "push: the two ranks packed different copies"
    ]
    assert judge({**job, "timed_out": True})[1] == ["push: timed out"]


def _one_gpu_rank(rank: int, port: int, out: str) -> None:
    """A trainer rank of two on one GPU, on CPU: both ranks' handles carry the same (stand-in) GPU uuid."""
    import ray
    import torch.distributed as dist

    import rl_kernel.weights.transfer as wt
    from rl_kernel.weights.transfer import WeightReceiver
    from vime.weights.sync import EnginePush

    script = _script()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    wt.ipc_handles = lambda buf: {"GPU-one": (dist.get_rank(), buf.clone())}
    got, opened = {}, []

    class OneGPUReceiver(WeightReceiver):
        def _fetch(self, msg: dict, nbytes: int) -> torch.Tensor:
            owner, buf = msg["ipc_handle"]["GPU-one"]
            opened.append(owner)
            return buf

    load = lambda pairs: got.update({n: t.clone() for n, t in pairs})  # noqa: E731
    engines = [script.InProcessEngine(OneGPUReceiver(load, torch.device("cpu")))] if rank == 0 else []
    ray.get = script.get
    log = script.Log(f"{out}.{rank}", rank=rank)
    script.watched_merge(log)
    weights = {f"w{i}": torch.full((16, 8), float(i)).to(torch.bfloat16) for i in range(4)}
    log.data["ack"] = EnginePush(torch.device("cpu")).push(
        engines, weights, 1, "ipc", bucket_bytes=600, every_rank=True
    )
    log.data["opened"], log.data["got"] = opened, sorted(got)
    log.flush()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_of_one_gpu_merge_to_one_handle_the_last_ranks(tmp_path):
    """What the H200 push relies on, on CPU: the handle merge of `every_rank` keys by GPU uuid, so two ranks of one
    GPU give one handle per bucket, the last rank's; the engine opens that copy and both ranks get the ack."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_one_gpu_rank, args=(port, str(tmp_path / "r")), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"r.{r}").read_text()) for r in range(2)]
    ack = ranks[0]["ack"]
    assert ack["version"] == 1 and ack["tensors"] == 4 and ack["buckets"] == 2 and ranks[1]["ack"] == ack
    assert ranks[0]["opened"] == [1, 1] and ranks[0]["got"] == ["w0", "w1", "w2", "w3"]
    for merge in ranks[0]["merges"]:
        assert merge == {"rank_uuids": [["GPU-one"], ["GPU-one"]], "merged_uuids": ["GPU-one"]}


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
def test_seed_path_on_one_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "seed_path.json"
    proc = _run("--json", str(out), "--device", "cuda", timeout=200)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["pass"], report["failures"]
    assert set(report["jobs"]) == {"tp_nccl", "tp_gloo", "push"}
