"""Bad input and failures give clear errors that say what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from vime.config import preflight
from vime.config.schema import TrainerConfig, VimeConfig, to_object, validate
from vime.errors import ConfigError, DataError, EngineDiedError, TrainingError, VimeError, WeightSyncError, one_line
from vime.loop.driver import call, make_model
from vime.state import checkpoint, rundir
from vime.trainer.grpo import LossConfig, TrainBatch
from vime.trainer.reference import ReferenceTrainer

REPO = Path(__file__).resolve().parents[2]


def _cli(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vime.train", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"WANDB_MODE": "offline"},
    )


@pytest.mark.slow
def test_cli_rejects_a_malformed_override(tmp_path):
    proc = _cli("rollout.mode=bogus", f"output_dir={tmp_path}")
    assert proc.returncode == 1
    assert "Invalid value 'bogus', expected one of [strict, native]" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("config error: rollout.mode=bogus: ")
    assert "HYDRA_FULL_ERROR" not in proc.stderr


@pytest.mark.slow  # a subprocess: what `python -m vime.train` imports before it answers a bad value
def test_a_bad_value_is_answered_before_torch_or_ray_is_imported(tmp_path):
    """A typo or a value of the wrong type is refused from the schema and Hydra alone: torch, Ray, vLLM and
    Megatron (seconds of imports) are never imported, so the answer comes in about a second."""
    for bad in ("stpes=3", "steps=abc", "+experiment=nope"):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "vime.train", bad, f"output_dir={tmp_path / 'o'}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ | {"WANDB_MODE": "offline"},
        )
        seconds = time.perf_counter() - t0
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        said = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("import time:")]
        assert proc.returncode == 1 and len(said) == 1 and said[0].startswith("config error: "), said
        assert not {"torch", "ray", "vllm", "megatron.core"} & imported, (bad, seconds)
        print(f"{bad}: {seconds:.1f} s, {len(imported)} modules")


@pytest.mark.slow
def test_cli_reports_a_missing_checkpoint(tmp_path):
    proc = _cli(f"model.path={tmp_path / 'nope'}", f"output_dir={tmp_path}")
    assert proc.returncode != 0
    assert "is not an HF checkpoint directory (no config.json)" in proc.stdout + proc.stderr


def test_missing_checkpoint_error(tmp_path):
    cfg = VimeConfig()
    cfg.model.path = str(tmp_path)
    with pytest.raises(VimeError, match="no config.json.*leave model.path unset"):
        make_model(cfg, tmp_path)


@ray.remote(num_cpus=0)
class _Flaky:
    def die(self) -> None:
        os._exit(1)

    def bad_value(self) -> None:
        raise ValueError("prompt ids out of range")

    def refuse(self) -> None:
        raise WeightSyncError("weight version 3 is not above the served version 3")

    def relay(self, other) -> None:  # a trainer rank waiting on an engine's reply, as weight pushes do
        ray.get(other.refuse.remote())


@pytest.mark.slow
def test_a_dead_or_failing_actor_is_named():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        a, b = _Flaky.remote(), _Flaky.remote()
        with pytest.raises(EngineDiedError, match="rollout engine 1 died during 'generate'"):
            call([b.die.remote()], "generate", ["rollout engine 1"])
        with pytest.raises(ValueError, match=r"rollout engine 0 \(generate\): prompt ids out of range"):
            call([a.bad_value.remote()], "generate", ["rollout engine 0"])
        with pytest.raises(WeightSyncError) as raised:  # an engine's refusal through another actor: still one line
            call([a.relay.remote(_Flaky.remote())], "sync", ["trainer rank 0"])
        assert type(raised.value) is WeightSyncError
        assert str(raised.value) == "trainer rank 0 (sync): weight version 3 is not above the served version 3"
    finally:
        ray.shutdown()


def test_non_finite_loss_is_a_training_error(tiny_qwen3_path):
    trainer = ReferenceTrainer(TrainerConfig(lr=1e-3), str(tiny_qwen3_path), "bfloat16", "cpu", LossConfig())
    seqs, plens = [[10, 11, 12, 13, 14], [10, 11, 12, 20]], [3, 3]
    old, _ = trainer.score(seqs, plens, 1.0)
    with pytest.raises(TrainingError, match="non-finite loss"):
        trainer.train_step(TrainBatch(seqs, plens, [float("nan"), 1.0], old))
    stats = trainer.train_step(TrainBatch(seqs, plens, [1.0, -1.0], old))
    assert stats["grad_norm"] > 0 and stats["ratio_mean"] == 1.0  # old == current logprobs: ratio exactly 1
    new, _ = trainer.score(seqs, plens, 1.0)
    assert not torch.equal(torch.cat(new), torch.cat(old))  # the step moved the weights


# ---- one line for every bad input (issue 40): Hydra's own errors, the run dir, W&B, the device, the checkpoint --


from rl_kernel.modes import BOUNDARIES  # noqa: E402

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "configs" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize(
    "override, line",
    [
        ("steps=abc", "config error: steps=abc: Value 'abc' of type 'str' could not be converted to Integer; give "
         "steps a value of its type (its default: steps=3)"),
        ("trainer.lr=fast", "config error: trainer.lr=fast: Value 'fast' of type 'str' could not be converted to "
         "Float; give trainer.lr a value of its type (its default: trainer.lr=0.0001)"),
        ("algo.group_size=2.5", "config error: algo.group_size=2.5: Value '2.5' of type 'float' could not be "
         "converted to Integer; give algo.group_size a value of its type (its default: algo.group_size=4)"),
        ("rollout.mode=fast", "config error: rollout.mode=fast: Invalid value 'fast', expected one of [strict, "
         "native]; give rollout.mode a value of its type (its default: rollout.mode=strict)"),
        ("rollout.boundary_modes.attention=fast", "config error: rollout.boundary_modes.attention=fast: Invalid "
         "value 'fast', expected one of [strict, native]"),
        ("rollout.boundary_modes.atention=native", "config error: rollout.boundary_modes.atention=native: "
         f"'atention' is no boundary; use one of {', '.join(BOUNDARIES)}"),
        ("rollout.boundary_modes.attention=native", "config error: rollout.boundary_modes.attention=native: "
         "rollout.boundary_modes starts empty, so a name is added with +; write "
         "+rollout.boundary_modes.attention=native"),
        ("+experiment=does_not_exist", "config error: +experiment=does_not_exist: no preset 'does_not_exist' in "
         f"configs/experiment/; use one of: {', '.join(PRESETS)}"),
    ],
)  # fmt: skip
def test_hydras_own_errors_are_one_line(override, line):
    with pytest.raises(SystemExit) as exit_:
        rundir.compose_or_exit([override, "output_dir=/tmp/never_made"])
    assert str(exit_.value.code) == line


def test_a_good_command_line_composes_and_hydra_flags_are_left_to_hydra():
    rundir.compose_or_exit(["steps=2", "+rollout.boundary_modes.attention=native", "hydra.run.dir=/tmp/x"])
    rundir.compose_or_exit(["--cfg", "job", "steps=abc"])  # Hydra's own flags: Hydra answers


def test_unusable_output_dirs_are_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=rf"output_dir={tmp_path}/a_file/run: {tmp_path}/a_file is a file, not a"):
        rundir.check_writable(tmp_path / "a_file" / "run")
    rundir.check_writable(tmp_path / "new" / "run")  # made later by Hydra: its nearest existing parent is writable
    assert not (tmp_path / "new").exists()  # the check leaves nothing behind


def test_a_read_only_output_dir_is_one_line():
    """/sys refuses new files even to root (mode bits do not: root writes in a chmod 555 dir)."""
    import tempfile

    try:
        tempfile.TemporaryFile(dir="/sys").close()
        pytest.skip("/sys is writable here")
    except OSError:
        pass
    with pytest.raises(ConfigError, match=r"output_dir=/sys/run: cannot write in /sys \(.+\); pass an output_dir"):
        rundir.check_writable(Path("/sys/run"))


def test_wandb_online_without_key_or_server_is_refused_before_ray(monkeypatch, tmp_path, compose_cfg):
    cfg = validate(to_object(compose_cfg("wandb.mode=online")))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(ConfigError, match=r"wandb.mode=online: no W&B API key .*; use wandb.mode=offline"):
        preflight.check_wandb(cfg)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens there
    with pytest.raises(ConfigError, match=r"wandb.mode=online: cannot reach 127.0.0.1:9 .*; use wandb.mode=offline"):
        preflight.check_wandb(cfg)
    preflight.check_wandb(validate(to_object(compose_cfg())))  # offline: nothing to check


def test_cuda_without_cuda_is_one_line(compose_cfg):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match=r"device=cuda, but torch .* sees no CUDA device .*; use device=cpu"):
        preflight.check_device(validate(to_object(compose_cfg("device=cuda"))))


def test_cuda_without_cuda_is_named_before_the_gpu_count(monkeypatch):
    """The run-dir guard's checks in their order: device=cuda on a machine without CUDA says so (use device=cpu),
    not that the layout needs GPUs the machine lacks (true too, but it sends the user to ray.num_gpus)."""
    from hydra import compose, initialize_config_dir

    from vime.config.schema import register_configs

    register_configs()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        job = compose("config", ["device=cuda"], return_hydra_config=True)
    with pytest.raises(ConfigError, match=r"^device=cuda, but torch .* sees no CUDA device .*; use device=cpu$"):
        rundir.check(job)


def test_a_model_path_without_config_json_is_refused_by_the_guard(tmp_path):
    """model.path naming no HF checkpoint is answered by the run-dir guard (before the heavy imports: ~4 s, not
    the ~11 s the driver took to say the same)."""
    from hydra import compose, initialize_config_dir

    from vime.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        job = compose("config", [f"model.path={tmp_path / 'nope'}"], return_hydra_config=True)
    with pytest.raises(DataError, match=rf"^model.path={tmp_path / 'nope'} is not an HF checkpoint directory"):
        rundir.check(job)


@pytest.mark.parametrize(
    "override, error, line",
    [
        ("data.path={tmp}/none.jsonl", DataError, r"^data.path=.*/none.jsonl: no such file or directory"),
        ("eval.path={tmp}/none.jsonl", DataError, r"^eval.path=.*/none.jsonl: no such file or directory"),
        ("reward.fn=no_such_pkg.rewards:score", ConfigError, r"^reward.fn='no_such_pkg.rewards:score': cannot import"),
        ("compare={tmp}", ConfigError, r"^compare=.*: no metrics.jsonl there; pass compare=native"),
    ],
)  # fmt: skip
def test_the_runs_inputs_are_checked_by_the_guard(tmp_path, override, error, line):
    """Files and functions the run reads besides the model are named by the run-dir guard, before the tiny
    model is made (the console said 'made a tiny Qwen3 checkpoint' first) and before the heavy imports."""
    from hydra import compose, initialize_config_dir

    from vime.config.schema import register_configs

    register_configs()
    overrides = [override.format(tmp=tmp_path), "reward.fn=exact"] if "reward" not in override else [override]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        job = compose("config", overrides, return_hydra_config=True)
    with pytest.raises(error, match=line):
        rundir.check(job)


def test_new_tokens_beyond_the_context_are_refused_from_the_config(compose_cfg):
    with pytest.raises(ConfigError, match=r"algo.max_new_tokens=300 >= rollout.max_model_len=256: no room"):
        preflight.check_new_tokens(validate(to_object(compose_cfg("algo.max_new_tokens=300"))))
    preflight.check_new_tokens(validate(to_object(compose_cfg())))


def test_a_config_json_that_does_not_describe_its_weights_is_refused(tmp_path):
    from rl_kernel.models.tiny import make_tiny_qwen3

    model = Path(make_tiny_qwen3(tmp_path / "m", seed=0, vocab_size=128, hidden_size=64, intermediate_size=128))
    preflight.check_checkpoint(model)
    config = json.loads((model / "config.json").read_text())
    weights = next(model.glob("*.safetensors"))
    (model / "config.json").write_text(json.dumps(config | {"vocab_size": 256}))
    with pytest.raises(
        DataError,
        match=rf"{weights}: (model.embed_tokens|lm_head).weight has shape \[128, 64\], but "
        rf"{model / 'config.json'} gives it \[256, 64\] \(vocab_size=256, hidden_size=64\)",
    ):
        preflight.check_checkpoint(model)
    (model / "config.json").write_text(json.dumps(config | {"num_hidden_layers": config["num_hidden_layers"] + 1}))
    with pytest.raises(DataError, match=r"lack 11 tensor\(s\) that config.json's Qwen3 needs"):
        preflight.check_checkpoint(model)


def _reference_checkpoint(tmp_path: Path, model: Path) -> Path:
    """A real checkpoint dir as a resume reads it: the reference trainer's state, rank 0's RNG, the driver state."""
    trainer = ReferenceTrainer(TrainerConfig(), str(model), "bfloat16", "cpu", LossConfig())
    path = checkpoint.step_dir(tmp_path, 0)
    (path / "trainer").mkdir(parents=True)
    trainer.save(path / "trainer")
    checkpoint.save_rank_rng(path, 0)
    torch.save({"next_step": 1, "version": 1, "rows": []}, path / checkpoint.STATE)
    return path


def test_every_file_a_resume_reads_is_checked(tmp_path, tiny_qwen3_path):
    path = _reference_checkpoint(tmp_path, tiny_qwen3_path)
    checkpoint.check_files(path)
    for name in ("trainer/reference_trainer.pt", "rng/rank0.pt"):
        file = path / name
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
        with pytest.raises(checkpoint.CheckpointError, match=rf"{file} is damaged or truncated .*; resume from an"):
            checkpoint.check_files(path)
        file.write_bytes(data)


def test_a_truncated_distributed_checkpoint_shard_is_named(tmp_path):
    """Megatron's torch_dist format is torch.distributed.checkpoint's: `.metadata` lists each shard's byte ranges."""
    import torch.distributed.checkpoint as dcp

    trainer = tmp_path / "step_000000" / "trainer"
    dcp.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, checkpoint_id=str(trainer), no_dist=True)
    checkpoint.check_files(trainer.parent)
    shard = next(trainer.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=rf"{shard} is truncated: it needs \d+ bytes, the file has"):
        checkpoint.check_files(trainer.parent)
    shard.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=rf"{shard} is missing"):
        checkpoint.check_files(trainer.parent)


