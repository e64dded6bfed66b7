"""Cold-start SFT: completion-only labels, the Unseen collator's structure, structured training
forwards, and real (tiny) SFT runs through the library and the stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import TrainerCallback

from parallel_r1.config import from_mapping
from parallel_r1.data import load_teacher_demos
from parallel_r1.errors import PipelineError
from parallel_r1.format import check_format
from parallel_r1.io import read_json, write_jsonl
from parallel_r1.models import (
    TinyModelConfig,
    build_tiny_model,
    load_model,
    load_tokenizer,
    prepare_base_model,
)
from parallel_r1.prompts import render_prompt
from parallel_r1.structure import TagIds, build_structure
from parallel_r1.training.probe import CAUSAL_DECODING, ENGINE_DECODING, _report
from parallel_r1.training.sft import (
    ParallelSFTCollator,
    SFTOptions,
    batch_structure,
    install_structured_attention,
    make_trainer,
    sft_dataset,
    train_sft,
)
from stages.sft import sft_options

TINY = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)
SFT_PARAMS = dict(batch_size=2, per_device_batch_size=1, lr=1e-2, weight_decay=0.0, warmup_ratio=0.0,
                  lr_scheduler="constant", max_length=288,
                  attention_backend="dense", gradient_checkpointing=False, save_steps=2,
                  probe_questions=2, probe_max_tokens=8)


@pytest.fixture(scope="module")
def demos(mirror):
    """Eight real teacher completions that pass Algorithm 1 (the released Parallel-GSM8K generations)."""
    return [row for row in load_teacher_demos(mirror, limit=40) if check_format(row["completion"])][:8]


def options(variant: str, **overrides) -> SFTOptions:
    return from_mapping(SFTOptions, {**SFT_PARAMS, "max_steps": 4, "variant": variant, **overrides}, "sft")


def prepared_rows(variant, tokenizer, demos, tmp_path, count=3):
    """Rows as SFTTrainer prepares them (tokenized, labels built, truncated)."""
    trainer = make_trainer(options(variant, max_length=2048), build_tiny_model(tokenizer, TINY), tokenizer,
                           sft_dataset(demos[:count], tokenizer), tmp_path / "out")
    return trainer, [trainer.train_dataset[i] for i in range(count)]


@pytest.mark.parametrize("variant", ["seen", "unseen"])
def test_loss_covers_completion_tokens_only(variant, tokenizer, demos, tmp_path):
    trainer, rows = prepared_rows(variant, tokenizer, demos, tmp_path)
    batch = trainer.data_collator(rows)
    for i, demo in enumerate(demos[:3]):
        prompt_len = len(tokenizer(render_prompt(tokenizer, demo["question"]))["input_ids"])
        real = int(batch["attention_mask"][i].sum())
        labels, ids = batch["labels"][i], batch["input_ids"][i]
        assert (labels[:prompt_len] == -100).all()
        assert torch.equal(labels[prompt_len:real], ids[prompt_len:real])
        assert (labels[real:] == -100).all()
        completion = tokenizer.decode(ids[prompt_len:real], skip_special_tokens=False)
        assert completion == demo["completion"] + "<|im_end|>"


def test_unseen_batch_carries_the_structure_of_build_structure(tokenizer, tags, demos, tmp_path):
    trainer, rows = prepared_rows("unseen", tokenizer, demos, tmp_path)
    batch = trainer.data_collator(rows)
    assert (batch["attention_mask"] == 0).any(), "rows of different lengths must be padded"
    expected = build_structure(batch["input_ids"], batch["attention_mask"], tags)
    assert torch.equal(batch["position_ids"], expected.position_ids)
    assert torch.equal(batch_structure(batch).mask, expected.mask)
    assert not torch.equal(expected.mask, build_structure(batch["input_ids"], batch["attention_mask"], tags,
                                                          structured=False).mask)
    assert batch_structure(batch).mask.any(dim=-1).all(), "a fully masked row (padding included)"


def test_truncated_sample_with_unbalanced_tags_collates(tokenizer, tags):
    text = ("intro <Parallel><Path> one </Path><Path> two </Path></Parallel><Summary> s </Summary> "
            "then </Path> <Parallel><Path> cut mid")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    examples = [{"input_ids": ids, "labels": ids}, {"input_ids": ids[:5], "labels": ids[:5]}]
    batch = ParallelSFTCollator(tokenizer.pad_token_id, tags)(examples)
    mask = batch_structure(batch).mask
    assert mask.shape == (2, 1, len(ids), len(ids))
    assert mask.any(dim=-1).all()


def _path_batch(tokenizer, path_one: str):
    """One sequence `ctx <Parallel><Path>path_one</Path><Path>path two</Path></Parallel>`; loss on path
    two."""
    pieces = ["Context: count apples.", "<Parallel>", "<Path>", path_one, "</Path>", "<Path>",
              " add three and four to get seven", "</Path>", "</Parallel>"]
    ids: list[int]
    ids, spans = [], []
    for piece in pieces:
        start = len(ids)
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        spans.append((start, len(ids)))
    labels = [-100] * len(ids)
    first, last = spans[6][0], spans[7][1]  # path two's content and its </Path>, not its <Path>
    labels[first:last] = ids[first:last]
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("variant", ["seen", "unseen"])
def test_path_two_loss_depends_on_path_one_only_when_seen(variant, tokenizer, tags):
    model = build_tiny_model(tokenizer, TINY).eval()
    collator = ParallelSFTCollator(tokenizer.pad_token_id, tags if variant == "unseen" else None)
    install_structured_attention(model, "sdpa")
    one = _path_batch(tokenizer, " red green blue")
    other = _path_batch(tokenizer, " cat dog fox")
    assert len(one["input_ids"]) == len(other["input_ids"]) and one["input_ids"] != other["input_ids"]
    with torch.no_grad():
        losses = [model(**collator([example])).loss for example in (one, other)]
    if variant == "unseen":
        assert torch.allclose(losses[0], losses[1], atol=1e-6)
    else:
        assert not torch.allclose(losses[0], losses[1], atol=1e-4)


def test_batch_size_must_split_into_devices_and_accumulation():
    with pytest.raises(PipelineError, match="batch_size: 6 is not a multiple of per_device_batch_size 4"):
        options("seen", batch_size=6, per_device_batch_size=4).gradient_accumulation_steps()
    params = {"seed": 0, "sft": SFT_PARAMS, "sft_variants": {"seen": {"max_steps": 3}}}
    with pytest.raises(PipelineError, match="missing key sft_variants.unseen"):
        sft_options(params, "unseen")
    with pytest.raises(PipelineError, match=r"^params.yaml sft_variants.seen.max_steps: must be >= 1, got 0"):
        sft_options({**params, "sft_variants": {"seen": {"max_steps": 0}}}, "seen")
    with pytest.raises(PipelineError, match=r"^params.yaml sft.warmup_ratio: must be < 1"):
        sft_options({**params, "sft": {**SFT_PARAMS, "warmup_ratio": 1.0}}, "seen")


def _stage_project(root: Path, rows: list[dict], mirror: Path | None = None) -> None:
    """A minimal project folder for `stages.sft`: params.yaml, the SFT set, a tiny base model if rows."""
    params = {"profile": "tiny", "seed": 0,
              "data": {"mirror_dir": str(mirror or "")}, "model": {"dtype": "float32"}, "sft": SFT_PARAMS,
              "sft_variants": {"seen": {"max_steps": 4}, "unseen": {"max_steps": 4}}}
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    write_jsonl(root / "data/sft/parallel_gsm8k.jsonl", rows)
    if rows:
        prepare_base_model("tiny", root / "models/base", tiny=TINY)


def test_zero_row_sft_set_stops_with_one_line(tmp_path, monkeypatch, capsys):
    from stages import sft as stage

    _stage_project(tmp_path, [])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    with pytest.raises(SystemExit) as exit_info:
        stage.main(["seen"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: data/sft/parallel_gsm8k.jsonl: zero rows — the filter kept nothing"


# The seeded tiny Unseen run's losses per update (as torchtune's recipe tests pin theirs): a change
# to the data, collator, mask or optimiser path moves them. Re-pin only for an intended change (last:
# the official SFT recipe -- betas 0.9 / 0.95, per-sequence loss, EOS end token; docs/deviations.md).
PINNED_UNSEEN_LOSSES = [11.9328, 11.8540, 11.5523, 11.4505]


class _SavedSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


class _KillAfterFirstCheckpoint(TrainerCallback):
    """Stops the run like a kill, right after the first checkpoint is written."""

    def on_save(self, args, state, control, **kwargs):
        raise KeyboardInterrupt("killed")


@pytest.mark.slow
def test_killed_unseen_run_resumes_and_saves_a_loadable_model(demos, tmp_path):
    base = prepare_base_model("tiny", tmp_path / "base", tiny=TINY)
    opts = options("unseen")
    out, checkpoints = tmp_path / "sft_unseen", tmp_path / "checkpoints"
    with pytest.raises(KeyboardInterrupt):
        train_sft(opts, base, demos, out, checkpoints, callbacks=[_KillAfterFirstCheckpoint()])
    assert not out.exists() and (checkpoints / "checkpoint-2").is_dir()

    result = train_sft(opts, base, demos, out, checkpoints)
    assert result.resumed_from == str(checkpoints / "checkpoint-2") and result.steps_this_run == 2
    assert [entry["step"] for entry in result.loss_history] == [1, 2, 3, 4]
    assert result.loss_history[-1]["loss"] < result.loss_history[0]["loss"]
    # the resumed run continues the same trajectory: its losses are the uninterrupted run's
    saves = _SavedSteps()
    straight = train_sft(opts, base, demos, tmp_path / "straight", tmp_path / "straight_checkpoints",
                         callbacks=[saves])
    assert saves.steps == [2]  # every save_steps (2) but the last (4): the final model is saved instead
    assert [e["loss"] for e in straight.loss_history] == pytest.approx(PINNED_UNSEEN_LOSSES, rel=1e-3)
    assert [e["loss"] for e in result.loss_history] == pytest.approx(
        [e["loss"] for e in straight.loss_history], rel=1e-4)
    assert result.examples == 8 and result.completion_tokens > 0
    assert (out / "model.safetensors").is_file() and not checkpoints.exists()
    model, tokenizer = load_model(out)
    assert TagIds.from_tokenizer(tokenizer) == TagIds.from_tokenizer(load_tokenizer(base))
    assert model.config.vocab_size == len(tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["seen", "unseen"])
def test_stage_writes_model_loss_curve_and_summary(variant, demos, mirror, tmp_path, monkeypatch):
    from stages import sft as stage

    _stage_project(tmp_path, demos, mirror)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    stage.main([variant])
    model, _ = load_model(tmp_path / f"models/sft_{variant}")
    assert model.config.num_hidden_layers == TINY.num_hidden_layers
    losses = read_json(tmp_path / f"metrics/sft/{variant}/loss.json")
    assert [row["step"] for row in losses] == [1, 2, 3, 4]
    assert set(losses[0]) == {"step", "loss", "lr", "grad_norm"}
    summary = read_json(tmp_path / f"metrics/sft/{variant}/summary.json")
    assert summary["steps"] == 4 and summary["examples"] == 8
    assert summary["final_loss"] < summary["first_loss"]
    probe = summary["probe"]
    assert probe["questions"] == 2 and 0.0 <= probe["parallel_block_rate"] <= 1.0
    assert len(probe["examples"]) == 2 and all(isinstance(e["response"], str) for e in probe["examples"])
    assert 0.0 <= probe["finished_rate"] <= 1.0 and 0.0 <= probe["accuracy"] <= 1.0
    # each variant is probed the way it decodes: Unseen by the structured forking engine, with the
    # free causal decoding kept beside it for reference
    if variant == "unseen":
        assert probe["decoding"] == ENGINE_DECODING and probe["causal"]["decoding"] == CAUSAL_DECODING
        assert 0.0 <= probe["causal"]["parallel_block_rate"] <= 1.0
    else:
        assert probe["decoding"] == CAUSAL_DECODING and "causal" not in probe
    assert json.dumps(summary)
    assert not (tmp_path / f"checkpoints/sft_{variant}").exists()


def test_probe_report_counts_finished_and_correct_responses():
    """The probe's accuracy uses the paper checker on the last Final Answer, and a response cut by
    the token cap counts as unfinished (it has no answer for accuracy-based RL to reward)."""
    block = "<Parallel><Path>6 x 3</Path><Path>3 + 3 + ...</Path></Parallel><Summary>18</Summary>"
    texts = [f"{block}\nFinal Answer: 18", "Final Answer: 17", f"{block} so the answer is"]
    problems = [{"question": f"q{i}", "ground_truth": "18", "answer_kind": "gsm8k"} for i in range(3)]
    report = _report(texts, [30, 5, 28], [False, False, True], problems, 32, CAUSAL_DECODING, 1)
    assert report["accuracy"] == pytest.approx(1 / 3)
    assert report["finished_rate"] == pytest.approx(2 / 3)
    assert report["parallel_block_rate"] == pytest.approx(2 / 3)
    assert report["examples"][0]["question"] == "q0"


# ---------------------------------------------------------------------------------- the official SFT recipe


def test_sft_defaults_are_the_official_betas_loss_and_end_token(tokenizer, demos, tmp_path):
    from parallel_r1.training.sft import completion_end

    trainer, _ = prepared_rows("seen", tokenizer, demos, tmp_path)
    assert (trainer.args.adam_beta1, trainer.args.adam_beta2) == (0.9, 0.95)
    assert type(trainer).__name__ == "SequenceMeanSFTTrainer"
    assert options("seen").end_token == "eos"  # the official SFT dataset appends tokenizer.eos_token
    completion = sft_dataset(demos[:1], tokenizer, end=completion_end(tokenizer, "eos"))["completion"][0]
    assert completion.endswith(tokenizer.eos_token)
    turn_end = sft_dataset(demos[:1], tokenizer, end=completion_end(tokenizer, "end_of_turn"))["completion"]
    assert turn_end[0].endswith("<|im_end|>")


def test_sequence_mean_loss_by_hand():
    from parallel_r1.training.sft_loss import sequence_mean_loss

    log_probs = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # (1.5 + 3 + 0) / 3 sequences; the token mean would be 6 / 3 tokens = 2
    assert sequence_mean_loss(log_probs, mask).item() == pytest.approx(1.5)


def test_sft_loss_is_each_sequences_token_mean_averaged_over_the_update(tokenizer, demos, tmp_path):
    """The official trainer's loss: per sequence, the mean NLL of its completion tokens; per micro-batch,
    the mean over sequences; divided by the update's micro-batches (here 2)."""
    trainer, rows = prepared_rows("seen", tokenizer, demos, tmp_path)
    batch = trainer.data_collator(rows[:2])
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 2
    loss = trainer.compute_loss(model, dict(batch))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
    per_sequence = (-(logp * mask)).sum(1) / mask.sum(1)
    assert loss.item() == pytest.approx(per_sequence.mean().item() / 2, rel=1e-4)
    token_mean = (-(logp * mask)).sum() / mask.sum()
    assert mask.sum(1)[0] != mask.sum(1)[1] and abs(per_sequence.mean() - token_mean) > 1e-4


def test_sequence_mean_loss_is_divided_once_on_transformers_before_5_19(tokenizer, demos, tmp_path,
                                                                        monkeypatch):
    """Before transformers 5.19 TRL 1.16 marks a self-scaled loss with a *string* compute_loss_func, which
    SFTTrainer.compute_loss then calls. The trainer undoes that and lets the Trainer divide instead: the
    back-propagated loss of one micro-batch is the same on both versions (the GPU image has 5.17)."""
    import transformers

    trainer, rows = prepared_rows("seen", tokenizer, demos, tmp_path / "now")
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    before, _ = prepared_rows("seen", tokenizer, demos, tmp_path / "old")
    assert before.compute_loss_func is None and trainer.compute_loss_func is None
    batch = trainer.data_collator(rows)
    losses = []
    for each in (trainer, before):
        each.current_gradient_accumulation_steps = 2
        losses.append(each.training_step(trainer.model, dict(batch)).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    trainer.model.eval()
    whole = trainer.compute_loss(trainer.model, dict(batch)).item()
    assert losses[0] == pytest.approx(whole / 2, rel=1e-5)
