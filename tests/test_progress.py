"""One progress line per SFT / GRPO step (parallel_r1/training/progress.py) instead of transformers' log
dicts."""

from __future__ import annotations

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from parallel_r1.training.progress import StepLines, install


def state(step: int, max_steps: int) -> TrainerState:
    return TrainerState(global_step=step, max_steps=max_steps)


def test_rl_lines_one_per_rollout_step_with_the_step_metrics():
    lines: list[str] = []
    callback = StepLines("rl@run", "rl", updates_per_step=2, groups=2, write=lines.append)
    args, control = TrainingArguments(output_dir="unused", report_to=[]), TrainerControl()
    callback.on_train_begin(args, state(0, 8), control)
    step = {"reward": 0.5, "accuracy": 0.0, "parallel_ratio": 0.75, "path_diversity": 0.41,
            "reward_std": 0.96, "frac_reward_zero_std": 0.5, "rollout_tokens_per_s": 74.2}
    callback.on_log(args, state(1, 8), control, logs=step)
    callback.on_log(args, state(2, 8), control, logs={"loss": 0.1})   # the step's second update: no line
    callback.on_log(args, state(3, 8), control, logs={**step, "path_diversity": None})
    assert len(lines) == 2
    first = lines[0].split(" | ")
    assert first[:6] == ["rl@run step 1/4", "reward +0.500", "acc 0.00", "parallel 0.75", "path div 0.41",
                         "spread 0.96 (1/2 groups)"]
    assert first[6].endswith(" s") and first[7] == "74 tok/s"
    assert lines[1].startswith("rl@run step 2/4 | ") and "path div —" in lines[1]


def test_sft_lines_show_loss_and_trained_tokens_per_second():
    lines: list[str] = []
    callback = StepLines("sft@seen", "sft", write=lines.append)
    args, control = TrainingArguments(output_dir="unused", report_to=[]), TrainerControl()
    callback.on_train_begin(args, state(0, 20), control)
    callback.on_log(args, state(1, 20), control, logs={"loss": 1.234, "learning_rate": 3e-4, "grad_norm": 2.1,
                                                        "num_tokens": 1000.0})
    parts = lines[0].split(" | ")
    assert parts[:4] == ["sft@seen step 1/20", "loss 1.234", "lr 3.0e-04", "grad norm 2.10"]
    assert parts[5].endswith(" tok/s") and parts[5] != "— tok/s"


def test_install_replaces_the_dict_printers():
    class Trainer:
        def __init__(self):
            self.callbacks = [ProgressCallback(), PrinterCallback()]

        def remove_callback(self, kind):
            self.callbacks = [c for c in self.callbacks if not isinstance(c, kind)]

        def add_callback(self, callback):
            self.callbacks.append(callback)

    trainer = Trainer()
    callback = install(trainer, StepLines("rl@x", "rl"))
    assert trainer.callbacks == [callback]
