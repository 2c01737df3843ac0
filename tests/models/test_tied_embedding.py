"""``sparse_tied_embedding_gradient``: a tied input embedding's gradient is its looked-up rows, added into the head's
dense gradient. Gradients and fused-AdamW weights equal torch's dense path bit for bit (qwen2, llama, gpt2; through
full logits and through the chunked hidden-state loss); untied, frozen, LoRA'd and custom embeddings keep theirs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.fitting import fit
from helpers.launch import clean_env
from helpers.paths import HELPERS
from helpers.tiny_registry import build_tiny, tiny_config
from torch import nn

from lightning_gkd import GKDModule
from lightning_gkd.models.tied_embedding import RowsGradientEmbedding, sparse_tied_embedding_gradient
from lightning_gkd.ops.divergence.chunked_jsd import projected_jsd_loss
from lightning_gkd.ops.hf.forward import position_ids_from_mask
from lightning_gkd.ops.hf.heads import hidden_states_and_head
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

VOCAB = 96
WORKER = HELPERS / "tied_embedding_worker.py"
FAMILIES = ["qwen2", "llama", "gpt2"]


def tied_model(model_type: str, tie: bool = True) -> nn.Module:
    model = build_tiny(tiny_config(model_type, VOCAB, tie_word_embeddings=tie), seed=0)
    same = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert same == tie, model_type
    return model


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 20, (2, 12), generator=generator)  # few distinct ids: many repeats
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding with the pad id (the padding_idx of qwen2/llama)
    return ids, mask


def logits_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    keep = mask[:, 1:].bool()
    return F.cross_entropy(logits[:, :-1][keep].float(), ids[:, 1:][keep])


def chunked_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = mask.bool()
    hidden, head = hidden_states_and_head(model, ids, mask, positions)
    generator = torch.Generator().manual_seed(7)
    teacher_hidden = torch.randn(hidden.shape[0], 16, generator=generator)
    teacher_weight = torch.randn(head.weight.shape[0], 16, generator=generator)
    return projected_jsd_loss(hidden, head, teacher_hidden, teacher_weight, chunk_size=5)


def train(model: nn.Module, loss_fn) -> list[dict[str, torch.Tensor]]:
    """Two fused AdamW steps (the second accumulates two micro-batches); each step's gradients, then the weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    torch.manual_seed(0)  # the same dropout masks (gpt2 drops out) for both paths
    seen = []
    for step_batches in ([0], [1, 2]):
        optimizer.zero_grad()
        for seed in step_batches:
            loss_fn(model, *batch(seed)).backward()
        seen.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    seen.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return seen


