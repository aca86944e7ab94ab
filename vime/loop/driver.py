"""The Ray driver: the synchronous on-policy GRPO loop.

One step: check every engine serves the trainer's version v -> rollout (GRPO groups stay on one
engine) -> rewards -> group-normalised advantages -> trainer teacher-forcing logprobs -> comparability
gate -> consistency metrics on every active token -> GRPO optimizer step (v -> v+1) -> weight sync
-> engines acknowledge v+1 -> metrics (JSONL, W&B, console). With `algo.max_staleness` >= 1 the steps run
asynchronously instead (`vime.loop.async_loop`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import ray
import torch
from tqdm import tqdm

import rl_kernel as rk
from vime.cluster import placement, plan
from vime.cluster.groups import make_groups
from vime.cluster.remote import BUCKET_BYTES, call
from vime.config import preflight
from vime.config.layout import check_layout, ray_node_gpus, ray_node_resources, read_config_json
from vime.config.schema import Mode, VimeConfig, as_dict, kept_versions, loss_fields, side_modes
from vime.data.dataset import load_tokenizer, make_prompts, model_vocab_size, stop_token_ids
from vime.data.reward_pool import Rewards, truncated_share
from vime.engines import Sample
from vime.errors import ComparabilityError, TrainingError
from vime.eval import Evaluator
from vime.faults import restart, stops
from vime.loop import consistency, sampling
from vime.loop.async_loop import AsyncLoop, lag_metrics
from vime.loop.record import Parity, RunFacts, StepRecord, step_record
from vime.loop.timeline import Timeline
from vime.loop.truncation import truncation as truncation_of
from vime.reporting import report
from vime.reporting.metrics_log import MetricsLogger
from vime.rollout.actor import RolloutWorker
from vime.state import checkpoint
from vime.trainer.actor import TrainerWorker
from vime.weights.sync import sync_weights

log = logging.getLogger("vime")


def make_model(cfg: VimeConfig, output_dir: Path) -> str:
    """The checkpoint path: `model.path`, or a tiny Qwen3 made under `<output_dir>/model`."""
    if cfg.model.path:
        path = Path(cfg.model.path)
        preflight.check_checkpoint(path)  # a dir with config.json, its files and every tensor's shape
        return str(path)
    from rl_kernel.models.tiny import make_tiny_qwen3

    if cfg.resume and (output_dir / "model" / "config.json").is_file():
        return str(output_dir / "model")  # the run's own tiny checkpoint (the KL reference and initial weights)
    t = cfg.model.tiny
    path = make_tiny_qwen3(
        output_dir / "model",
        seed=t.seed,
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        chat=t.chat,
        dtype=cfg.model.dtype,
        device="cpu" if cfg.plan else cfg.device,  # a plan never initialises CUDA
        num_experts=t.num_experts,
        num_experts_per_tok=t.num_experts_per_tok,
        moe_intermediate_size=t.moe_intermediate_size,
    )
    log.info("made a tiny Qwen3 checkpoint at %s", path)
    return str(path)


class Driver:
    def __init__(self, cfg: VimeConfig, output_dir: Path):
        self.cfg, self.output_dir = cfg, Path(output_dir)
        self.rollout_modes = side_modes(cfg.rollout.mode, cfg.rollout.boundary_modes)
        self.trainer_modes = side_modes(cfg.trainer.mode, cfg.trainer.boundary_modes)
        self.strict = all(m == Mode.strict.value for m in (*self.rollout_modes.values(), *self.trainer_modes.values()))
        self.engines: list = []
        self.trainer: list = []
        self.logger: MetricsLogger | None = None
        self.timeline = Timeline(cfg.rollout.num_engines)
        self.resumed: dict | None = None  # the driver state of the checkpoint this run continues from
        self.stopped_after: int | None = None  # set when `checkpoint.stop_after` ended the run early
        self.engine_restarts = 0  # rollout engines restarted after dying (vime/faults/restart.py)
        self.no_signal_steps: list[int] = []  # steps whose groups all tied (the warning is said once)
        self.prompt_batches = 0  # prompt batches consumed (vime.loop.sampling); a resume sets its checkpoint's

    # ---- set-up ----------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first step: the checks that need no Ray (`preflight`), Ray and the actors'
        placement (`start_ray`), then the actors themselves (`start_actors`); a plan (`plan=true`) writes where
        they would go instead of starting them."""
        resume_from, env = self.preflight()
        self.start_ray(env)
        if self.cfg.plan:  # stand-ins placed as the actors would be; no engine starts
            self.plan = plan.write_plan(self.cfg, self.groups, self.model_path, self.output_dir)
            return
        self.start_actors(resume_from)

    def preflight(self) -> tuple[Path | None, dict[str, str]]:
        """The model, the data and every check that needs no Ray, before Ray starts; sets this process's rl_kernel
        settings. Returns (the checkpoint a resume continues from or None, the actors' environment)."""
        cfg = self.cfg
        stops.sweep_stale()  # temporary files that crashed runs left in /tmp and /dev/shm
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.verbose:
            import transformers

            transformers.utils.logging.disable_progress_bar()
        self.model_path = make_model(cfg, self.output_dir)
        self.load_data()
        preflight.check_lengths(cfg, [p.token_ids for p in self.prompts.prompts])
        if cfg.device == "cuda" and (cfg.plan or torch.cuda.is_available()):  # a plan never initialises CUDA
            gpu_bytes = cfg.plan_gpu_gib * 2**30 if cfg.plan else torch.cuda.get_device_properties(0).total_memory
            preflight.check_gpu_memory(cfg, read_config_json(self.model_path), gpu_bytes)
        resume_from = checkpoint.resume_point(cfg, self.output_dir)
        # the GEMM contract's row-parallel K groups: the widest TP of any engine, the same on both sides and
        # in this process, which checks the contracts they ran
        rk.set_canonical_tp(max(cfg.trainer.tp, cfg.rollout.tp))
        rk.set_logits_dtype(cfg.model.logits_dtype.value)  # the logprob contracts' logits, on every engine
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.kv_cache_space_gib),
            "TOKENIZERS_PARALLELISM": "false",
            "RL_KERNEL_CANONICAL_TP": str(rk.canonical_tp()),
            "RL_KERNEL_LOGITS_DTYPE": rk.logits_dtype(),
            "PYTHONUNBUFFERED": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VIME_VLLM_MP", "0"),
        }
        preflight.check_local_resources(cfg)
        preflight.check_weight_transport(cfg)
        return resume_from, env

    def start_ray(self, env: dict[str, str]) -> None:
        """Start (or join) Ray with the actors' environment `env`, check the GPU layout against its nodes, and
        place the actors: their placement groups (`self.groups`) and each engine's node and weight path."""
        cfg = self.cfg
        env |= placement.single_node_env(cfg.ray)
        if not cfg.ray.address:  # what the actors leave in their TMPDIR is removed with the run
            env |= stops.actor_temp_env()
        if not cfg.verbose:  # engine and framework output goes to <output_dir>/engines.log, not the console
            env["VIME_ENGINE_LOG"] = str((self.output_dir / "engines.log").resolve())
        report.route_engine_output(Path(env["VIME_ENGINE_LOG"]) if "VIME_ENGINE_LOG" in env else None)
        placement.start_ray(cfg.ray, env, log_to_driver=cfg.verbose, log_file=env.get("VIME_ENGINE_LOG"))
        nodes = ray.nodes()
        layout = check_layout(
            cfg,
            ray_node_gpus(nodes),
            read_config_json(self.model_path),  # before any engine
            ray_node_resources(nodes),
        )
        stops.install_signal_handlers()  # after ray.init: its core worker sets its own SIGTERM handler
        self.rewards.start()
        if cfg.ray.address:
            preflight.check_resources(
                cfg, ray.available_resources(), f"the cluster at {cfg.ray.address} has {ray.available_resources()}"
            )
        # one bundle per GPU, engine i's TP workers on trainer TP group i's GPUs (vime.cluster.groups)
        self.groups = groups = make_groups(cfg, layout)
        self.rollout_pg = groups.rollout_pg
        self.engine_bundles = [groups.engine_bundle(i) for i in range(cfg.rollout.num_engines)]
        # each engine's weight path by its node (vime.config.layout.engine_transports); a restart may move it
        self.trainer_node, self.engine_nodes, self.weight_paths = placement.weight_paths(
            cfg, groups.trainer[0].node, [e[0].node for e in groups.engines]
        )

    def start_actors(self, resume_from: Path | None) -> None:
        """Start the rollout engines and the trainer ranks in their placement, check they agree with the
        checkpoint, and restore `resume_from` (a checkpoint) or save the run's config; opens the metrics log."""
        cfg, groups = self.cfg, self.groups
        n_ranks = cfg.trainer.tp * cfg.trainer.cp
        # in-flight weight updates (rollout.partial) arrive in their own concurrency group, beside a rollout
        Rollout = (
            ray.remote(concurrency_groups={"weights": 1})(RolloutWorker)
            if cfg.rollout.partial
            else ray.remote(RolloutWorker)
        )
        Trainer = ray.remote(TrainerWorker)
        self.new_engine = lambda i: Rollout.options(  # noqa: E731 - also used to replace a dead engine
            **groups.engine_options(i),
            **({"runtime_env": {"env_vars": groups.engine_env(i)}} if groups.engine_env(i) else {}),
            name=f"rollout-{i}" + (f"-restart{self.engine_restarts}" if self.engine_restarts else ""),
        ).remote(
            i,
            cfg.rollout,
            self.model_path,
            cfg.model.dtype,
            cfg.device,
            self.rollout_modes,
            cfg.seed,
            str(self.weight_paths[i]),
            truncation=truncation_of(cfg),
        )
        self.engines = [self.new_engine(i) for i in range(cfg.rollout.num_engines)]
        self.trainer = [
            Trainer.options(
                **groups.trainer_options(r),
                name=f"trainer-{r}",
            ).remote(
                r,
                n_ranks,
                cfg.trainer,
                self.model_path,
                cfg.model.dtype,
                cfg.device,
                self.trainer_modes,
                cfg.seed,
                cfg.algo.kl_coef,
                cfg.algo.clip_eps,
                correction_fields(cfg) | loss_fields(cfg),
                kept_versions(cfg),
                truncation=truncation_of(cfg),
                entropy_coef=cfg.algo.entropy_coef,
            )
            for r in range(n_ranks)
        ]
        self.rendezvous = placement.rendezvous_file(cfg.ray)
        init = (
            f"file://{self.rendezvous}"
            if self.rendezvous
            else placement.tcp_url(*call([self.trainer[0].address.remote()], "rendezvous", ["trainer rank 0"])[0])
        )
        with tqdm(total=2, desc="starting engines", leave=False, disable=None) as bar:
            # trainer and rollout start together, except vLLM sharing the trainer's GPUs: vLLM sizes its KV
            # cache from the memory it measures while it starts, so the trainer loads after it
            after_rollout = cfg.device == "cuda" and cfg.rollout.engine == "vllm" and cfg.weights.colocate
            tinfo_refs = [] if after_rollout else [t.start.remote(init) for t in self.trainer]
            infos = self._call(self.engines, "info", "start")
            tinfo_refs = tinfo_refs or [t.start.remote(init) for t in self.trainer]
            bar.update()
            tinfo = call(tinfo_refs, "start", [f"trainer rank {r}" for r in range(n_ranks)])
            bar.update()
        for i in infos:
            self.timeline.acknowledged(i["engine"], i["version"])  # every engine starts on version 0
        for i in infos:
            log.info("rollout engine %d: %s (modes %s)", i["engine"], i["label"], _modes_str(i["modes"]))
        log.info("trainer: %d rank(s), %s (modes %s)", n_ranks, tinfo[0]["label"], _modes_str(tinfo[0]["modes"]))
        for i in infos + tinfo:
            if i["vocab_size"] != self.vocab_size:
                raise ComparabilityError(
                    f"{i['label']} reports vocab {i['vocab_size']}, the checkpoint has {self.vocab_size}"
                )
        self.labels = {"rollout_engine": infos[0]["label"], "trainer_engine": tinfo[0]["label"]}
        if resume_from is not None:
            self.resumed = checkpoint.restore(self, resume_from)
        else:
            checkpoint.save_config(self.output_dir, as_dict(cfg))
        self.logger = MetricsLogger(
            self.output_dir,
            as_dict(cfg) | {"model_path": self.model_path} | self.labels,
            cfg.wandb.mode,
            cfg.wandb.project,
            cfg.wandb.name,
            cfg.wandb.entity,
            samples_every=cfg.samples_every,
        )
        if self.resumed is not None:
            checkpoint.restore_metrics(self.logger, self.resumed["rows"])
        # prompt batches consumed so far (vime.loop.sampling): one a step unless algo.dynamic_sampling
        self.prompt_batches = (self.resumed or {}).get("prompt_batches", self.timeline.step)

    def load_data(self) -> None:
        """The tokenizer of `self.model_path`, the prompts, stop tokens, reward function and eval set: every bad
        input is named before any engine starts."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(self.model_path)
        self.vocab_size = model_vocab_size(self.model_path)
        self.prompts = make_prompts(cfg.data, self.tokenizer, self.vocab_size, self.model_path)
        self.stop_ids = stop_token_ids(cfg.data, self.tokenizer)
        self.rewards = Rewards(cfg, self.tokenizer, self.stop_ids, cfg.algo.max_new_tokens)
        self.reward_metrics: dict = {}
        self.evaluator = Evaluator.build(cfg, self.tokenizer, self.vocab_size, self.model_path, self.output_dir)

    def _call(self, actors: list, method: str, what: str, *args, trainer: bool = False) -> list:
        names = [f"trainer rank {i}" if trainer else f"rollout engine {i}" for i in range(len(actors))]
        return call([getattr(a, method).remote(*args) for a in actors], what, names)

    # ---- one step ----------------------------------------------------------------------------

    def generate(self, index: int) -> tuple[list, list[Sample], list[dict]]:
        """Prompt batch `index` rolled out (sampling seeded by `index`): (its prompts, the samples in group order
        with their rewards, the rollout's rl_kernel evidence)."""
        a, n = self.cfg.algo, len(self.engines)
        batch = self.prompts.batch(index, a.prompts_per_step)
        per_engine = [[(g, p.token_ids) for g, p in enumerate(batch) if g % n == e] for e in range(n)]
        submit = lambda i: self.engines[i].generate.remote(  # noqa: E731
            per_engine[i], a.group_size, a.max_new_tokens, a.temperature, self.stop_ids, index, 0, True
        )
        shares = restart.each_engine(self, submit, "generate")  # a dead engine is restarted, its share redone
        evidence = [e for _, ev in shares for e in ev]
        samples = sorted((s for out, _ in shares for s in out), key=lambda s: s.group)  # stable: group order
        self.reward_metrics = self.rewards.score(batch, samples, index)
        self.reward_errors += self.reward_metrics["reward_errors"]
        return batch, samples, evidence

    def rollout(self, step: int) -> list[Sample]:
        """Step `step`'s samples with rewards and advantages (`vime.loop.sampling`); its sampling metrics in
        `self.sampled`."""
        a = self.cfg.algo
        self.reward_errors = 0
        picked = sampling.sample_step(self.generate, self.prompt_batches, a)
        self.prompt_batches += picked.rounds
        self.rollout_evidence = picked.evidence
        samples = picked.samples
        kl = None
        if a.kl_in_reward:  # the reward penalty: each sample's summed KL to the reference, from the trainer
            kl = self._call(self.trainer, "reference_kl", "reference KL", samples, trainer=True)[0]
        sampling.assign_advantages(samples, a, kl)
        # errors of every round sampled; the truncated share of the samples trained on
        self.reward_metrics |= {"reward_errors": self.reward_errors, "truncated_frac": truncated_share(samples)}
        self.sampled = {
            "sample_rounds": picked.rounds,
            "dropped_groups": picked.dropped,
            "prompts_consumed": self.prompt_batches * a.prompts_per_step,
        } | ({"kl_penalty_mean": a.kl_coef * sum(kl) / len(kl)} if kl is not None else {})
        return samples

    def step(self, step: int) -> StepRecord:
        cfg, t0 = self.cfg, time.perf_counter()
        version = self.timeline.check_ready_for_rollout()
        samples = self.rollout(step)
        t1 = time.perf_counter()
        # The trainer's logprobs of the rollout's tokens, at the rollout's weight version: by default from
        # the training forward itself (on-policy, the same weights); `trainer.scoring_pass` adds the
        # separate no-grad scoring forward and compares that instead.
        separate = cfg.trainer.scoring_pass
        sleep_s = wake_s = None
        if cfg.rollout.sleep_level:  # colocated vLLM gives the GPU back to the trainer until the weight push
            restart.each_engine(self, lambda i: self.engines[i].sleep.remote(), "sleep", reload=False)
            sleep_s = time.perf_counter() - t1
        scored = self._call(self.trainer, "score", "score", samples, trainer=True)[0] if separate else None
        t2 = time.perf_counter()
        stats = self._call(self.trainer, "train_step", "train step", samples, not separate, trainer=True)[0]
        scored = scored if separate else stats.pop("scored")
        reported = stats.pop("version")
        expected = self.timeline.trained()  # the trainer's weights are now version v+1
        if reported != expected:
            raise TrainingError(f"trainer reports version {reported}, driver expects {expected}")
        t3 = time.perf_counter()
        consistency.check_comparable(samples, scored, version)
        rollout_ev = self.rollout_evidence
        trainer_ev = self._call(self.trainer, "evidence", "evidence", trainer=True)[0]
        verdict = consistency.check_contracts(rollout_ev, trainer_ev, self.rollout_modes, self.trainer_modes)
        result = consistency.compare(
            [consistency.rollout_tensor(s.logprobs) for s in samples],
            [sc.logprobs for sc in scored],
            [sc.positions for sc in scored],
            [sc.token_ids for sc in scored],
        )
        if cfg.rollout.sleep_level:
            t_wake = time.perf_counter()
            restart.each_engine(self, lambda i: self.engines[i].wake_up.remote(), "wake up", reload=False)
            wake_s = time.perf_counter() - t_wake
        sync = restart.sync(
            self,
            lambda: sync_weights(
                self.trainer,
                self.engines,
                self.timeline.trainer_version,
                BUCKET_BYTES,
                self.timeline,
                call,
                self.weight_paths,
                cfg.rollout.engine,
            ),
        )
        routing = consistency.routing_agreement(samples, scored) or {}
        fields = {**result.metrics(), **routing, **stats, **sync, **lag_metrics(samples, version, 0), **self.sampled}
        fields |= {**self.reward_metrics, "contracts": verdict, "sleep_s": sleep_s, "wake_s": wake_s}
        return self.record(step, version, samples, (t0, t1, t2, t3), fields)

    def record(self, step: int, version: int, samples: list[Sample], times: tuple, fields: dict) -> StepRecord:
        """Step `step`'s record (`vime.loop.record.step_record`: sampled at weight `version`, `fields` the step's
        own metrics, phase seconds from `times` = (start, rollout done, scored, trained) to now); the timeline
        closes the step on it. Shared by the synchronous and asynchronous loops."""
        rewards = torch.tensor([s.reward for s in samples]).tolist()  # float32, as the record has them
        warning = report.no_signal_warning(step, rewards, self.cfg.algo.group_size)
        if warning:
            if not self.no_signal_steps:  # once: later such steps show in the table's `tied` column and the summary
                log.warning(warning + "; later steps like it are counted in the summary, not repeated here")
            self.no_signal_steps.append(step)
        run = RunFacts(self.cfg.algo.group_size, self.tokenizer.decode, self.strict, self.labels)
        versions = (version, self.timeline.trainer_version)
        record = step_record(step, versions, samples, times, run, self.engine_restarts, fields)
        self.timeline.finish_step()
        return record

    def run(self) -> list[StepRecord]:
        self.setup()
        log.info(
            "run: %d steps x %d prompts x %d samples, rollout modes %s, trainer modes %s",
            self.cfg.steps,
            self.cfg.algo.prompts_per_step,
            self.cfg.algo.group_size,
            _modes_str(self.rollout_modes),
            _modes_str(self.trainer_modes),
        )
        rows = list(self.logger.rows)  # a resumed run's steps before its checkpoint
        loop = AsyncLoop(self) if self.cfg.algo.max_staleness else None  # else: the synchronous loop
        with stops.finishing_steps(self.cfg.checkpoint.on_stop_s if self.cfg.checkpoint.on_stop else None):
            self.run_steps(loop, rows)
        self.rows = rows
        return rows

    def run_steps(self, loop: AsyncLoop | None, rows: list[StepRecord]) -> None:
        """The steps from the timeline's to `steps`, each appended to `rows`. A stop signal during one lets it
        finish and be checkpointed (vime.faults.stops.finishing_steps), then stops."""
        for step in tqdm(range(self.timeline.step, self.cfg.steps), desc="steps", disable=None):
            self.evaluate(step)
            row = loop.step(step) if loop is not None else self.step(step)
            self.logger.log(row)
            rows.append(row)
            c, off = row.consistency, (row.offpolicy.lag0_ratio_off or 0) + (row.train.first_ratio_off or 0)
            consistency.refuse_outside_support(c.outside_support, step)
            if self.cfg.fail_on_mismatch and self.strict and c.mismatch_count:
                raise ComparabilityError(
                    f"strict run, step {step}: {c.mismatch_count} of {c.tokens} tokens "
                    f"differ in bits (worst {result_worst(c)})"
                )
            if self.cfg.fail_on_mismatch and self.strict and c.routing_mismatch_count:
                raise ComparabilityError(
                    f"strict run, step {step}: {c.routing_mismatch_count} of {c.routes_compared} (token, MoE layer) "
                    "routes differ between rollout and trainer"
                )
            if self.cfg.fail_on_mismatch and self.strict and off:
                raise ComparabilityError(
                    f"strict run, step {step}: the importance ratio (or the first update's ratio) of {off:.0f} "
                    "token(s) produced by the current weights is not exactly 1.0"
                )
            stop = checkpoint.after_step(self, step, rows)
            if stops.stop_requested():
                self.stop_saved = stops.save_on_stop(self, step, rows)
                if step < self.cfg.steps - 1:
                    raise stops.Stopped(stops.stop_signal())
                log.warning("the stop came during the last step: the run is complete")
            if stop:
                break
        else:
            self.evaluate(self.cfg.steps)

    def evaluate(self, step: int) -> None:
        """Evaluate the weights step `step` trains (version `step`) when eval is due then (vime/eval.py)."""
        if self.evaluator is not None and self.evaluator.due(step):
            self.evaluator.run(self, step)

    def finish(self, compare: list[StepRecord] | None = None) -> Path | None:
        """The figure (beside `compare`, a twin run's rows, when given), the W&B summary and the
        end-of-run summary on the console; returns the figure's path."""
        rows = getattr(self, "rows", [])
        if not rows or self.logger is None:
            return None
        plot = self.logger.plot(compare, task=str(self.cfg.data.task))
        last = checkpoint.latest(self.output_dir) if self.output_dir.is_dir() else None
        summary = report.summary_lines(
            rows, self.output_dir, plot, self.model_path, compare, self.cfg.steps, last, self.no_signal_steps
        )
        for line in summary:
            log.info(line)
        return plot

    def shutdown(self, exit_code: int = 0) -> None:
        """Stop the engines and Ray; W&B records `exit_code`."""
        if self.engines and ray.is_initialized():  # (ray.get would start a Ray just to stop nothing)
            try:  # all engines at once; a stopped or failed run does not wait long for a busy or dead one
                ray.get([e.shutdown.remote() for e in self.engines], timeout=60 if exit_code == 0 else 20)
            except ray.exceptions.RayActorError:
                pass  # an engine that died: its death is reported already
            except Exception as exc:  # noqa: BLE001 - best effort at exit; the run's outcome is already decided
                log.warning("engine shutdown: %s", report.death_cause(str(exc)))
        if self.logger is not None:
            self.logger.close(exit_code)
        if ray.is_initialized():
            ray.shutdown()
        if getattr(self, "rendezvous", None) and os.path.exists(self.rendezvous):
            os.unlink(self.rendezvous)
        stops.sweep_stale()
        stops.remove_own_temp_files()


def correction_fields(cfg: VimeConfig) -> dict:
    """The trainer's off-policy correction settings (vime.trainer.grpo.LossConfig fields)."""
    a = cfg.algo
    return {"correction": a.correction, "is_cap": a.is_cap, "icepop_low": a.icepop_low, "icepop_high": a.icepop_high}


def result_worst(c: Parity) -> str:
    return (
        f"sample {c.worst_sample} position {c.worst_position}: rollout {c.worst_rollout} vs trainer {c.worst_trainer}"
    )


def _modes_str(modes: dict[str, str]) -> str:
    vals = set(modes.values())
    return vals.pop() if len(vals) == 1 else ",".join(f"{b}={m}" for b, m in modes.items())
