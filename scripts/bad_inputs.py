"""The bad-input table: every bad-input case of issue 40 run as a new user runs it, each in a fresh shell.

    .venv/bin/python scripts/bad_inputs.py                     # writes benchmarks/results/bad_inputs_cpu.md (+ .json)
    .venv/bin/python scripts/bad_inputs.py --only steps=abc    # the cases whose name contains a string
    .venv/bin/python scripts/bad_inputs.py --no-run            # without the cases that need a finished run

Each case is `.venv/bin/python -m vime.train <overrides>` under `env -i` (no venv activated, no W&B key, a HOME
of its own with no ~/.netrc; PYTHONPATH is this checkout, so that its code runs): exit code, wall seconds from
the start of the process, the console lines (stdout and stderr together, blank lines left out) and whether it
is refused in one `config error:` line. The cases that need a run's directory (an output_dir reused, a resume of
a complete run, a truncated checkpoint file) use one real run of the default config (`steps=2
checkpoint.every=1`, a few minutes on 2 cores), made once under --work and reused while its state says it is
complete; the command a complete run's refusal suggests (`resume=<dir> steps=4`) is then run on a copy of it
and must succeed. Exit 1 when a case is not as expected (or when the fixture run fails).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
OUT = REPO / "benchmarks" / "results" / "bad_inputs_cpu.md"


@dataclass
class Case:
    name: str  # what is wrong, as the issue names it
    overrides: list[str]
    needs_run: bool = False  # uses the finished run made under --work
    env: dict[str, str] = field(default_factory=dict)  # added to the fresh shell's environment
    expect_ok: bool = False  # not a bad input: the command vime suggested, which must run (exit 0)


@dataclass
class Result:
    name: str
    command: str
    exit_code: int
    seconds: float
    lines: int
    as_expected: bool  # a bad input: exit 1 and one `config error: ...` line; a suggested command: exit 0
    console: list[str]


def fresh_env(work: Path) -> dict[str, str]:
    """A fresh shell's environment: PATH without the venv, a HOME of its own (no ~/.netrc, no W&B key), this
    checkout on PYTHONPATH."""
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}


def cases(work: Path) -> list[Case]:
    """The issue's bad inputs. Paths are under `work` (made by `fixtures`)."""
    o = f"output_dir={work / 'out'}"
    return [
        Case("typo in a key (stpes=3)", ["stpes=3", o]),
        Case("type: steps=abc", ["steps=abc", o]),
        Case("type: trainer.lr=fast", ["trainer.lr=fast", o]),
        Case("type: algo.group_size=2.5", ["algo.group_size=2.5", o]),
        Case("enum: rollout.mode=fast", ["rollout.mode=fast", o]),
        Case("enum: +rollout.boundary_modes.attention=fast", ["+rollout.boundary_modes.attention=fast", o]),
        Case("boundary key without +", ["rollout.boundary_modes.attention=native", o]),
        Case("missing preset +experiment=does_not_exist", ["+experiment=does_not_exist", o]),
        Case("device=cuda without CUDA", ["device=cuda", o]),
        Case("read-only output_dir (/sys refuses writes even to root)", ["output_dir=/sys/vime_run"]),
        Case("output_dir whose parent is read-only", ["output_dir=/sys/vime_parent/run"]),
        Case("output_dir under a regular file", [f"output_dir={work / 'a_file' / 'run'}"]),
        Case("wandb.mode=online without API key", ["wandb.mode=online", o]),
        Case(
            "wandb.mode=online, a key but no server",
            ["wandb.mode=online", o],
            env={"WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"},  # the discard port: no server
        ),
        Case("config.json vocab_size=256, embedding of 128 rows", [f"model.path={work / 'vocab_model'}", o]),
        Case("algo.max_new_tokens beyond the context", ["algo.max_new_tokens=300", o]),
        Case("trainer CP beyond the CPUs", ["trainer.cp=8", o]),
        Case("ray.num_cpus=1", ["ray.num_cpus=1", o]),
        Case("model.path does not exist", [f"model.path={work / 'no_such_model'}", o]),
        Case("an override without =", ["steps", o]),
        Case("an unknown nested key (trainer.lrr)", ["trainer.lrr=0.1", o]),
        Case("steps=0", ["steps=0", o]),
        Case("algo.group_size=1 (no group to compare)", ["algo.group_size=1", o]),
        Case("rollout.tp=3 (does not divide the heads)", ["rollout.tp=3", o]),
        Case("data.path does not exist", [f"data.path={work / 'no_such.jsonl'}", "reward.fn=exact", o]),
        Case("reward.fn that does not import", ["reward.fn=no_such_pkg.rewards:score", o]),
        Case("compare= a dir without metrics.jsonl", [f"compare={work / 'a_dir'}", o]),
        Case("resume= a path that does not exist", [f"resume={work / 'no_such_run'}"]),
        Case("a finished run's output_dir reused", [f"output_dir={work / 'done'}"], needs_run=True),
        Case("resume= of a complete run", [f"resume={work / 'done'}"], needs_run=True),
        Case("resume= with a truncated trainer file", [f"resume={work / 'truncated'}", "steps=4"], needs_run=True),
        Case("resume= of a dir with no checkpoint", [f"resume={work / 'a_dir'}"]),
        Case(
            "the command the complete run's line suggests (on a copy of it)",
            [f"resume={work / 'extend'}", "steps=4"],
            needs_run=True,
            expect_ok=True,
        ),
    ]


