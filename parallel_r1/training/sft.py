"""Cold-start SFT on Parallel-GSM8K (docs/paper.md stage 3) for both variants, with TRL's SFTTrainer.

Data: each filtered teacher row becomes a prompt-completion pair. The prompt is the Parallel Thinking
prompt as one user message rendered through the chat template with the generation prompt
(`prompts.render_prompt`: exactly what rollouts and evaluation feed the model); the completion is the
teacher's final output plus the end token `sft.end_token` picks (`completion_end`): EOS in the paper
profile (the official SFT dataset appends `tokenizer.eos_token`) and the others, or the chat template's
end of turn. TRL sets the prompt tokens' labels to -100 (`completion_only_loss`), so the loss covers
response tokens only. Why not a conversational completion: Qwen3's chat template renders a final
assistant turn as `<think>\\n\\n</think>\\n\\n...`, which the generation prompt lacks, so the model
would learn to open every answer with an empty thinking block that the paper's data (thinking dropped)
never holds.

Seen trains with plain causal attention. Unseen trains through `ParallelSFTCollator`, which runs
`structure.build_structure` on every padded batch in the data loader and ships it as O(L) per-token
tensors: multiverse `position_ids`, the 2D padding `attention_mask`, and each token's path window
(`path_window_start`, `path_window_end`: the earlier sibling paths it must not see). A forward
pre-hook (`install_structured_attention`) turns them into the mask on the model's device right
before the forward: a dense 4D mask for SDPA (`attention_backend: dense`) or a FlexAttention
BlockMask (`flex`). Why not put the 4D mask itself in the batch: SFTTrainer.compute_loss counts
tokens with `inputs["attention_mask"].sum()`, which a 4D mask inflates (B*L^2) and a BlockMask
breaks (no `.sum()`); with the 2D mask kept under its usual key every TRL metric (num_tokens,
entropy, token accuracy) stays right without re-implementing compute_loss. A BlockMask's mask_mod
also reads the per-token tensors, which must sit on the GPU running the kernel (data-loader workers
must not touch CUDA), and O(L) tensors are cheap to move where an L x L mask per row is not.

Checkpoints go to `checkpoint_dir` every `save_steps` (the last one kept); a re-run with the same
options, data and base model resumes from it, any other re-run starts afresh. Every process takes
part in saving (FSDP / ZeRO-3 gather the weights), only the main one moves the final model (safetensors
+ tokenizer) into place, atomically, so `accelerate launch` works unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import torch

from parallel_r1.config import check_fields
from parallel_r1.errors import PipelineError
from parallel_r1.identity import work_identity
from parallel_r1.io import atomic_path
from parallel_r1.models import load_model, runs_in_bf16
from parallel_r1.prompts import render_prompt
from parallel_r1.structure import Structure, TagIds, attention_inputs, build_structure
from parallel_r1.training.checkpoints import (
    check_scheduler,
    checkpoint_step,
    no_checkpoint_at_the_end,
    process_state,
    resume_point,
    trainer_arguments,
)
from parallel_r1.training.memory import check_sharding_active
from parallel_r1.training.saving import save_full_model

Variant = Literal["seen", "unseen"]
VARIANTS: tuple[str, ...] = ("seen", "unseen")
WINDOW_START, WINDOW_END = "path_window_start", "path_window_end"
END_OF_TURN = "<|im_end|>"  # Qwen chat templates close every turn with it
ATTN_FOR_BACKEND = {"dense": "sdpa", "flex": "flex_attention"}
PROBE_FIELDS = ("probe_questions", "probe_max_tokens")


@dataclass(frozen=True)
class SFTOptions:
    """Cold-start SFT settings (the stage merges params.yaml `sft` and `sft_variants.<variant>`).

    Optimisation: `batch_size` rows per optimizer update (the paper's 128), reached through
    gradient accumulation over `per_device_batch_size` rows x processes; AdamW with `lr`,
    `weight_decay`, betas (`adam_beta1`, `adam_beta2`: the official SFT trainer's 0.9, 0.95), a
    linear warm-up over `warmup_ratio` of the steps, then `lr_scheduler`. Loss
    (`loss_normalization`): "sequence" = each sequence's token mean, averaged over sequences (the
    official SFT trainer, `training/sft_loss.py`), "token" = TRL's token mean over the update.
    `end_token` closes every completion: "eos" = the tokenizer's EOS (the official SFT dataset
    appends `tokenizer.eos_token`), "end_of_turn" = the chat template's turn end (`<|im_end|>` for
    Qwen). The rollout and evaluation engines stop at both, so either trains a model that stops.
    Sequences: prompt + completion cut to `max_length` tokens (the end is dropped; a block cut open
    keeps its paths independent). Attention (Unseen only): `dense` builds a 4D mask for SDPA (CPU, or
    GPU at short lengths), `flex` a FlexAttention BlockMask (GPU: compiled, block-sparse).
    Probe (read by the stage, not by training): greedy generations on `probe_questions` GSM8K test
    questions, at most `probe_max_tokens` new tokens each.
    """

    variant: Variant
    batch_size: int = field(metadata={"min": 1})
    per_device_batch_size: int = field(metadata={"min": 1})
    lr: float = field(metadata={"min": 0})
    weight_decay: float = field(metadata={"min": 0})
    warmup_ratio: float = field(metadata={"min": 0})
    lr_scheduler: str
    max_length: int = field(metadata={"min": 16})
    max_steps: int = field(metadata={"min": 1})
    attention_backend: Literal["dense", "flex"] = "dense"
    gradient_checkpointing: bool = False
    save_steps: int = field(default=50, metadata={"min": 1})
    seed: int = 0
    probe_questions: int = field(default=16, metadata={"min": 0})
    probe_max_tokens: int = field(default=512, metadata={"min": 1})
    adam_beta1: float = field(default=0.9, metadata={"min": 0})
    adam_beta2: float = field(default=0.95, metadata={"min": 0})
    loss_normalization: Literal["sequence", "token"] = "sequence"
    end_token: Literal["eos", "end_of_turn"] = "eos"

    def __post_init__(self) -> None:
        check_fields(self)
        check_scheduler(self.lr_scheduler)
        if self.warmup_ratio >= 1:
            raise PipelineError(f"warmup_ratio: must be < 1 (a share of the steps), got {self.warmup_ratio}")

    @property
    def structured(self) -> bool:
        return self.variant == "unseen"

    @property
    def attn_implementation(self) -> str:
        """The model's attention kernel: SDPA for Seen, the backend's for Unseen."""
        return ATTN_FOR_BACKEND[self.attention_backend] if self.structured else "sdpa"

    def gradient_accumulation_steps(self, processes: int = 1) -> int:
        per_update = self.per_device_batch_size * processes
        if self.batch_size % per_update:
            raise PipelineError(f"sft batch_size: {self.batch_size} is not a multiple of "
                                f"per_device_batch_size {self.per_device_batch_size} x {processes} "
                                "process(es)")
        return self.batch_size // per_update


def end_of_turn(tokenizer) -> str:
    """The token that closes the assistant turn: `<|im_end|>` for Qwen chat models, else EOS."""
    return END_OF_TURN if END_OF_TURN in tokenizer.get_vocab() else tokenizer.eos_token


def completion_end(tokenizer, end_token: Literal["eos", "end_of_turn"]) -> str:
    """The text every SFT completion ends with: the tokenizer's EOS or the chat template's turn end."""
    if end_token == "end_of_turn":
        return end_of_turn(tokenizer)
    if not tokenizer.eos_token:
        name = getattr(tokenizer, "name_or_path", "?")
        raise PipelineError(f"sft.end_token eos: tokenizer {name!r} has no EOS token")
    return tokenizer.eos_token


def _text_field(row: Mapping[str, Any], name: str, index: int, where: str) -> str:
    """`row[name]` as a non-empty string, else a one-line error naming the row."""
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise PipelineError(f"{where} row {index} (id {row.get('id', '?')}): field {name} must be a "
                            "non-empty string")
    return value


def sft_dataset(rows: Sequence[Mapping[str, Any]], tokenizer, where: str = "SFT data",
                end: str | None = None):
    """TRL prompt-completion dataset: rendered Parallel Thinking prompt -> teacher completion + `end`
    (`completion_end`; None = the end of turn)."""
    from datasets import Dataset

    if not rows:
        raise PipelineError(f"{where}: zero rows — the filter kept nothing")
    end = end or end_of_turn(tokenizer)
    prompts, completions = [], []
    for index, row in enumerate(rows, start=1):
        question, completion = (_text_field(row, name, index, where) for name in ("question", "completion"))
        prompts.append(render_prompt(tokenizer, question))
        completions.append(completion if completion.endswith(end) else completion + end)
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


@dataclass
class ParallelSFTCollator:
    """Pads like TRL (right padding, label -100 on prompt and padding); Unseen adds the structure.

    `tags` None = Seen: the batch is TRL's own (causal attention, ordinary positions).
    """

    pad_token_id: int
    tags: TagIds | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        batch = DataCollatorForLanguageModeling(pad_token_id=self.pad_token_id,
                                                pad_to_multiple_of=self.pad_to_multiple_of)(examples)
        if self.tags is None:
            return batch
        structure = build_structure(batch["input_ids"], batch["attention_mask"], self.tags)
        batch["position_ids"] = structure.position_ids
        batch[WINDOW_START] = structure.hidden_start
        batch[WINDOW_END] = structure.hidden_end
        return batch


def batch_structure(batch: Mapping[str, torch.Tensor]) -> Structure:
    """The `Structure` an Unseen batch (or forward kwargs) describes, on the tensors' device."""
    return Structure(position_ids=batch["position_ids"], broken_blocks=0, open_blocks=0,
                     valid=batch["attention_mask"].bool(), hidden_start=batch[WINDOW_START],
                     hidden_end=batch[WINDOW_END])


