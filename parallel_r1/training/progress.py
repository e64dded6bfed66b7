"""One progress line per training step in the stage log, instead of transformers' raw log dicts.

transformers' ProgressCallback (PrinterCallback with tqdm off) writes each `Trainer.log` entry as a Python
dict: for GRPO ~40 keys a step, unreadable in a stage log. `StepLines` replaces both with one fixed line
per step, as nanochat prints its training steps:

    rl@parallel_r1_unseen_parallel_only step 3/5 | reward +0.500 | acc 0.00 | parallel 0.75 | path div 0.41
        | spread 0.96 (2/2 groups) | 21.3 s | 74 tok/s
    sft@seen step 7/20 | loss 1.234 | lr 3.0e-04 | grad norm 2.10 | 12.4 s | 185 tok/s

The metrics are those the trainer logs anyway (MLflow gets the same numbers). A GRPO step is one rollout batch
(`updates_per_step` optimizer updates; its rollout metrics ride on the first update's log entry), so a GRPO
line is printed for the entries that carry `reward`; seconds are wall time since the previous line.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback


def _num(logs: Mapping[str, Any], key: str, spec: str) -> str:
    value = logs.get(key)
    return "—" if not isinstance(value, (int, float)) else format(value, spec)


def rl_line(name: str, step: int, total: int, logs: Mapping[str, Any], seconds: float,
            groups: int | None = None) -> str:
    """The GRPO step line: reward, accuracy, parallel ratio, path diversity, reward spread, time, tokens/s.

    spread = TRL's `reward_std` (mean over the step's prompt groups of their reward std); in brackets the
    groups with any spread (1 - `frac_reward_zero_std`, of `groups`): only those move a weight.
    """
    spread = _num(logs, "reward_std", ".2f")
    zero = logs.get("frac_reward_zero_std")
    if isinstance(zero, (int, float)) and groups:
        spread += f" ({round((1 - zero) * groups)}/{groups} groups)"
    return " | ".join([f"{name} step {step}/{total}", f"reward {_num(logs, 'reward', '+.3f')}",
                       f"acc {_num(logs, 'accuracy', '.2f')}",
                       f"parallel {_num(logs, 'parallel_ratio', '.2f')}",
                       f"path div {_num(logs, 'path_diversity', '.2f')}", f"spread {spread}",
                       f"{seconds:.1f} s", f"{_num(logs, 'rollout_tokens_per_s', '.0f')} tok/s"])


def sft_line(name: str, step: int, total: int, logs: Mapping[str, Any], seconds: float,
             tokens: float | None) -> str:
    """The SFT step line: loss, learning rate, gradient norm, time and trained tokens/s (`num_tokens`)."""
    rate = f"{tokens / seconds:.0f}" if tokens is not None and seconds > 0 else "—"
    return " | ".join([f"{name} step {step}/{total}", f"loss {_num(logs, 'loss', '.3f')}",
                       f"lr {_num(logs, 'learning_rate', '.1e')}",
                       f"grad norm {_num(logs, 'grad_norm', '.2f')}",
                       f"{seconds:.1f} s", f"{rate} tok/s"])


class StepLines(TrainerCallback):
    """Prints `rl_line` / `sft_line` once per step on the main process (see the module docstring).

    kind "rl": `updates_per_step` optimizer updates make a step and `groups` prompt groups are sampled per
    step; kind "sft": a step is an optimizer update. Install with `install` (it removes the dict printers).
    """

    def __init__(self, name: str, kind: str, updates_per_step: int = 1, groups: int | None = None,
                 write: Callable[[str], None] | None = None) -> None:
        if kind not in ("rl", "sft"):
            raise ValueError(f"kind must be 'rl' or 'sft', got {kind!r}")
        self.name, self.kind, self.updates, self.groups = name, kind, updates_per_step, groups
        self.write = write or (lambda line: print(line, flush=True))
        self.last = time.perf_counter()
        self.last_tokens: float | None = None
        self.lines: list[str] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()
        # TRL's `num_tokens` counts from 0 in a fresh run; a resumed run's first line has no rate
        self.last_tokens = 0.0 if state.global_step == 0 else None

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if not state.is_world_process_zero or ("reward" if self.kind == "rl" else "loss") not in logs:
            return
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        total = state.max_steps // self.updates
        step = (state.global_step - 1) // self.updates + 1
        if self.kind == "rl":
            line = rl_line(self.name, step, total, logs, seconds, self.groups)
        else:
            seen = logs.get("num_tokens")
            counted = isinstance(seen, (int, float))
            tokens = seen - self.last_tokens if counted and self.last_tokens is not None else None
            self.last_tokens = float(seen) if counted else None
            line = sft_line(self.name, step, total, logs, seconds, tokens)
        self.lines.append(line)
        self.write(line)


def install(trainer, callback: StepLines) -> StepLines:
    """Replace the trainer's dict printers (ProgressCallback's bar and dicts, PrinterCallback) by `callback`.
    """
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(callback)
    return callback