def vime_train(overrides: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, float, list[str]]:
    """(exit code, seconds, non-blank console lines) of `python -m vime.train overrides` in env."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(PYTHON), "-m", "vime.train", *overrides],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
    )
    return proc.returncode, time.perf_counter() - t0, [line for line in proc.stdout.splitlines() if line.strip()]


def is_one_line(code: int, lines: list[str]) -> bool:
    """Exit 1 and a single `config error:` line (the logged form has an `HH:MM:SS ` prefix)."""
    return code == 1 and len(lines) == 1 and re.sub(r"^\d\d:\d\d:\d\d ", "", lines[0]).startswith("config error: ")


def _complete(run: Path) -> bool:
    latest = run / "checkpoints" / "latest"
    return latest.is_file() and (run / "hf_model").is_dir()


def make_run(work: Path, env: dict[str, str]) -> Path:
    """A finished default run (steps=2, a checkpoint after each step) under work/done, made once."""
    done = work / "done"
    if _complete(done):
        return done
    shutil.rmtree(done, ignore_errors=True)
    env = env | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    code, seconds, lines = vime_train(["steps=2", "checkpoint.every=1", f"output_dir={done}"], env, 1800)
    if code != 0 or not _complete(done):
        raise SystemExit(f"the fixture run failed (exit {code}, {seconds:.0f} s): " + " | ".join(lines[-5:]))
    print(f"fixture run: {done} ({seconds:.0f} s)", flush=True)
    return done


def truncate_a_trainer_file(done: Path, work: Path) -> Path:
    """A copy of the finished run whose last checkpoint has its largest trainer file cut to half its bytes."""
    copy = work / "truncated"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(done, copy, symlinks=True)
    step = copy / "checkpoints" / (copy / "checkpoints" / "latest").read_text().strip()
    file = max((f for f in (step / "trainer").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return copy


def fixtures(work: Path, env: dict[str, str], with_run: bool) -> None:
    """The files the cases point at: a regular file, an empty dir, a model whose config.json says vocab_size=256
    while its embedding has 128 rows, and (with_run) a finished run and a copy of it with a truncated file."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "a_file").write_text("")
    (work / "a_dir").mkdir(exist_ok=True)
    shutil.rmtree(work / "out", ignore_errors=True)
    model = work / "vocab_model"
    if not (model / "config.json").is_file():
        sys.path.insert(0, str(REPO))
        from rl_kernel.models.tiny import make_tiny_qwen3

        make_tiny_qwen3(model, vocab_size=128)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(config | {"vocab_size": 256}, indent=2))
    if with_run:
        done = make_run(work, env)
        truncate_a_trainer_file(done, work)
        shutil.rmtree(work / "extend", ignore_errors=True)
        shutil.copytree(done, work / "extend", symlinks=True)


