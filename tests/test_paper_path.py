"""The paper-scale GRPO path: importance-sampling weight, mini-batch updates, engine rule, stop tokens.

These pin the settings a GPU run depends on but a tiny CPU run would not notice: TRL's vLLM
importance-sampling weight stays off (forked rollouts keep weight 1), a rollout batch feeds
several optimizer updates (so the clip acts), `engine: auto` has one meaning, and rollouts
stop at the chat template's end of turn. The tiny policy and `ForkSomeRollouts` come from
test_grpo.py (a logits processor that makes some rollouts open `<Parallel>`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from parallel_r1.engine import resolve_engine, vllm_available
from parallel_r1.errors import PipelineError
from parallel_r1.models import load_model
from parallel_r1.rewards import build_reward
from parallel_r1.training.grpo import RLOptions, batch_layout, grpo_config, rl_dataset, rollout_function_for
from parallel_r1.training.grpo_trainer import ParallelGRPOTrainer, step_records
from stages.profiles import compose, profile_names
from stages.rl import rl_options
from test_grpo import PROBLEMS, RL, ForkSomeRollouts, SpreadIn, init_dir, options  # noqa: F401  (init_dir: fixture)

REPO = Path(__file__).resolve().parents[1]


def trainer_with(opts: RLOptions, init_dir: Path, tmp_path: Path, tokenizer,  # noqa: F811
                 callbacks=(), reward=None) -> ParallelGRPOTrainer:
    """The trainer train_rl builds, with the transformers engine and forced forks (and `reward` instead
    of the run's schedule, if given)."""
    model, _ = load_model(init_dir, attn_implementation="sdpa")
    dataset, _ = rl_dataset(PROBLEMS, tokenizer, opts.prompt, opts.max_prompt_tokens)
    reward = reward or build_reward(opts.reward, updates_per_step=opts.updates_per_step)
    return ParallelGRPOTrainer(
        model=model, reward_funcs=[reward],
        args=grpo_config(opts, tmp_path / "out"), train_dataset=dataset, processing_class=tokenizer,
        structured=opts.structured, callbacks=list(callbacks),
        rollout_func=rollout_function_for(opts, "transformers", tokenizer,
                                          logits_processor=ForkSomeRollouts(tokenizer)))


# ---------------------------------------------------------------------------------- 1. importance sampling


PROFILES = profile_names(REPO)


@pytest.mark.parametrize("profile", PROFILES)
def test_vllm_importance_sampling_correction_is_off_in_every_profile(profile, tmp_path):
    params = compose(REPO, profile)
    assert params["rl"]["vllm_importance_sampling_correction"] is False
    on_vllm = {**params, "rl": {**params["rl"], "engine": "vllm"}}
    config = grpo_config(rl_options(on_vllm, "grpo_dapo"), tmp_path)
    assert config.use_vllm and config.vllm_importance_sampling_correction is False


def test_forked_rollouts_keep_loss_weight_one_under_the_vllm_config(init_dir, tmp_path, tokenizer):  # noqa: F811
    """TRL scores a vLLM batch with the project's config: no importance-sampling weight, so every
    rollout, forked or not, enters the loss with weight 1. Under TRL's default the forked rollouts,
    whose second path was sampled without seeing the first, get a weight far from 1."""
    rl = {**RL, "datasets": {"gsm8k": {"batch_size": 2, "num_generations": 4, "max_steps": 1}}}
    vllm_config = grpo_config(options({**rl, "engine": "vllm"}), tmp_path / "vllm")
    trainer = trainer_with(options(rl), init_dir, tmp_path, tokenizer)
    # Score as TRL does on its vLLM path (use_vllm decides the weight); the transformers engine generates.
    trainer.use_vllm, trainer._last_loaded_step = True, trainer.state.global_step
    batch = [trainer.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    trainer.vllm_importance_sampling_correction = vllm_config.vllm_importance_sampling_correction
    torch.manual_seed(0)
    scored = trainer._generate_and_score_completions(batch)
    forked = [bool((row == trainer.tags.parallel_open).any()) for row in scored["completion_ids"]]
    assert any(forked) and not all(forked)
    assert "importance_sampling_ratio" not in scored  # TRL multiplies the loss by nothing: weight 1

    trainer.vllm_importance_sampling_correction = True  # TRL's default: sequence_mask, cap 3
    torch.manual_seed(0)
    scored = trainer._generate_and_score_completions(batch)
    weights = scored["importance_sampling_ratio"][:, 0]
    forked = torch.tensor([bool((row == trainer.tags.parallel_open).any())
                           for row in scored["completion_ids"]])
    assert forked.any() and (weights[forked] - 1).abs().min() > 0.5


# ---------------------------------------------------------------------------------- 2. mini-batch updates


@pytest.mark.parametrize("batch, mini, generations, micro, processes, expected", [
    (4, 2, 2, 8, 1, (4, 1, 2, 8)),           # 2 updates of 2 prompts x 2 rollouts
    (512, 256, 8, 8, 8, (8, 32, 64, 4096)),  # DAPO on 8 GPUs: 2 updates of 2048 completions
    (1024, 512, 5, 8, 8, (8, 40, 80, 5120)),  # GSM8K on 8 GPUs
])
def test_mini_batches_make_several_updates_per_rollout_batch(batch, mini, generations, micro, processes,
                                                             expected):
    rl = {**RL, "per_device_batch_size": micro, "datasets": {"gsm8k": {
        "batch_size": batch, "mini_batch_size": mini, "num_generations": generations, "max_steps": 3}}}
    opts = options(rl)
    assert opts.updates_per_step == batch // mini
    assert tuple(vars(batch_layout(opts, processes)).values()) == expected


def test_paper_profile_makes_two_updates_per_step_and_counts_steps_in_rollout_batches(tmp_path):
    params = compose(REPO, "paper")
    for run in ("rl_gsm8k_seen", "parallel_r1_unseen_s2"):
        opts = rl_options(params, run)
        config = grpo_config(opts, tmp_path)
        assert opts.updates_per_step == 2
        assert config.max_steps == 2 * opts.max_steps and config.save_steps == 2 * opts.save_steps
        assert config.steps_per_generation == 2 * config.gradient_accumulation_steps


def test_mini_batch_that_does_not_divide_the_batch_is_a_one_line_error():
    rl = {**RL, "datasets": {"gsm8k": {"batch_size": 4, "mini_batch_size": 3, "num_generations": 2,
                                       "max_steps": 1}}}
    with pytest.raises(PipelineError,
                       match=r"rl_datasets.gsm8k.mini_batch_size: 3 does not divide batch_size 4"):
        options(rl)


def test_reward_schedule_counts_rollout_batches_not_optimizer_updates():
    class State:
        global_step = 0

    reward = build_reward("alternating", updates_per_step=2)  # window 10: steps 9-10 tiered
    steps = []
    for update in range(0, 24, 2):  # TRL generates at updates 0, 2, 4, ...
        State.global_step = update
        steps.append(reward.step_of(State))
    assert steps == list(range(1, 13))
    history = [{"step": 1, "reward": 0.0}, {"step": 2, "loss": 0.1}, {"step": 3, "reward": 1.0}]
    assert [r["step"] for r in step_records(history, "accuracy", updates_per_step=2)] == [1, 2]


class RatioAtSecondUpdate(TrainerCallback):
    """After the first update of a step, score the second mini-batch with the updated policy and
    compare with the log-probs TRL kept from the policy that generated it (its "old" log-probs)."""

    def __init__(self) -> None:
        self.trainer: ParallelGRPOTrainer | None = None
        self.deviation: float | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 1:
            return
        batch = self.trainer._buffered_inputs[1]
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = self.trainer._get_per_token_logps_and_entropies(
                self.trainer.model, ids, mask, batch["completion_ids"].size(1))
        ratio = torch.exp(logps - batch["old_per_token_logps"])[batch["completion_mask"].bool()]
        self.deviation = float((ratio - 1).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["seen", "unseen"])
def test_second_update_of_a_rollout_batch_has_ratio_off_one_and_clips(variant, init_dir,  # noqa: F811
                                                                       tmp_path, tokenizer):
    rl = {**RL, "lr": 0.05, "per_device_batch_size": 4,
          "datasets": {"gsm8k": {"batch_size": 2, "mini_batch_size": 1, "num_generations": 4,
                                 "max_steps": 1}}}
    opts = options(rl, variant=variant, epsilon_high=0.28)
    probe = RatioAtSecondUpdate()
    spread = SpreadIn()   # a spread in every group: the first update (one prompt's group) moves the policy
    spread.ids = {problem["id"] for problem in PROBLEMS}
    trainer = trainer_with(opts, init_dir, tmp_path, tokenizer, callbacks=[probe], reward=spread)
    probe.trainer = trainer
    torch.manual_seed(0)
    trainer.train()
    assert trainer.state.global_step == 2  # 1 step = 2 optimizer updates
    first, second = (e for e in trainer.state.log_history if "loss" in e)
    assert first["clip_ratio/region_mean"] == 0.0  # first update: ratio exactly 1
    assert probe.deviation is not None and probe.deviation > 0.2
    assert second["clip_ratio/region_mean"] > 0.0  # the clip acts on the second update
    assert [r["step"] for r in step_records(trainer.state.log_history, "parallel_only",
                                            updates_per_step=2)] == [1]


# ---------------------------------------------------------------------------------- 7. engine: auto


def test_auto_engine_has_one_meaning_for_generation_training_and_evaluation():
    expected = "vllm" if vllm_available() and torch.cuda.is_available() else "transformers"
    assert resolve_engine("auto") == expected == options({**RL, "engine": "auto"}).resolved_engine()
    assert resolve_engine("transformers") == "transformers" and resolve_engine("vllm") == "vllm"
    with pytest.raises(PipelineError, match="unknown kind 'fast'"):
        resolve_engine("fast")


# ---------------------------------------------------------------------------------- 8. MLflow on rank 0 only


def test_only_the_main_process_of_a_launch_tracks(tmp_path, monkeypatch):
    """`accelerate launch` sets RANK per process: rank 1 opens no run and gives the Trainer no MLflow."""
    from parallel_r1 import tracking

    monkeypatch.delenv(tracking.SWITCH_ENV, raising=False)
    monkeypatch.delenv(tracking.PARENT_ENV, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "1")
    with tracking.stage_run("rl", "grpo_dapo", {"profile": "tiny"}) as run_id:
        assert run_id is None and tracking.report_to() == "none"
        tracking.log_metrics({"final_reward": 1.0})
    assert not (tmp_path / "mlflow.db").exists()
    monkeypatch.setenv("RANK", "0")
    assert tracking.enabled()


# ---------------------------------------------------------------------------------- 6. end-of-turn stop


def test_rollouts_of_a_base_model_stop_at_the_chat_templates_end_of_turn(init_dir, tokenizer):  # noqa: F811
    """Qwen3-4B-Base's tokenizer ends text with `<|endoftext|>`; its chat-templated answers end
    with `<|im_end|>`, which must end the rollout (and evaluation, which builds the same engine)."""
    import copy

    from parallel_r1.engine import RolloutConfig, stop_token_ids, transformers_engine
    from parallel_r1.prompts import end_of_turn_ids, render_prompt

    base = copy.deepcopy(tokenizer)
    base.eos_token = "<|endoftext|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(base) == {im_end} and base.eos_token_id != im_end
    assert stop_token_ids(base) == {base.eos_token_id, im_end}

    model, _ = load_model(init_dir)
    prompt = base(render_prompt(base, "What is 2 + 3?"), add_special_tokens=False)["input_ids"]
    forced = ForcedTurnEnd(len(prompt), im_end)
    engine = transformers_engine(model, base, RolloutConfig(parallel=False, max_tokens=16),
                                 logits_processor=forced)
    (rollout,) = engine.generate([prompt])
    assert rollout.completion_ids[-1] == im_end and len(rollout.completion_ids) == 3
    assert rollout.finish_reason == "stop" and not rollout.truncated


class ForcedTurnEnd:
    """Logits processor for one request: the third sampled token is `<|im_end|>`, never earlier."""

    def __init__(self, prompt_length: int, im_end: int) -> None:
        self.prompt_length, self.im_end = prompt_length, im_end

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.im_end] = float("-inf")
        if input_ids.shape[1] - self.prompt_length >= 2:
            scores[:] = float("-inf")
            scores[:, self.im_end] = 0.0
        return scores


# ---------------------------------------------------------------------------------- 5. server mode


class CompletionsServer:
    """A local HTTP server answering as vLLM's OpenAI completions endpoint does (token ids in and
    out, `finish_reason` per choice), with the reply this test sets: the server side is not what
    is tested, the backend's reading of it is."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        self.reply: tuple[list[int], str] = ([], "stop")
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"data": [{"id": "policy"}]} if self.path == "/v1/models" else {})

            def do_POST(self):
                json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                tokens, reason = server.reply
                names = [f"token_id:{t}" for t in tokens]
                self._send({"choices": [{"token_ids": tokens, "finish_reason": reason,
                                         "prompt_token_ids": [1],
                                         "logprobs": {"tokens": names,
                                                      "token_logprobs": [-0.5] * len(tokens),
                                                      "top_logprobs": [{n: -0.5} for n in names]}}]})

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.mark.skipif(not vllm_available(), reason="TRL's VLLMClient needs vLLM importable")
def test_server_segment_cut_by_the_length_limit_is_not_read_as_stopped():
    from parallel_r1.engine.base import SegmentRequest
    from parallel_r1.engine.vllm_server import VLLMServerBackend

    server = CompletionsServer()
    try:
        backend = VLLMServerBackend.connect(server.url)
        request = SegmentRequest(token_ids=(1, 2), max_new_tokens=10, stop_ids=frozenset({99}))
        server.reply = ([5, 6, 7], "length")  # the server's max_model_len cut it before max_new_tokens
        (cut,) = backend.continue_batch([request])
        assert cut.token_ids == [5, 6, 7] and cut.logprobs == [-0.5] * 3 and not cut.stopped
        server.reply = ([5, 6], "stop")  # the model's EOS as the server knows it
        (stopped,) = backend.continue_batch([request])
        assert stopped.stopped
    finally:
        server.httpd.shutdown()


def test_server_mode_rollout_waits_for_every_process_first(tokenizer):
    """Rank 0 pushes weights to `trl vllm-serve` in TRL's sync; the rollout must start after it on every
    rank."""
    from types import SimpleNamespace

    from parallel_r1.training.rollout import make_rollout_func

    events = []

    class Engine:
        def generate(self, prompt_ids, n, call=None):
            events.append("generate")
            return []

    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(mode="server"),
                              state=SimpleNamespace(global_step=0),
                              accelerator=SimpleNamespace(wait_for_everyone=lambda: events.append("barrier")))
    rollout = make_rollout_func(lambda t: Engine(), tokenizer)
    rollout(["What is 2 + 3?"], trainer)
    assert events == ["barrier", "generate"]
    trainer.vllm_generation.mode = "colocate"  # each process syncs its own LLM: no barrier needed
    rollout(["What is 2 + 3?"], trainer)
    assert events == ["barrier", "generate", "generate"]


def sharded_trainer(zero_stage: int = 0, fsdp_version: int | None = None, gather: bool = True):
    """What `whole_policy` reads from a GRPOTrainer launched under ZeRO-3 or FSDP (accelerate's state)."""
    from types import SimpleNamespace

    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage) if zero_stage else None,
                            fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version) if fsdp_version else None)
    return SimpleNamespace(accelerator=SimpleNamespace(state=state, process_index=0), model_wrapped="wrapped",
                           model="policy",
                           args=SimpleNamespace(ds3_gather_for_generation=gather),
                           state=SimpleNamespace(global_step=0))