@pytest.mark.parametrize("loss_fn", [logits_loss, chunked_loss], ids=["logits", "chunked"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_gradients_and_fused_adamw_weights_equal_the_dense_path(model_type, loss_fn):
    base = tied_model(model_type)
    dense, rows = copy.deepcopy(base), copy.deepcopy(base)
    assert sparse_tied_embedding_gradient(rows)
    assert type(rows.get_input_embeddings()) is RowsGradientEmbedding
    expected, got = train(dense, loss_fn), train(rows, loss_fn)
    for want, have in zip(expected, got, strict=True):
        assert want.keys() == have.keys()
        for name in want:
            assert not have[name].is_sparse, name
            assert torch.equal(have[name], want[name]), name
    embedding = got[0][next(n for n, p in rows.named_parameters() if p is rows.get_input_embeddings().weight)]
    assert embedding.abs().sum() > 0


def test_without_the_head_the_gradient_is_made_dense():
    """A backward through the embedding alone: the hook turns the sparse rows into the dense ``.grad``."""
    model = tied_model("qwen2")
    dense = copy.deepcopy(model)
    assert sparse_tied_embedding_gradient(model)
    ids = batch(0)[0]
    for m in (model, dense):
        m.get_input_embeddings()(ids).pow(2).sum().backward()
    got, want = model.get_input_embeddings().weight.grad, dense.get_input_embeddings().weight.grad
    assert not got.is_sparse and torch.equal(got, want)


def test_untied_frozen_and_custom_embeddings_keep_their_path():
    untied = tied_model("qwen2", tie=False)
    assert not sparse_tied_embedding_gradient(untied)
    assert type(untied.get_input_embeddings()) is nn.Embedding
    logits_loss(untied, *batch(0)).backward()
    assert untied.get_input_embeddings().weight.grad.layout == torch.strided

    frozen = tied_model("qwen2")
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert not sparse_tied_embedding_gradient(frozen)
    logits_loss(frozen, *batch(0)).backward()
    assert frozen.get_input_embeddings().weight.grad is None

    class Scaled(nn.Embedding):  # e.g. Gemma's scaled word embedding: its own forward
        def forward(self, input):
            return super().forward(input) * 2.0

    custom = tied_model("qwen2")
    custom.get_input_embeddings().__class__ = Scaled
    assert not sparse_tied_embedding_gradient(custom)
    assert type(custom.get_input_embeddings()) is Scaled


def test_a_lora_student_keeps_its_path():
    pytest.importorskip("peft")
    from lightning_gkd.models.lora import apply_lora

    model = apply_lora(tied_model("qwen2"), {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"})
    assert not sparse_tied_embedding_gradient(model)  # the tied weight is frozen: only adapters train
    assert type(model.get_input_embeddings()) is nn.Embedding


def test_the_module_makes_it_and_trains_to_the_same_weights(tokenizer, toy_rows, tmp_path):
    """GKD on dataset completions (lmbda = 0: the chunked hidden-state loss), 3 steps of the default fused AdamW
    under a real Trainer: the same weights as with torch's dense embedding gradient."""
    student = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)
    teacher = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)
    states = []
    for lever in (True, False):
        torch.manual_seed(0)
        module = GKDModule(copy.deepcopy(student), teacher, tokenizer, lmbda=0.0, divergence={"beta": 0.5})
        embedding = module.model.get_input_embeddings()
        assert type(embedding) is RowsGradientEmbedding
        if not lever:
            embedding.__class__ = nn.Embedding  # torch's dense path
        fit(module, tokenizer, toy_rows, tmp_path / str(lever), max_steps=3)
        states.append({name: p.detach().clone() for name, p in module.model.named_parameters()})
    rows, dense = states
    assert rows.keys() == dense.keys()
    for name in rows:
        assert torch.equal(rows[name], dense[name]), name
    assert not torch.equal(rows["model.embed_tokens.weight"], student.model.embed_tokens.weight)  # it trained


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_train_to_the_same_weights(kind, tmp_path):
    """DDP and FSDP2 (ModelParallelStrategy), 2 gloo processes, fused AdamW: the same trained weights with the rows
    gradient (the default) as with torch's dense path."""
    out = tmp_path / "run"
    command = [sys.executable, str(WORKER), str(out), kind]
    done = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    strategy = {"ddp": "DDPStrategy", "fsdp": "ModelParallelStrategy"}[kind]
    assert result["world_size"] == 2 and result["strategy"] == strategy
    assert result["embedding"] == "RowsGradientEmbedding" and result["fused"]
    assert result["names_equal"] and result["unequal"] == [] and result["max_abs_diff"] == 0.0
    assert result["embedding_change"] > 1e-5  # the tied weight trained


@pytest.mark.parametrize("loss_fn", [logits_loss, chunked_loss], ids=["logits", "chunked"])
def test_the_rows_are_added_without_a_vocabulary_sized_zero_fill(loss_fn):
    """The backward makes no zero-filled (V, H) tensor for the embedding. With the chunked loss (the head's gradient
    contiguous) the rows go in place into it, no (V, H) tensor at all; HF's lm_head hands a transposed gradient,
    which autograd sums out of place (as it does today), and the rows go into that sum."""
    model = tied_model("qwen2")
    assert sparse_tied_embedding_gradient(model)
    loss = loss_fn(model, *batch(0))
    shape = str(list(model.get_input_embeddings().weight.shape))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        loss.backward()
    vocabulary_sized = {
        event.key for event in profiler.key_averages(group_by_input_shape=True) if shape in str(event.input_shapes)
    }
    assert not vocabulary_sized & {"aten::zeros", "aten::fill_", "aten::zero_", "aten::embedding_dense_backward"}
    assert "aten::index_add_" in vocabulary_sized  # the rows, into the head's gradient
    if loss_fn is chunked_loss:
        assert "aten::add" not in vocabulary_sized and "aten::add_" in vocabulary_sized


def test_autograd_grad_and_a_deep_copy_get_the_whole_gradient():
    """Where the weight's AccumulateGrad node does not run (autograd.grad) or is not the hooked one (a deep copy),
    the rows come as a sparse gradient: still the dense path's values."""
    model = tied_model("qwen2")
    dense = copy.deepcopy(model)
    assert sparse_tied_embedding_gradient(model)
    weight, dense_weight = model.get_input_embeddings().weight, dense.get_input_embeddings().weight
    (got,) = torch.autograd.grad(logits_loss(model, *batch(0)), [weight])
    (want,) = torch.autograd.grad(logits_loss(dense, *batch(0)), [dense_weight])
    assert torch.equal(got.to_dense() if got.is_sparse else got, want)
    copied = copy.deepcopy(model)
    assert type(copied.get_input_embeddings()) is RowsGradientEmbedding
    logits_loss(copied, *batch(0)).backward()
    assert torch.equal(copied.get_input_embeddings().weight.grad, want)
    logits_loss(model, *batch(0)).backward()  # the original still takes the in-place path afterwards
    assert torch.equal(weight.grad, want)