def table(results: list[Result], header: list[str]) -> str:
    """The markdown report: a header, one row per case, then each case's console as printed."""
    bad = [r for r in results if not r.name.startswith("the command")]
    ok = sum(r.as_expected for r in bad)
    rows = [
        "| case | command | exit | seconds | lines | as expected |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r.name} | `{r.command}` | {r.exit_code} | {r.seconds:.1f} | {r.lines} "
            f"| {'yes' if r.as_expected else 'NO'} |"
            for r in results
        ),
    ]
    consoles = [
        f"{r.name}:\n" + "\n".join(f"    {line}" for line in (r.console if r.lines <= 1 else r.console[-3:]))
        for r in results
    ]
    return "\n".join(
        [
            "# Bad inputs on CPU: one line each",
            "",
            *header,
            "",
            f"{ok} of {len(bad)} bad inputs refused in one `config error:` line (exit 1)"
            + ("; the command a refusal suggested runs (exit 0)." if len(bad) < len(results) else "."),
            "",
            *rows,
            "",
            "## What each printed (a run that went on: its last 3 lines)",
            "",
            "```",
            *consoles,
            "```",
            "",
        ]
    )


def header_lines(work: Path) -> list[str]:
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        f"Made by `.venv/bin/python scripts/bad_inputs.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"commit {git('rev-parse', '--short', 'HEAD')}{dirty}; CPU: {cpu}, {os.cpu_count()} cores, shared "
        f"(load average {load} over 1 / 5 / 15 min when the table was written: seconds grow with it).",
        f"Each command: `env -i PATH=/usr/local/bin:/usr/bin:/bin HOME={work / 'home'} PYTHONPATH=<repo> "
        ".venv/bin/python -m vime.train <overrides>` (a fresh shell, the venv not active); seconds are wall time of "
        f"the process; lines are the console's non-blank lines. `<work>` is {work}.",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/vime_bad_inputs"), help="fixtures and the finished run")
    ap.add_argument("--out", type=Path, default=OUT, help="the markdown table (a .json beside it)")
    ap.add_argument("--only", default="", help="only the cases whose name or overrides contain this")
    ap.add_argument("--no-run", action="store_true", help="leave out the cases that need a finished run")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take")
    args = ap.parse_args(argv)
    work = args.work.resolve()
    env = fresh_env(work)
    chosen = [
        c
        for c in cases(work)
        if (args.only in c.name or any(args.only in o for o in c.overrides)) and not (c.needs_run and args.no_run)
    ]
    fixtures(work, env, with_run=any(c.needs_run for c in chosen))
    results = []
    for i, case in enumerate(chosen):
        own = f"output_dir={work / 'out' / f'{i:02d}'}"  # each case its own new dir, as a first run has
        overrides = [own if o == f"output_dir={work / 'out'}" else o for o in case.overrides]
        code, seconds, lines = vime_train(overrides, env | case.env, args.timeout)
        shown = " ".join([*(f"{k}={v}" for k, v in case.env.items()), *overrides]).replace(str(work), "<work>")
        expected = code == 0 if case.expect_ok else is_one_line(code, lines)
        result = Result(case.name, shown, code, round(seconds, 1), len(lines), expected, lines)
        results.append(result)
        print(f"{case.name}: exit {code}, {seconds:.1f} s, {len(lines)} line(s)", flush=True)
        for line in lines[:3]:
            print(f"    {line}", flush=True)
    for r in results:
        r.console = [line.replace(str(work), "<work>") for line in r.console]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table(results, header_lines(work)))
    args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r.as_expected for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