def test_transformers_rollouts_decode_a_gathered_policy_under_zero3(tokenizer, monkeypatch):
    """ZeRO-3: every rollout batch runs inside TRL's unwrap_model_for_generation with the parameters
    gathered (no collective left in the decode loop); FSDP2 decodes as it is (the engine pairs the
    processes' forwards: test_lockstep.py); FSDP1, and ZeRO-3 without the gather, are refused in one
    line instead of hanging in a per-layer all-gather."""
    from contextlib import contextmanager

    import trl.models

    from parallel_r1.training.rollout import make_rollout_func

    events = []

    @contextmanager
    def unwrap(model, accelerator, gather_deepspeed3_params):
        events.append(("gather", model, gather_deepspeed3_params))
        yield model
        events.append("release")

    class Engine:
        def generate(self, prompt_ids, n, call=None):
            events.append("generate")
            return []

        def sync_weights(self, model):  # before every batch but the first (a decoding copy refreshes)
            events.append("sync")

    monkeypatch.setattr(trl.models, "unwrap_model_for_generation", unwrap)
    rollout = make_rollout_func(lambda t: Engine(), tokenizer)
    rollout(["What is 2 + 3?"], sharded_trainer(zero_stage=3))
    assert events == [("gather", "wrapped", True), "generate", "release"]
    rollout(["What is 2 + 3?"], sharded_trainer(zero_stage=3))  # the engine syncs inside the gather
    assert events[3:] == [("gather", "wrapped", True), "sync", "generate", "release"]
    rollout(["What is 2 + 3?"], sharded_trainer(zero_stage=2))  # ZeRO-2 keeps whole parameters
    assert events[-3:] == ["release", "sync", "generate"]
    rollout(["What is 2 + 3?"], sharded_trainer(fsdp_version=2))  # no gather: decoded in lockstep
    assert events[-4:] == ["sync", "generate", "sync", "generate"]
    for trainer, message in ((sharded_trainer(fsdp_version=1), "FSDP1 is not supported"),
                             (sharded_trainer(zero_stage=3, gather=False), "ds3_gather_for_generation")):
        with pytest.raises(PipelineError, match=message) as error:
            rollout(["What is 2 + 3?"], trainer)
        assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------- 4. what fits a GPU


