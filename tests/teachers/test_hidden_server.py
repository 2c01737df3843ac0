"""HiddenServerTeacher (lightning_gkd/teachers/hidden_server.py) against a fake vLLM pooling server (lightning_gkd/
testing/fake_vllm_server.py: vLLM 0.32's /pooling answer, states from a Hugging Face model): the states equal the
in-process teacher's, the dense losses (any β, and their student gradients) equal the in-process lean loss while
top-k's reverse KL does not, the probe's refusals, retries and an outage mid-run that checkpoints and resumes
exactly, and GKD / OPD / routed teachers through a plain Lightning Trainer. The real vLLM pooling server, on three
families: tests/teachers/test_hidden_server_vllm.py."""

from __future__ import annotations

import csv
import pickle
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, GKDModule, OPDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.losses.dense import DenseDistillation
from lightning_gkd.losses.settings import DivergenceSettings
from lightning_gkd.losses.sparse import TopKDistillation
from lightning_gkd.ops.hf.heads import output_head
from lightning_gkd.teachers import LocalTeacher, TeacherUnavailable, supervised_positions
from lightning_gkd.teachers.hidden_server import HiddenServerTeacher
from lightning_gkd.teachers.server import ServerTeacher
from lightning_gkd.teachers.spec import build_remote_teacher, teacher_plan
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer

FAST = {"retries": 2, "backoff": 0.01, "timeout": 10.0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture()
def served(teacher, tokenizer, tmp_path):
    """``(fake server, the teacher's folder)``: the fixture's tiny teacher saved and served."""
    folder = tmp_path / "teacher"
    teacher.save_pretrained(folder)
    with FakeVLLMServer(teacher, tokenizer, max_model_len=128) as fake:
        yield fake, folder


@pytest.fixture()
def batch(tokenizer, toy_rows) -> dict[str, torch.Tensor]:
    collated = ChatMLCollator(tokenizer, max_length=64)(toy_rows["train"][:6])
    assert collated["attention_mask"].sum(1).unique().numel() > 1  # uneven rows
    return collated


def hidden_teacher(fake: FakeVLLMServer, folder, **kwargs) -> HiddenServerTeacher:
    return HiddenServerTeacher(fake.url, head=str(folder), **{**FAST, **kwargs})


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 2e-2), ("float16", 2e-3)])
def test_served_states_equal_the_in_process_teachers(served, teacher, tokenizer, batch, dtype, tolerance):
    fake, folder = served
    positions = supervised_positions(batch["labels"])
    ours = hidden_teacher(fake, folder, dtype=dtype, concurrency=3)
    ours.check(tokenizer, teacher.config.vocab_size)
    hidden, head = ours.hidden_states(batch, positions)
    expected, expected_head = LocalTeacher(teacher).hidden_states(batch, positions)
    assert hidden.shape == expected.shape == (int(positions.sum()), teacher.config.hidden_size)
    scale = float(expected.abs().max())
    assert float((hidden - expected).abs().max()) <= tolerance * max(scale, 1.0)
    assert torch.equal(head.weight, expected_head.weight) and head.softcap is None and head.scale == 1.0
    per_token = 2 if dtype != "float32" else 4
    assert ours.payload_bytes == per_token * teacher.config.hidden_size * ours.payload_tokens
    ours.close()


def copy_of(model: torch.nn.Module) -> torch.nn.Module:
    twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict())
    return twin


