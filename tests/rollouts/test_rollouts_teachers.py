"""Multi-turn rollouts with a served teacher (lightning_gkd.rollouts with lightning_gkd.teachers.server): a top-k
server scores a tool transcript exactly as the same teacher in process with the same top-k, on every segment of a
transcript a rewriting template split, and a GKD step with tools trains against the server through a real Trainer."""

from __future__ import annotations

import pytest
import torch
from helpers.fitting import small_trainer
from transformers import AutoModelForCausalLM

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer
from lightning_gkd.toy.tiny import TINY_STUDENT, asset_path, tiny_causal_lm
from lightning_gkd.toy.tools import TOOLS, tool_rows
from tests.helpers.rewriting_templates import REWRITES_TOOL_CALLS
from tests.helpers.scripted_sampler import ScriptedSampler
from tests.helpers.tool_runs import reference_script

TOOLS_ROLLOUT = {"tools": list(TOOLS), "tool_state_columns": ["facts"]}
FAST = {"retries": 2, "backoff": 0.01, "timeout": 30.0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def toy_tools():
    path = asset_path("toy_tools/teacher")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), load_tokenizer(path)


@pytest.fixture(scope="module")
def server(toy_tools):
    with FakeVLLMServer(*toy_tools, max_model_len=400) as fake:
        yield fake


def module_with(teacher, tokenizer, rows, **kwargs) -> GKDModule:
    return GKDModule(
        tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
        teacher,
        tokenizer,
        lmbda=1.0,
        divergence={"beta": 0.0},
        rollout=TOOLS_ROLLOUT,
        sampling={"sampler": ScriptedSampler(tokenizer, reference_script(rows)), "max_new_tokens": 64},
        validation={"metrics": {}},
        **kwargs,
    )


@pytest.mark.parametrize("template", ["chatml", "rewrites_tool_calls"])
def test_a_top_k_server_scores_a_tool_transcript_as_the_teacher_in_process(toy_tools, server, template):
    model, shipped = toy_tools
    tokenizer = load_tokenizer(asset_path("toy_tools/teacher"))
    if template == "rewrites_tool_calls":
        tokenizer.chat_template = REWRITES_TOOL_CALLS
    rows = tool_rows("train", 3)
    local = module_with({"kind": "local", "model": model, "top_k": 20}, tokenizer, rows)
    served = module_with({"kind": "server", "url": server.url, "top_k": 20, **FAST}, tokenizer, rows)
    served.student.load_state_dict(local.student.state_dict())
    rollout = local.rollout
    collator = ChatMLCollator(
        tokenizer, columns=["facts"], carry_prompt_messages=True, tools=rollout.tools, first_turn_prompts=True
    )
    scripted = ScriptedSampler(tokenizer, reference_script(rows))
    out, stats = rollout.run(lambda i, m, s: scripted.sample(None, i, m, seed=s), collator(rows), seed=0)
    assert stats.segments == ([1, 1, 1] if template == "chatml" else [4, 4, 4])
    ours, theirs = served.distillation_loss(out), local.distillation_loss(out)
    assert int(ours.count) == int(theirs.count) > 0
    assert torch.allclose(ours.loss, theirs.loss, atol=1e-4)
    served.teardown("fit")


def test_a_gkd_step_with_tools_trains_against_a_top_k_server(toy_tools, server, tmp_path):
    _, tokenizer = toy_tools
    rows = tool_rows("train", 4)
    module = module_with({"kind": "server", "url": server.url, "top_k": 20, **FAST}, tokenizer, rows)
    before = [p.detach().clone() for p in module.student.parameters()]
    data = ChatDataModule(tokenizer, rows, rows[:2], batch_size=2, max_length=200, assistant_turns="all")
    trainer = small_trainer(tmp_path, max_steps=1)
    trainer.fit(module, datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/tools/calls"] == 3.0 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, module.student.parameters(), strict=True))


def test_speculative_kd_verified_by_a_top_k_server_rolls_out_as_with_the_teacher_in_process(toy_tools, server):
    """sampler=skd with a served teacher in a tool rollout: every turn's drafts are verified by the server (the
    transcript so far plus the block, one request per row and block); with the sampling top_k inside the server's
    top-k the transcripts are the in-process teacher's, token for token."""
    from functools import partial

    from lightning_gkd.samplers import SpeculativeKDSampler

    model, tokenizer = toy_tools
    rows = tool_rows("test", 4)
    sampling = {
        "sampler": partial(SpeculativeKDSampler, accept_top_k=5, draft_tokens=4),
        "max_new_tokens": 24,
        "top_k": 5,
    }
    outs = []
    for teacher in ({"kind": "local", "model": model}, {"kind": "server", "url": server.url, "top_k": 20, **FAST}):
        module = GKDModule(
            load_student(tokenizer), teacher, tokenizer, lmbda=1.0, rollout=TOOLS_ROLLOUT, sampling=sampling
        )
        collator = ChatMLCollator(
            tokenizer,
            columns=["facts"],
            carry_prompt_messages=True,
            tools=module.rollout.tools,
            first_turn_prompts=True,
        )
        student = module.student.eval()
        out, stats = module.rollout.run(
            lambda i, m, s, module=module, student=student: module.sampler.sample(student, i, m, seed=s),
            collator(rows),
            seed=11,
        )
        outs.append((out, stats, module.sampler.last_stats()))
        module.teardown("fit")
    (local, local_stats, local_figures), (served, served_stats, served_figures) = outs
    assert torch.equal(local["input_ids"], served["input_ids"]) and torch.equal(local["labels"], served["labels"])
    assert local_stats.turns == served_stats.turns and sum(served_stats.turns) > len(rows)  # several turns each
    assert served_figures["replacement_rate"] == local_figures["replacement_rate"] > 0


def load_student(tokenizer):
    """The shipped student start of the toy tool task (it follows the tool protocol)."""
    from lightning_gkd.models.loading import load_causal_lm

    return load_causal_lm(asset_path("toy_tools/student_init"))
