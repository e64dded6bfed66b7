"""FSDP2 on 2 CPU processes (gloo): exact Unseen decoding (engine/lockstep.py) and the saved model.

Each process holds half of every parameter (torch `fully_shard` per decoder layer and at the root),
and every forward all-gathers them. The two processes decode different workloads -- 6 rollouts
against 1, so different numbers of forwards -- with the KV-forking engine, structured (Unseen)
attention and scripted blocks whose paths differ in length. Without the lockstep the process that
finishes first leaves the other in an all-gather; with it both end, and each process's tokens and
log-probs equal those of the whole, unsharded model decoding the same prompts in one process.
(accelerate runs FSDP only on GPUs, so the trainer's FSDP2 launch itself is not exercised here.)
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from parallel_r1.engine import RolloutConfig, transformers_engine
from parallel_r1.models import TinyModelConfig, build_tiny_model, load_tokenizer, qwen3_tokenizer_dir
from parallel_r1.prompts import render_prompt
from parallel_r1.structure import TagIds
from tests.conftest import redraw_layer_weights
from tests.test_kv_forking import VariedBlocks, assert_same_rollouts

QUESTIONS = ["What is 2 + 3?", "A farmer has 12 cows and buys 7 more. How many cows does he have now?",
             "Tom reads 4 pages a day for a week. How many pages?"]
WORKLOADS = {0: (QUESTIONS, 2), 1: (QUESTIONS[:1], 1)}  # rank: (questions, rollouts per question)
CONFIG: dict[str, Any] = dict(parallel=True, structured=True, max_blocks=3, max_tokens=120, temperature=1.0,
                              seed=11)


def tiny_policy() -> SimpleNamespace:
    """The same tiny Qwen3 in every process (seeded weights)."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    size = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32)
    model = build_tiny_model(tokenizer, size)
    redraw_layer_weights(model)
    return SimpleNamespace(model=model.eval(), tokenizer=tokenizer, tags=TagIds.from_tokenizer(tokenizer),
                           eos=tokenizer.eos_token_id)


def decode(tiny, rank: int):
    questions, generations = WORKLOADS[rank]
    prompts = [tiny.tokenizer(render_prompt(tiny.tokenizer, q), add_special_tokens=False)["input_ids"]
               for q in questions]
    engine = transformers_engine(tiny.model, tiny.tokenizer, RolloutConfig(**CONFIG), max_batch_size=2,
                                 logits_processor=VariedBlocks(tiny))
    return engine, engine.generate(prompts, generations)


@contextlib.contextmanager
def sharded_tiny_policy(rank: int, port: int) -> Iterator[SimpleNamespace]:
    """In one of 2 gloo processes: the tiny policy sharded with FSDP2 (per decoder layer and at the root)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        tiny = tiny_policy()
        mesh = init_device_mesh("cpu", (2,))
        for layer in tiny.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(tiny.model, mesh=mesh)
        yield tiny
    finally:
        torch.distributed.destroy_process_group()


def run_two_processes(target, out_dir: Path) -> list[int | None]:
    """Run target(rank, port, out_dir) in 2 spawned processes; their exit codes (a hung one is killed)."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=target, args=(rank, port, str(out_dir))) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
    assert not hung, f"ranks {hung} hung in a collective"
    return [process.exitcode for process in processes]


def sharded_process(rank: int, port: int, out_dir: str) -> None:
    """One of the 2 processes: shard the policy, decode this rank's workload, write what it sampled."""
    with sharded_tiny_policy(rank, port) as tiny:
        engine, rollouts = decode(tiny, rank)
        lockstep = engine.backend._lockstep
        weight = tiny.model.model.layers[0].mlp.up_proj.weight
        record = dict(sharded=type(weight).__name__, lockstep=lockstep is not None,
                      dummy_forwards=lockstep.dummy_forwards if lockstep else 0,
                      rollouts=[dict(completion_ids=r.completion_ids, logprobs=r.logprobs,
                                     env_mask=r.env_mask, num_blocks=r.num_blocks) for r in rollouts])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_fsdp2_processes_decode_different_workloads_in_lockstep_exactly(tmp_path):
    assert run_two_processes(sharded_process, tmp_path) == [0, 0]
    records = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert all(r["sharded"] == "DTensor" and r["lockstep"] for r in records.values())
    assert records[1]["dummy_forwards"] > 0 and records[0]["dummy_forwards"] == 0  # rank 1 waited for rank 0
    tiny = tiny_policy()  # the whole model, one process: what each rank must have sampled
    for rank, record in records.items():
        engine, expected = decode(tiny, rank)
        assert engine.backend._lockstep is None
        assert any(r.num_blocks for r in expected)
        got = [SimpleNamespace(**r) for r in record["rollouts"]]
        assert_same_rollouts(got, expected)


def fsdp_saving_process(rank: int, port: int, out_dir: str) -> None:
    """One of 2 processes: shard the policy with FSDP2, save it through `save_full_model` as a trainer
    under configs/fsdp.yaml (SHARDED_STATE_DICT) would."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from parallel_r1.training.saving import save_full_model

    with sharded_tiny_policy(rank, port) as tiny:
        # accelerate's own FSDP2 gather (Accelerator.get_state_dict), on the state it reads; accelerate
        # itself runs FSDP only on GPUs, and transformers' Trainer._save is save_pretrained(state_dict=...)
        gather_state = SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True)
        accelerator = SimpleNamespace(
            state=SimpleNamespace(fsdp_plugin=SimpleNamespace(state_dict_type="StateDictType.SHARDED_STATE_DICT")),
            get_state_dict=lambda model: Accelerator.get_state_dict(gather_state, model),
            wait_for_everyone=torch.distributed.barrier)
        trainer = SimpleNamespace(
            is_fsdp_enabled=True, accelerator=accelerator, model=tiny.model,
            args=SimpleNamespace(should_save=rank == 0),
            _save=lambda folder, state_dict: tiny.model.save_pretrained(folder, state_dict=state_dict),
            save_model=lambda folder: pytest.fail("save_model writes no weights under a sharded state dict"))
        save_full_model(trainer, Path(out_dir) / "saved")


@pytest.mark.slow
def test_fsdp2_sharded_policy_is_saved_as_one_full_loadable_model(tmp_path):
    """configs/fsdp.yaml keeps SHARDED_STATE_DICT; `save_full_model` gathers the full weights
    (every process joins) and rank 0 writes a model that loads with the unsharded weights."""
    from parallel_r1.models import load_model

    assert run_two_processes(fsdp_saving_process, tmp_path) == [0, 0]
    saved, _ = load_model(tmp_path / "saved", "float32")
    whole = tiny_policy().model.state_dict()
    loaded = saved.state_dict()
    assert set(loaded) == set(whole)
    for name, tensor in whole.items():
        assert type(loaded[name]) is torch.Tensor and torch.equal(loaded[name], tensor), name
