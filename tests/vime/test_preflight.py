"""Bad input without engines: config holes, unreadable checkpoints, output-dir safety, resume config
rules and the stop signal. Each bad input must give one line that names the value or file and the fix,
before any engine (or any directory) is made."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime.config import preflight
from vime.config.schema import as_dict, to_object, validate
from vime.errors import ConfigError, DataError
from vime.faults import stops
from vime.state import checkpoint, rundir

REPO = Path(__file__).resolve().parents[2]


def _cli(*overrides: str) -> subprocess.CompletedProcess:
    env = os.environ | {"WANDB_MODE": "offline"}
    return subprocess.run(
        [sys.executable, "-m", "vime.train", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_unknown_plus_key_under_a_group_is_rejected(compose_cfg):
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) trainer\.lrr"):
        to_object(compose_cfg("+trainer.lrr=0.1"))
    with pytest.raises(ConfigError, match=r"algo\.nope"):
        to_object(compose_cfg("+algo.nope=1"))
    cfg = to_object(compose_cfg("+rollout.boundary_modes.attention=native"))  # a dict field: free keys
    assert cfg.rollout.boundary_modes == {"attention": "native"}


@pytest.mark.slow
def test_unknown_key_on_the_command_line_leaves_no_directory(tmp_path):
    out = tmp_path / "run"
    proc = _cli("+trainer.lrr=0.1", f"output_dir={out}")
    assert proc.returncode == 1, proc.stderr
    assert "trainer.lrr" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_response_longer_than_max_model_len_is_rejected(compose_cfg):
    cfg = validate(to_object(compose_cfg("algo.max_new_tokens=10000")))
    with pytest.raises(
        ConfigError,
        match=r"max_new_tokens=10000 \+ the longest prompt \(12 tokens\) = 10012 > "
        r"rollout.max_model_len=256; lower algo.max_new_tokens to at most 244",
    ):
        preflight.check_lengths(cfg, [[1] * 5, [2] * 12])
    preflight.check_lengths(validate(to_object(compose_cfg("algo.max_new_tokens=244"))), [[2] * 12])


@pytest.mark.slow  # starts `python -m vime.train`
def test_a_context_longer_than_the_model_is_refused_before_any_directory(tmp_path, compose_cfg):
    out = tmp_path / "run"
    proc = _cli("rollout.max_model_len=8192", f"output_dir={out}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "config error: rollout.max_model_len=8192 > the model's context (max_position_embeddings=4096 in the tiny "
        "model vime makes (model.path unset)); set rollout.max_model_len <= 4096"
    )
    assert not out.exists()
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    with pytest.raises(ConfigError, match=rf"max_position_embeddings=512 in {model / 'config.json'}"):
        preflight.check_context(validate(to_object(compose_cfg(f"model.path={model}", "rollout.max_model_len=1024"))))
    preflight.check_context(validate(to_object(compose_cfg(f"model.path={model}", "rollout.max_model_len=512"))))


@pytest.mark.slow  # starts `python -m vime.train`
def test_a_mistyped_key_is_answered_in_one_line_with_the_nearest_key(tmp_path):
    proc = _cli("stpes=3", f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 1 and "+stpes" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "config error: unknown config key stpes (did you mean steps?); `python -m vime.train --cfg job` lists every "
        "key (vime/config/schema.py documents them)"
    ]
    keys, free = rundir.schema_keys()
    groups = rundir._config_groups()  # read from the repository's configs/
    assert {"experiment", "placement"} <= groups and "trainer.lr" in keys and "rollout.boundary_modes" in free
    for good in (
        "steps=3",
        "trainer.lr=0.1",
        "+rollout.boundary_modes.attention=native",
        "+experiment=qwen3_8b_grpo",
        "hydra.verbose=true",
        "hydra/job_logging=disabled",
        "--cfg",
        "resume=/x",
    ):
        assert rundir.unknown_override(good, keys, free, groups) is None, good
    assert "(did you mean trainer.lr?)" in rundir.unknown_override("trainer.lrr=1", keys, free, groups)
    assert "unknown config key algo.nope" in rundir.unknown_override("+algo.nope=1", keys, free, groups)


def test_ray_resources_are_checked_with_numbers(compose_cfg):
    cfg = validate(to_object(compose_cfg("ray.num_cpus=1")))
    with pytest.raises(ConfigError, match=r"needs 2 CPUs \(has 1\) for 2 actors .* ray.num_cpus=1"):
        preflight.check_local_resources(cfg)
    preflight.check_local_resources(validate(to_object(compose_cfg())))  # the default fits
    cfg = validate(to_object(compose_cfg("rollout.num_engines=2", "trainer.tp=2")))
    with pytest.raises(ConfigError, match=r"needs 4 CPUs \(has 3\) for 4 actors"):
        preflight.check_resources(cfg, {"CPU": 3.0}, "the cluster has 3")


def test_unsupported_architecture_and_truncated_weights_are_named(tmp_path):
    from rl_kernel.models.tiny import make_tiny_qwen3

    model = Path(make_tiny_qwen3(tmp_path / "m", seed=0))
    preflight.check_checkpoint(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps(config | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(DataError, match=rf"{model / 'config.json'}: model_type='llama'.*not supported.*Qwen3"):
        preflight.check_checkpoint(model)
    (model / "config.json").write_text(json.dumps(config))
    weights = next(model.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"{weights} is truncated: its tensors need {len(data)} bytes"):
        preflight.check_checkpoint(model)
    weights.write_bytes(data[:20])
    with pytest.raises(DataError, match=rf"{weights} is truncated: its header needs"):
        preflight.check_checkpoint(model)
    (model / "config.json").write_text("{")
    with pytest.raises(DataError, match=rf"cannot read {model / 'config.json'}"):
        preflight.check_checkpoint(model)


@pytest.mark.slow
def test_existing_run_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.log").write_text("the first run\n")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = _cli(f"output_dir={out}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"output_dir={out} already holds a run of 1 logged step(s) (metrics.jsonl, train.log)" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "train.log"]
    assert (out / "train.log").read_text() == "the first run\n"
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest").write_text("step_000000")
    with pytest.raises(SystemExit, match=rf"continue that run with `.*python -m vime.train resume={out}`"):
        rundir.refuse_existing(out)


def test_a_directory_vime_did_not_write_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "train.log").write_text("")
    with pytest.raises(SystemExit, match=r"holds files vime did not write \(notes.txt\)"):
        rundir.refuse_existing(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_start_that_failed_before_its_first_step_is_cleaned_for_the_retry(tmp_path, capsys):
    out = tmp_path / "run"
    for d in (".hydra", "model", "wandb/offline-run-1", "checkpoints"):
        (out / d).mkdir(parents=True)
    for f in ("train.log", "engines.log", "metrics.jsonl", ".hydra/config.yaml", "checkpoints/config.yaml"):
        (out / f).write_text("")
    rundir.refuse_existing(out)
    assert not any(out.iterdir())
    assert "held a start that never completed a step" in capsys.readouterr().err


@pytest.mark.slow  # starts `python -m vime.train`
@pytest.mark.extended
def test_the_retry_after_a_failed_start_runs_in_the_same_output_dir(tmp_path):
    """A bad model.path fails after Hydra made the run dir (.hydra/, train.log); the retry with the same
    output_dir is not refused: it gets as far as the first time (here: the same bad path)."""
    out = tmp_path / "run"
    first = _cli(f"model.path={tmp_path / 'nope'}", f"output_dir={out}")
    assert first.returncode == 1 and "no config.json" in first.stdout + first.stderr
    assert (out / "train.log").is_file()
    again = _cli(f"model.path={tmp_path / 'nope'}", f"output_dir={out}")
    assert again.returncode == 1 and "no config.json" in again.stdout + again.stderr, again.stderr
    assert "already holds a run" not in again.stderr and "held a start that never completed a step" in again.stderr


def test_resume_runs_the_recorded_config_and_refuses_changes(compose_cfg, tmp_path):
    from hydra import compose, initialize_config_dir

    from tests.vime.conftest import CONFIGS

    recorded = validate(to_object(compose_cfg("trainer.lr=0.5", "steps=4", f"output_dir={tmp_path}")))
    checkpoint.save_config(tmp_path, as_dict(recorded))
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"resume={tmp_path}", "steps=6"], return_hydra_config=True)
        rundir.prepare(cfg)
        assert cfg.trainer.lr == 0.5 and cfg.steps == 6 and cfg.output_dir == str(tmp_path)
        assert cfg.hydra.output_subdir.startswith(".hydra/resume-")
        cfg = compose(
            config_name="config", overrides=[f"resume={tmp_path}", "trainer.lr=0.1"], return_hydra_config=True
        )
        with pytest.raises(ConfigError, match=r"trainer.lr cannot be set"):
            rundir.prepare(cfg)
        cfg = compose(config_name="config", overrides=[f"resume={tmp_path / 'none'}"], return_hydra_config=True)
        with pytest.raises(checkpoint.CheckpointError, match=r"no .*config.yaml"):
            rundir.prepare(cfg)


def test_resume_of_a_complete_run_says_so_and_how_to_extend_it(compose_cfg, tmp_path):
    import torch
    from hydra import compose, initialize_config_dir

    from tests.vime.conftest import CONFIGS

    checkpoint.save_config(tmp_path, as_dict(validate(to_object(compose_cfg("steps=4", f"output_dir={tmp_path}")))))
    last = checkpoint.step_dir(tmp_path, 3)
    last.mkdir(parents=True)
    torch.save({"next_step": 4}, last / checkpoint.STATE)
    (tmp_path / "checkpoints" / "latest").write_text(last.name)
    (tmp_path / "hf_model").mkdir()
    (tmp_path / "hf_model" / "model.safetensors").write_bytes(b"")
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"resume={tmp_path}"], return_hydra_config=True)
        with pytest.raises(
            ConfigError,
            match=rf"resume={tmp_path}: that run is complete \(4 steps done, steps=4\); "
            rf"to train it further give more steps: .*python -m vime.train "
            rf"resume={tmp_path.resolve()} steps=8",
        ):
            rundir.prepare(cfg)
        rundir.prepare(
            compose(config_name="config", overrides=[f"resume={tmp_path}", "steps=6"], return_hydra_config=True)
        )
        (tmp_path / "hf_model" / "model.safetensors").unlink()  # stopped between the last checkpoint and the export
        rundir.prepare(compose(config_name="config", overrides=[f"resume={tmp_path}"], return_hydra_config=True))


def test_checkpoint_schedule():
    assert [s for s in range(5) if checkpoint.is_due(0, s, 5)] == [4]
    assert [s for s in range(5) if checkpoint.is_due(2, s, 5)] == [1, 3, 4]
    assert [s for s in range(5) if checkpoint.is_due(0, s, 5, final=False)] == []  # checkpoint.final=false
    assert [s for s in range(5) if checkpoint.is_due(2, s, 5, final=False)] == [1, 3]


def test_sigterm_and_sigint_become_stopped_with_their_exit_codes():
    before = {s: signal.getsignal(s) for s in stops.SIGNALS}
    try:
        for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
            stops.install_signal_handlers()
            with pytest.raises(stops.Stopped) as stop:
                os.kill(os.getpid(), signum)
                signal.sigtimedwait([], 0)  # give the handler a bytecode boundary
            assert stop.value.exit_code == code
            assert signal.getsignal(signum) is stops._exit_now  # a second signal ends the clean-up at once
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_stale_temporary_files_are_swept_and_live_ones_kept(tmp_path):
    stale, fresh, held = tmp_path / "vllm_dist_old", tmp_path / "vllm_dist_new", tmp_path / "vllm_dist_held"
    for p in (stale, fresh, held):
        p.write_text("x")
    os.utime(stale, (1, 1))
    os.utime(held, (1, 1))
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    orphan, live = tmp_path / f"vime_rdzv_{dead}_ab", tmp_path / f"vime_rdzv_{os.getpid()}_cd"
    orphan.write_text("")
    live.write_text("")
    # a killed run's own temporary directory (its actors' TMPDIR: pymp-*, W&B's and vLLM's files), and a live one's
    orphan_tmp, live_tmp = tmp_path / f"vime_tmp_{dead}", tmp_path / f"vime_tmp_{os.getpid()}"
    for d in (orphan_tmp / "pymp-x1", orphan_tmp / "tmpq1wandb-media", live_tmp / "pymp-y2"):
        d.mkdir(parents=True)
    (orphan_tmp / "vllm_dist_0123").write_text("")
    with held.open() as keep_open:
        removed = stops.sweep_stale(
            {str(tmp_path / "vllm_dist_*"): 120.0}, str(tmp_path / "vime_rdzv_*"), str(tmp_path / "vime_tmp_*")
        )
        assert keep_open.readable()
    assert sorted(removed) == sorted([str(stale), str(orphan), str(orphan_tmp)])
    assert not stale.exists() and fresh.exists() and held.exists() and live.exists()
    assert not orphan_tmp.exists() and (live_tmp / "pymp-y2").is_dir()


def test_vllm_on_gpus_takes_ipc_and_nccl(compose_cfg):
    # the seed's layout: 2 vLLM engines x TP4 colocated on the trainer's 8 GPUs, each rank shipping its GPU's handles
    preflight.check_weight_transport(
        validate(to_object(compose_cfg("+experiment=qwen3_8b_grpo", "model.path=/ckpt/Qwen3-8B")))
    )
    preflight.check_weight_transport(
        validate(to_object(compose_cfg("+experiment=h200_8b_layers", "rollout.engine=vllm")))
    )
    # 4 vLLM engines x TP2 on a second node, weights through vLLM's own nccl engine
    preflight.check_weight_transport(
        validate(to_object(compose_cfg("+experiment=qwen3_8b_grpo_tp2x4", "model.path=/ckpt/Qwen3-8B")))
    )
    preflight.check_weight_transport(
        validate(
            to_object(
                compose_cfg(
                    "+experiment=h200_8b_layers",
                    "rollout.engine=vllm",
                    "weights.transport=nccl",
                    "weights.colocate=false",
                )
            )
        )
    )
    with pytest.raises(
        ConfigError,
        match="rollout.engine=vllm with weights.transport=object_store on GPUs: a vLLM "
        "engine on CUDA takes weights only as a push of trainer rank 0",
    ):
        preflight.check_weight_transport(
            validate(
                to_object(
                    compose_cfg("+experiment=h200_8b_layers", "rollout.engine=vllm", "weights.transport=object_store")
                )
            )
        )
    preflight.check_weight_transport(validate(to_object(compose_cfg("+experiment=h200_8b_layers"))))
    preflight.check_weight_transport(validate(to_object(compose_cfg())))  # vLLM on CPU: the object store


def _fresh_stop_state(monkeypatch) -> None:
    for name, value in (("_received", []), ("_deferred", [False]), ("_late", [False]), ("_given_s", [0.0])):
        monkeypatch.setattr(stops, name, value)


def test_a_stop_during_the_steps_lets_the_step_finish(monkeypatch):
    """In `finishing_steps` a first signal is not raised: the loop sees `stop_requested` (and saves the step);
    a second one would exit at once (`_exit_now`)."""
    _fresh_stop_state(monkeypatch)
    before = {s: signal.getsignal(s) for s in (*stops.SIGNALS, signal.SIGALRM)}
    try:
        stops.install_signal_handlers()
        with stops.finishing_steps(30.0):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # a bytecode boundary: the handler has run, and raised nothing
            assert stops.stop_requested() and stops.stop_signal() == signal.SIGTERM
            assert signal.getsignal(signal.SIGTERM) is stops._exit_now
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the bound is cancelled with the steps
        assert stops.stop_note(None) == ""
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_a_step_that_does_not_finish_in_time_is_stopped_at_once(monkeypatch):
    _fresh_stop_state(monkeypatch)
    before = {s: signal.getsignal(s) for s in (*stops.SIGNALS, signal.SIGALRM)}
    try:
        stops.install_signal_handlers()
        with pytest.raises(stops.Stopped) as stop, stops.finishing_steps(0.2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # a step still running when the bound passes
        assert stop.value.exit_code == 130
        assert stops.stop_note(None) == (
            "; the step in progress did not finish within checkpoint.on_stop_s=0.2 s: not saved"
        )
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_without_on_stop_a_stop_is_immediate(monkeypatch):
    _fresh_stop_state(monkeypatch)
    before = {s: signal.getsignal(s) for s in stops.SIGNALS}
    try:
        stops.install_signal_handlers()
        with pytest.raises(stops.Stopped), stops.finishing_steps(None):
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0)
        assert not stops.stop_requested()
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.slow  # a child process
def test_a_second_stop_signal_exits_at_once():
    """A first Ctrl-C lets the step finish (30 s granted here); a second one ends the process at once, exit 130."""
    import subprocess
    import sys

    child = (
        "import os, signal, time\n"
        "from vime.faults import stops\n"
        "stops.install_signal_handlers()\n"
        "with stops.finishing_steps(30.0):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    signal.sigtimedwait([], 0)\n"
        "    assert stops.stop_requested()\n"
        "    print('first stop deferred', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(20)\n"
        "print('not stopped')\n"
    )
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert "first stop deferred" in done.stdout and "not stopped" not in done.stdout, done.stdout + done.stderr
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert "SIGINT again: exiting now" in done.stderr
    assert time.monotonic() - t0 < 15  # not the 20 s sleep, nor the 30 s granted to the step