def loss_and_grads(loss_object, student, batch):
    student.zero_grad(set_to_none=True)
    out = loss_object(student, batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_dense_loss_from_served_states_equals_the_in_process_lean_loss(
    served, student, teacher, tokenizer, batch, beta
):
    fake, folder = served
    served_teacher = hidden_teacher(fake, folder, dtype="float32")
    divergence = DivergenceSettings(beta=beta)
    local_loss, local_grads = loss_and_grads(DenseDistillation(LocalTeacher(teacher), divergence), student, batch)
    served_loss, served_grads = loss_and_grads(DenseDistillation(served_teacher, divergence), student, batch)
    torch.testing.assert_close(served_loss, local_loss, rtol=1e-5, atol=1e-6)
    assert local_grads.keys() == served_grads.keys() and local_grads
    for name, grad in local_grads.items():
        torch.testing.assert_close(served_grads[name], grad, rtol=1e-4, atol=1e-6)
    served_teacher.close()


def test_reverse_kl_from_served_states_is_exact_where_top_k_is_not(served, student, teacher, tokenizer, batch):
    """β = 1 (reverse KL, over the student's whole distribution): the hidden-state server gives the in-process value;
    a top-k server (k = 5, a tail bucket) does not."""
    fake, folder = served
    with torch.no_grad():
        reverse_kl = DivergenceSettings(beta=1.0)  # sparse_loss="topk": the top-k with a tail bucket
        local = DenseDistillation(LocalTeacher(teacher), reverse_kl)(student, batch).loss
        hidden = DenseDistillation(hidden_teacher(fake, folder, dtype="float32"), reverse_kl)(student, batch).loss
        topk = TopKDistillation(ServerTeacher(fake.url, top_k=5, **FAST), reverse_kl)(student, batch).loss
    assert float((hidden - local).abs()) < 1e-5 * float(local)
    assert float((topk - local).abs()) > 0.01 * float(local)  # the top-k approximation's gap


def test_the_probe_refuses_what_it_cannot_train_with(served, teacher, tokenizer, tmp_path):
    fake, folder = served
    with pytest.raises(ValueError, match="student's vocabulary has 300 tokens"):
        hidden_teacher(fake, folder).check(tokenizer, 300)
    other = copy_of(teacher)
    config = other.config
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 32, 64, 2
    config.num_key_value_heads = 2
    smaller = type(teacher)(config)
    smaller.save_pretrained(tmp_path / "smaller")
    with pytest.raises(ValueError, match="answers states of 128 features, but the head .* takes 32"):
        hidden_teacher(fake, tmp_path / "smaller").check(tokenizer, teacher.config.vocab_size)
    fake.normalize = True
    try:
        with pytest.raises(ValueError, match="L2-normalised.*use_activation"):
            hidden_teacher(fake, folder).check(tokenizer, teacher.config.vocab_size)
    finally:
        fake.normalize = False


def test_a_server_without_pooling_is_named_with_the_command_to_start_one(served, tokenizer, teacher):
    fake, folder = served
    original = fake.answer
    fake.answer = lambda method, path, body: (  # a generative server: no /pooling route
        (404, {"detail": "Not Found"}) if path == "/pooling" else original(method, path, body)
    )
    with pytest.raises(ValueError, match="--runner pooling --convert embed"):
        hidden_teacher(fake, folder).check(tokenizer, teacher.config.vocab_size)


def test_the_served_model_name_is_the_head_folder_when_it_is_one(teacher, tokenizer, tmp_path, batch):
    folder = tmp_path / "teacher"
    teacher.save_pretrained(folder)
    with FakeVLLMServer(teacher, tokenizer, name=str(folder), max_model_len=128) as fake:
        served = HiddenServerTeacher(fake.url, **FAST)
        served.check(tokenizer, teacher.config.vocab_size)
        assert torch.equal(served.head.weight, output_head(teacher).weight)
    with FakeVLLMServer(teacher, tokenizer, name="org/teacher", max_model_len=128) as fake:
        with pytest.raises(ValueError, match="not a local folder: give the teacher's weights .* teacher.head="):
            HiddenServerTeacher(fake.url, **FAST).check(tokenizer, teacher.config.vocab_size)


def test_transient_failures_are_retried_and_a_dead_server_is_unavailable(served, batch):
    fake, folder = served
    positions = supervised_positions(batch["labels"])
    served_teacher = hidden_teacher(fake, folder, dtype="float32", concurrency=2)
    expected = served_teacher.hidden_states(batch, positions)[0]
    fake.fail_next(2, 503)
    torch.testing.assert_close(served_teacher.hidden_states(batch, positions)[0], expected)
    copy = pickle.loads(pickle.dumps(served_teacher))  # a spawned DDP worker's copy: the head is read again
    assert copy._head is None
    torch.testing.assert_close(copy.hidden_states(batch, positions)[0], expected)
    fake.stop()
    with pytest.raises(TeacherUnavailable, match="--runner pooling"):
        served_teacher.hidden_states(batch, positions)


def test_teacher_specs_with_signal_hidden(served):
    fake, folder = served
    spec = {"kind": "server", "url": fake.url, "signal": "hidden", "head": str(folder), "dtype": "float16"}
    plan = teacher_plan(spec)
    assert plan.all_dense
    built = build_remote_teacher(plan.entries[""])
    assert isinstance(built, HiddenServerTeacher) and built.dtype == "float16"
    with pytest.raises(ValueError, match="signal=hidden gives the teacher's full distributions.*top_k=null"):
        teacher_plan({**spec, "top_k": 20})
    with pytest.raises(ValueError, match="dtype, head are read only with signal=hidden"):
        teacher_plan({"kind": "server", "url": fake.url, "head": "x", "dtype": "float32"})
    with pytest.raises(ValueError, match="signal must be one of topk, hidden"):
        teacher_plan({**spec, "signal": "logits"})
    with pytest.raises(ValueError, match="wire dtype"):
        HiddenServerTeacher(fake.url, dtype="int8")


# -- through a plain Lightning Trainer -------------------------------------------------------------------------------


def fit(module, tokenizer, rows, root, max_steps=3, ckpt_path=None, callbacks=()):
    datamodule = ChatDataModule(tokenizer, rows["train"], rows["val"], batch_size=4, max_length=64)
    trainer = small_trainer(
        root,
        csv=True,
        max_steps=max_steps,
        val_check_interval=max_steps,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_checkpointing=True,  # a test resumes from the checkpoint
        callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    return trainer


def logged(root, key):
    with open(root / "metrics.csv") as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]


def served_spec(fake, folder):
    return {"kind": "server", "url": fake.url, "signal": "hidden", "head": str(folder), "dtype": "float32", **FAST}


@pytest.mark.parametrize("method", ["gkd", "opd"])
def test_on_policy_training_with_the_served_teacher_equals_the_in_process_one(
    method, served, student, teacher, tokenizer, toy_rows, tmp_path
):
    """λ = 0.5 and β = 0.5 (GKD), OPD with its kl_coef term: the same losses step by step and the same validation
    loss as with the teacher in process."""
    fake, folder = served
    if method == "gkd":
        build = partial(GKDModule, lmbda=0.5, divergence={"beta": 0.5})
    else:
        build = partial(OPDModule, policy_gradient={"kl_coef": 0.5})
    common = {"sampling": {"max_new_tokens": 6}, "validation": {"metrics": {}}}
    optimizer = partial(torch.optim.AdamW, lr=1e-2)
    # the in-process teacher in float32, as the server runs it (auto would make it bf16 on a CPU with fast bf16)
    local = build(
        copy_of(student), teacher, tokenizer, training={"optimizer": optimizer, "frozen_dtype": "float32"}, **common
    )
    fit(local, tokenizer, toy_rows, tmp_path / "local")
    remote = build(copy_of(student), served_spec(fake, folder), tokenizer, training={"optimizer": optimizer}, **common)
    assert remote.teacher is None and isinstance(remote.teacher_source, HiddenServerTeacher)
    fit(remote, tokenizer, toy_rows, tmp_path / "remote")
    for key in ("train/loss", "val/loss"):
        assert logged(tmp_path / "remote", key) == pytest.approx(logged(tmp_path / "local", key), rel=1e-4, abs=1e-6)
    assert len(logged(tmp_path / "remote", "train/loss")) == 3


def test_routed_teachers_mix_local_top_k_and_hidden(served, student, teacher, tokenizer, toy_rows, tmp_path):
    fake, folder = served
    names = ("local", "topk", "hidden")
    rows = {
        split: [{**row, "teacher": names[i % 3]} for i, row in enumerate(toy_rows[split])] for split in ("train", "val")
    }
    spec = {
        "kind": "multi",
        "column": "teacher",
        "teachers": {
            "local": {"kind": "local", "model": teacher},
            "topk": {"kind": "server", "url": fake.url, "top_k": 5, **FAST},
            "hidden": served_spec(fake, folder),
        },
    }
    module = GKDModule(
        student,
        spec,
        tokenizer,
        lmbda=0.0,
        sampling={"max_new_tokens": 6},
        divergence={"beta": 0.5},
        validation={"metrics": {}},
    )
    fit(module, tokenizer, rows, tmp_path / "multi", max_steps=2)
    for name in names:
        assert sum(logged(tmp_path / "multi", f"train/teacher/{name}/tokens")) > 0


class StopServerAfter(L.Callback):
    def __init__(self, fake: FakeVLLMServer, step: int) -> None:
        self.fake, self.step = fake, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.fake.stop()


def test_the_server_killed_mid_run_checkpoints_and_the_resumed_run_is_exact(
    teacher, student, tokenizer, toy_rows, tmp_path
):
    folder = tmp_path / "teacher"
    teacher.save_pretrained(folder)
    common = {
        "lmbda": 0.0,
        "divergence": {"beta": 0.5},
        "sampling": {"max_new_tokens": 6},
        "validation": {"metrics": {}},
    }
    with FakeVLLMServer(teacher, tokenizer, max_model_len=128) as fake:
        whole = GKDModule(copy_of(student), served_spec(fake, folder), tokenizer, **common)
        fit(whole, tokenizer, toy_rows, tmp_path / "whole", max_steps=5)
    fake = FakeVLLMServer(teacher, tokenizer, max_model_len=128).start()
    broken = GKDModule(copy_of(student), served_spec(fake, folder), tokenizer, **common)
    with pytest.raises(TeacherUnavailable):
        fit(broken, tokenizer, toy_rows, tmp_path / "broken", max_steps=5, callbacks=[StopServerAfter(fake, 2)])
    saved = next((tmp_path / "broken").glob("**/checkpoints/last.ckpt"))
    assert torch.load(saved, weights_only=True)["global_step"] == 2
    with FakeVLLMServer(teacher, tokenizer, max_model_len=128) as restarted:  # a new server, a new port
        resumed = GKDModule(copy_of(student), served_spec(restarted, folder), tokenizer, **common)
        fit(resumed, tokenizer, toy_rows, tmp_path / "resumed", max_steps=5, ckpt_path=saved)
    losses = logged(tmp_path / "broken", "train/loss") + logged(tmp_path / "resumed", "train/loss")
    assert losses == pytest.approx(logged(tmp_path / "whole", "train/loss"), rel=1e-5)
    final = dict(whole.student.named_parameters())
    assert all(torch.allclose(p, final[n], atol=1e-6) for n, p in resumed.student.named_parameters())