def test_a_finished_runs_dir_suggests_the_command_that_works(tmp_path):
    """Reusing a complete run's output_dir: the suggestion has more steps (`resume=` alone is refused)."""
    checkpoint.save_config(tmp_path, {"steps": 3})
    path = checkpoint.step_dir(tmp_path, 2)
    path.mkdir(parents=True)
    torch.save({"next_step": 3, "version": 3, "rows": []}, path / checkpoint.STATE)
    (tmp_path / "checkpoints" / "latest").write_text(path.name)
    with pytest.raises(SystemExit, match=rf"config error: .*`.*python -m vime.train resume={tmp_path} steps=6`"):
        rundir.refuse_existing(tmp_path)
    torch.save({"next_step": 2, "version": 2, "rows": []}, path / checkpoint.STATE)  # stopped early: resume as is
    with pytest.raises(SystemExit, match=rf"`.*python -m vime.train resume={tmp_path}`"):
        rundir.refuse_existing(tmp_path)


def test_bad_input_and_failures_have_one_format_each():
    assert one_line(ConfigError("steps=0; set steps >= 1")) == "config error: steps=0; set steps >= 1"
    assert one_line(DataError("x")) == "config error: x"
    assert one_line(checkpoint.CheckpointError("y")) == "config error: y"
    assert one_line(TrainingError("non-finite loss")) == "TrainingError: non-finite loss"


def test_the_docs_commands_run_in_a_fresh_shell():
    """docs/*.md write commands as the README does, with the venv's interpreter (`python -m ...` fails with
    "No module named 'hydra'" in a shell where the venv is not active)."""
    import re

    bare = [
        f"{doc.name}:{n}"
        for doc in sorted((REPO / "docs").glob("*.md"))
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if re.search(r"(?<![/\w.])python -m ", line)
    ]
    assert not bare, f"write these as .venv/bin/python -m ...: {bare}"
