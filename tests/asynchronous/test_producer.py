"""Asynchronous rollouts with the in-process engine (a copy of the student sampled by the KV-cache decoder): the
producer's samples are those of the weights ``max_staleness`` steps old, exactly, and at 0 the run is the
synchronous one."""

from __future__ import annotations

import copy
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import logged, make_module, small_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gkd import AsyncSettings, ChatDataModule
from lightning_gkd.asynchronous import InProcessEngine, Produced, StalenessLedger, WeightSnapshot
from lightning_gkd.ops.decoding.sampling import derive_seed
from lightning_gkd.samplers import KVCacheSampler


class Recorded(L.Callback):
    """The student's weights before the first step and after each, and each step's training batch."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = [copy.deepcopy(pl_module.student.state_dict())]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.weights.append(copy.deepcopy(pl_module.student.state_dict()))


def record_batches(module, recorded: Recorded) -> None:
    training_loss = module.training_loss

    def recording(batch):
        recorded.batches.append({k: v.detach().clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return training_loss(batch)

    module.training_loss = recording


def async_fit(
    student,
    teacher,
    tokenizer,
    rows,
    root,
    *,
    max_staleness,
    engine=True,
    steps=4,
    lmbda=1.0,
    asynchronous_engine=None,
    **kwargs,
):
    engine_factory = asynchronous_engine or InProcessEngine
    settings = {"max_staleness": max_staleness, "engine": engine_factory} if engine else None
    module = make_module(student, teacher, tokenizer, lmbda=lmbda, asynchronous=settings, **kwargs)
    recorded = Recorded()
    record_batches(module, recorded)
    datamodule = ChatDataModule(tokenizer, rows["train"], batch_size=4, max_length=64)
    trainer = small_trainer(root, csv=True, max_steps=steps, callbacks=[recorded])
    trainer.fit(module, datamodule=datamodule)
    return module, recorded


def test_staleness_zero_trains_exactly_like_synchronous_sampling(student, teacher, tokenizer, toy_rows, tmp_path):
    twin = copy.deepcopy(student)
    sync, sync_record = async_fit(
        student, teacher, tokenizer, toy_rows, tmp_path / "sync", max_staleness=0, engine=False, lmbda=0.5
    )
    produced, produced_record = async_fit(
        twin, teacher, tokenizer, toy_rows, tmp_path / "async", max_staleness=0, lmbda=0.5
    )
    assert logged(tmp_path / "async", "train/on_policy") == logged(tmp_path / "sync", "train/on_policy")
    assert 0 < sum(logged(tmp_path / "sync", "train/on_policy")) < 4  # both sources among the steps
    for ours, theirs in zip(produced_record.batches, sync_record.batches, strict=True):
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert logged(tmp_path / "async", "train/loss") == logged(tmp_path / "sync", "train/loss")
    for name, value in sync.student.state_dict().items():
        assert torch.equal(produced.student.state_dict()[name], value), name
    assert set(logged(tmp_path / "async", "train/async/staleness")) == {0.0}


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_each_batch_is_sampled_with_the_weights_of_max_staleness_steps_before(
    student, teacher, tokenizer, toy_rows, tmp_path, max_staleness
):
    module, recorded = async_fit(student, teacher, tokenizer, toy_rows, tmp_path, max_staleness=max_staleness)
    ages = logged(tmp_path, "train/async/staleness")
    assert ages == [float(min(step, max_staleness)) for step in range(4)]
    # replay: batch j sampled by the KV-cache decoder from the weights after step j - k, with the same seed
    datamodule = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64)
    datamodule.setup("fit")
    loader = iter(datamodule.train_dataloader())
    sampler = KVCacheSampler(tokenizer, max_new_tokens=6, temperature=0.9)
    replica = copy.deepcopy(student)
    for step in range(4):
        batch = next(loader)
        replica.load_state_dict(recorded.weights[max(0, step - max_staleness)])
        seed = derive_seed(module.training_settings.seed, 0, step, 1, 0)  # epoch 0, batch, on_policy._SAMPLE, rank
        expected = sampler.sample(replica, batch["prompts"], batch["prompt_attention_mask"], seed=seed)
        assert torch.equal(recorded.batches[step]["input_ids"], expected["input_ids"]), step
        assert torch.allclose(recorded.batches[step]["sampled_logprobs"], expected["sampled_logprobs"])
    assert logged(tmp_path, "train/async/dropped")[-1] == 0.0
    assert logged(tmp_path, f"train/async/staleness/{max_staleness}")[-1] == 4 - max_staleness


def test_the_ledger_drops_and_counts_samples_older_than_the_bound():
    ledger = StalenessLedger(max_staleness=1)
    assert ledger.accept(Produced({}, version=3, seconds=0.0), version=4)
    assert not ledger.accept(Produced({}, version=2, seconds=0.0), version=4)
    assert ledger.accept(Produced({}, version=4, seconds=0.0), version=4)
    figures = ledger.figures()
    assert figures["dropped"] == 1.0
    assert figures["staleness/0"] == figures["staleness/1"] == 1.0
    assert figures["staleness_mean"] == 0.5


def test_a_weight_snapshot_is_one_flat_buffer_per_dtype_and_reads_back(student):
    snapshot = WeightSnapshot.take(student, 7, shared=True)
    assert snapshot.version == 7 and list(snapshot.buffers) == ["torch.float32"]
    assert snapshot.buffers["torch.float32"].is_shared()
    names = dict(student.named_parameters())
    assert [name for name, _ in snapshot.tensors()] == list(names)
    for name, tensor in snapshot.tensors():
        assert torch.equal(tensor, names[name])
    assert snapshot.nbytes == sum(p.numel() * 4 for p in names.values())
    with torch.no_grad():
        next(iter(names.values())).add_(1.0)  # a copy: the snapshot does not follow the live weights
    assert not torch.equal(next(snapshot.tensors())[1], next(iter(names.values())))


def test_settings_refuse_a_staleness_without_an_engine_and_negative_ones():
    with pytest.raises(ValueError, match="needs an engine to sample ahead with"):
        AsyncSettings(max_staleness=1)
    with pytest.raises(ValueError, match="integer >= 0"):
        AsyncSettings(max_staleness=-1, engine=InProcessEngine)
    assert not AsyncSettings().enabled and AsyncSettings(engine=partial(InProcessEngine)).enabled


def test_grouped_generation_is_refused_with_a_staleness(student, teacher, tokenizer, toy_rows, tmp_path):
    module = make_module(
        student, teacher, tokenizer, lmbda=1.0, asynchronous={"max_staleness": 1, "engine": InProcessEngine}
    )
    datamodule = ChatDataModule(tokenizer, toy_rows["train"], batch_size=2, steps_per_generation=2, max_length=64)
    with pytest.raises(ValueError, match="data.steps_per_generation=1"):
        small_trainer(tmp_path, max_steps=1).fit(module, datamodule=datamodule)


def test_a_resume_samples_the_batches_in_flight_again_from_the_restored_weights(
    student, teacher, tokenizer, toy_rows, tmp_path
):
    """Nothing in flight is checkpointed: the resumed run hands the producer its first batch and the next again, with
    the restored weights, so batch 2 trains on fresh samples (staleness 0) drawn with its own seed."""
    datamodule = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64)
    settings = {"max_staleness": 1, "engine": InProcessEngine}
    first = make_module(student, teacher, tokenizer, lmbda=1.0, asynchronous=settings)
    every_two = ModelCheckpoint(tmp_path / "ckpt", filename="two", every_n_train_steps=2, save_top_k=-1)
    small_trainer(tmp_path / "a", csv=True, max_steps=2, enable_checkpointing=True, callbacks=[every_two]).fit(
        first, datamodule=datamodule
    )
    resumed = make_module(copy.deepcopy(student), teacher, tokenizer, lmbda=1.0, asynchronous=settings)
    recorded = Recorded()
    record_batches(resumed, recorded)
    datamodule = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64)
    small_trainer(tmp_path / "b", csv=True, max_steps=4, callbacks=[recorded]).fit(
        resumed, datamodule=datamodule, ckpt_path=tmp_path / "ckpt" / "two.ckpt", weights_only=False
    )
    assert logged(tmp_path / "a", "train/async/staleness") == [0.0, 1.0]
    assert logged(tmp_path / "b", "train/async/staleness") == [0.0, 1.0]
    replica = copy.deepcopy(student)
    replica.load_state_dict(recorded.weights[0])  # the restored weights, after step 2
    fresh = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64)
    fresh.setup("fit")
    batches = list(fresh.train_dataloader())
    seed = derive_seed(resumed.training_settings.seed, 0, 2, 1, 0)
    sampler = KVCacheSampler(tokenizer, max_new_tokens=6, temperature=0.9)
    expected = sampler.sample(replica, batches[2]["prompts"], batches[2]["prompt_attention_mask"], seed=seed)
    assert torch.equal(recorded.batches[0]["input_ids"], expected["input_ids"])


def test_a_checkpoint_loads_into_a_synchronous_module_unless_given_an_engine(
    student, teacher, tokenizer, toy_rows, tmp_path
):
    module, _ = async_fit(student, teacher, tokenizer, toy_rows, tmp_path, max_staleness=1, steps=1)
    module.trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert "asynchronous" not in module.hparams
    loaded = type(module).load_from_checkpoint(
        tmp_path / "a.ckpt", student=student, teacher=teacher, tokenizer=tokenizer
    )
    assert loaded.rollout_engine is None and loaded.asynchronous.max_staleness == 0
    again = type(module).load_from_checkpoint(
        tmp_path / "a.ckpt",
        student=student,
        teacher=teacher,
        tokenizer=tokenizer,
        asynchronous={"max_staleness": 2, "engine": InProcessEngine},
    )
    assert isinstance(again.rollout_engine, InProcessEngine) and again.asynchronous.max_staleness == 2


def test_speculative_kd_samples_ahead_with_the_in_process_teacher(student, teacher, tokenizer, toy_rows, tmp_path):
    """producer=hf with sampler=skd: the engine's sampler is bound to the method's teacher, verifies the copy's drafts
    from the producer's thread, and its figures are logged with the step that trains on them."""
    from lightning_gkd.samplers import SpeculativeKDSampler

    engine = partial(InProcessEngine, sampler=partial(SpeculativeKDSampler, accept_top_k=5))
    module, recorded = async_fit(
        student, teacher, tokenizer, toy_rows, tmp_path, max_staleness=1, steps=3, asynchronous_engine=engine
    )
    assert module.rollout_engine.sampler.teacher is teacher
    rates = logged(tmp_path, "train/sampler/replacement_rate")
    assert len(rates) >= 3 and all(0.0 <= rate <= 1.0 for rate in rates)
    assert logged(tmp_path, "train/async/staleness")[-1] == 1.0