def install_structured_attention(model: torch.nn.Module, attn_implementation: str):
    """Forward pre-hook: a call carrying the path window runs with the structured mask; returns the handle."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    def apply_structure(module, args, kwargs):
        if WINDOW_START not in kwargs:
            return None
        kwargs = dict(kwargs)
        structure = batch_structure(kwargs)
        del kwargs[WINDOW_START], kwargs[WINDOW_END]
        kwargs.update(attention_inputs(structure, attn_implementation, dtype))
        return args, kwargs

    return model.register_forward_pre_hook(apply_structure, with_kwargs=True)


def sft_config(options: SFTOptions, output_dir: str | os.PathLike, eos_token: str,
               report_to: str | list[str] = "none",
               bf16: bool = False, processes: int = 1):
    """TRL SFTConfig for `options`: completion-only loss, per-step logs, checkpoints every save_steps."""
    from trl import SFTConfig

    flex = options.structured and options.attention_backend == "flex"
    return SFTConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=options.per_device_batch_size,
        gradient_accumulation_steps=options.gradient_accumulation_steps(processes),
        learning_rate=options.lr,
        weight_decay=options.weight_decay,
        adam_beta1=options.adam_beta1,
        adam_beta2=options.adam_beta2,
        # "sequence": SequenceMeanSFTTrainer scales its own loss; TRL's token count is then unused
        average_tokens_across_devices=options.loss_normalization == "token",
        warmup_steps=options.warmup_ratio,  # a float < 1 is a share of max_steps
        lr_scheduler_type=options.lr_scheduler,
        max_steps=options.max_steps,
        max_length=options.max_length,
        completion_only_loss=True,
        eos_token=eos_token,
        pad_to_multiple_of=128 if flex else None,  # fewer shapes for the compiled BlockMask
        **trainer_arguments(save_steps=options.save_steps, seed=options.seed, report_to=report_to, bf16=bf16,
                            gradient_checkpointing=options.gradient_checkpointing),
    )


@dataclass
class SFTResult:
    """A finished run. `loss_history`: one {step, loss, lr, grad_norm} per update (resumed runs included)."""

    model_dir: Path
    steps: int
    steps_this_run: int  # the steps after the checkpoint it resumed from (all of them on a fresh start)
    examples: int
    dataset_tokens: int
    completion_tokens: int
    trained_tokens: int | None
    final_loss: float | None
    loss_history: list[dict]
    resumed_from: str | None
    is_main_process: bool
    processes: int = 1  # data-parallel processes


def _fingerprint(options: SFTOptions, dataset, base_dir: Path) -> dict:
    """What checkpoints depend on: training options, the data, the base model files."""
    data = hashlib.sha256()
    for prompt, completion in zip(dataset["prompt"], dataset["completion"], strict=True):
        data.update(prompt.encode() + b"\0" + completion.encode() + b"\0")
    training = {k: v for k, v in asdict(options).items() if k not in PROBE_FIELDS}
    return work_identity(base_dir, {"options": training}, data.hexdigest())


def make_trainer(options: SFTOptions, model, tokenizer, dataset, output_dir: str | os.PathLike, *,
                 bf16: bool = False, report_to: str | list[str] = "none", processes: int = 1,
                 callbacks: Iterable = ()):
    """SFTTrainer for `options` over a `sft_dataset`; Unseen gets its collator and the mask hook."""
    from trl import SFTTrainer

    from parallel_r1.training.sft_loss import SequenceMeanSFTTrainer

    trainer_class = SequenceMeanSFTTrainer if options.loss_normalization == "sequence" else SFTTrainer

    tags = TagIds.from_tokenizer(tokenizer) if options.structured else None
    config = sft_config(options, output_dir, completion_end(tokenizer, options.end_token), report_to,
                        bf16=bf16, processes=processes)
    collator = ParallelSFTCollator(tokenizer.pad_token_id, tags, config.pad_to_multiple_of)
    trainer = trainer_class(model=model, args=config, data_collator=collator, train_dataset=dataset,
                         processing_class=tokenizer, callbacks=[no_checkpoint_at_the_end(), *callbacks])
    if options.structured:
        assert trainer.model is not None  # SFTTrainer keeps the model it was given
        install_structured_attention(trainer.model, options.attn_implementation)
    return trainer


def train_sft(options: SFTOptions, base_dir: str | os.PathLike, rows: Sequence[Mapping[str, Any]],
              out_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike, *, dtype: str = "float32",
              report_to: str | list[str] = "none", where: str = "SFT data",
              callbacks: Iterable = ()) -> SFTResult:
    """Fine-tune the model in `base_dir` on `rows` (teacher-output records) and save it to `out_dir`.

    Weights stay float32 (the optimizer's master copy); with `dtype` bfloat16 the forward/backward
    run under bf16 autocast where the hardware has bf16 (`models.runs_in_bf16`).
    """
    if not rows:
        raise PipelineError(f"{where}: zero rows — the filter kept nothing")
    state = process_state()
    base_dir, out_dir, checkpoint_dir = Path(base_dir), Path(out_dir), Path(checkpoint_dir)
    model, tokenizer = load_model(base_dir, "float32", attn_implementation=options.attn_implementation)
    dataset = sft_dataset(rows, tokenizer, where, completion_end(tokenizer, options.end_token))
    resumed_from = resume_point(checkpoint_dir, _fingerprint(options, dataset, base_dir), state)
    trainer = make_trainer(options, model, tokenizer, dataset, checkpoint_dir, report_to=report_to,
                           bf16=runs_in_bf16(dtype),
                           processes=state.num_processes,
                           callbacks=callbacks)
    check_sharding_active(trainer, f"sft@{options.variant}")
    from parallel_r1.training import progress  # transformers' callback classes: loaded with the trainer

    progress.install(trainer, progress.StepLines(f"sft@{options.variant}", "sft"))
    trainer.train(resume_from_checkpoint=resumed_from)

    staging = checkpoint_dir / "final"
    trainer.model.config.use_cache = True
    save_full_model(trainer, staging)  # every process joins the gather (FSDP2 too); the main one writes
    state.wait_for_everyone()
    if state.is_main_process:
        with atomic_path(out_dir, is_dir=True) as tmp:
            for item in staging.iterdir():
                if item.name != "training_args.bin":
                    shutil.move(str(item), tmp / item.name)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    state.wait_for_everyone()

    history = [{"step": e["step"], "loss": e["loss"], "lr": e.get("learning_rate"),
                "grad_norm": e.get("grad_norm")}
               for e in trainer.state.log_history if "loss" in e]
    token_logs = [e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e]
    labels = trainer.train_dataset["labels"]
    return SFTResult(
        model_dir=out_dir, steps=trainer.state.global_step,
        steps_this_run=trainer.state.global_step - checkpoint_step(resumed_from), examples=len(dataset),
        dataset_tokens=sum(len(ids) for ids in trainer.train_dataset["input_ids"]),
        completion_tokens=sum(sum(1 for t in row if t != -100) for row in labels),
        trained_tokens=int(token_logs[-1]) if token_logs else None,
        final_loss=history[-1]["loss"] if history else None, loss_history=history,
        resumed_from=resumed_from, is_main_process=state.is_main_process, processes=state.num_processes,
    )