def test_replicated_training_refuses_qwen3_4b_on_an_80gb_gpu_and_names_the_sharded_configs():
    from parallel_r1.training.memory import check_replicated_fits

    gpu = 80 * 2**30
    with pytest.raises(PipelineError,
                       match="60 GiB .*more than the 56 GiB .*configs/fsdp.yaml or configs/zero3.yaml"):
        check_replicated_fits(4_022_468_096, gpu, 0.3, "rl@parallel_r1_seen")  # Qwen3-4B-Base, vLLM 0.3
    check_replicated_fits(1_000_000_000, gpu, 0.3, "rl@small")  # 15 GiB: DDP is fine


def test_an_fsdp_launch_that_accelerate_runs_as_plain_data_parallel_stops_with_one_line(monkeypatch):
    """accelerate 1.15 turns FSDP on only for GPU process groups: on CPUs configs/fsdp.yaml ran as DDP."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from parallel_r1.training.memory import check_sharding_active

    def trainer(kind):
        return SimpleNamespace(accelerator=SimpleNamespace(distributed_type=kind))

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(PipelineError, match=r"^sft@unseen: the launch config asks for FSDP, but accelerate "
                                            r"runs MULTI_CPU here .*configs/cpu2.yaml$"):
        check_sharding_active(trainer(DistributedType.MULTI_CPU), "sft@unseen")
    check_sharding_active(trainer(DistributedType.FSDP), "sft@unseen")
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    check_sharding_active(trainer(DistributedType.MULTI_CPU), "sft@unseen")  # cpu2.yaml: nothing asked


def test_bf16_weights_would_lose_every_update_at_the_paper_learning_rate():
    """Why policies keep float32 weights under bf16 mixed precision (training/memory.py)."""
    weight = torch.full((1000,), 0.02)
    step = torch.full((1000,), 1e-6)  # an AdamW step at lr 1e-6 moves each weight by ~lr
    assert torch.equal((weight.bfloat16() - step.bfloat16()).float(), weight.bfloat16().float())
    assert not torch.equal(weight - step, weight)
