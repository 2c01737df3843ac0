"""The hidden-state, chunked JSD equals generalized_jsd_loss on full logits (values and gradients, 1e-5), and its
extra memory does not grow with the number of positions."""

import weakref

import pytest
import torch
from helpers.sample_figures import reference_figures
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.ops.divergence import chunked_jsd
from lightning_gkd.ops.divergence.chunked_jsd import projected_jsd_loss
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss
from lightning_gkd.toy import addition_rows


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_equals_generalized_jsd_on_projected_logits(beta, temperature, chunk_size):
    torch.manual_seed(0)
    positions, student_dim, teacher_dim, vocab = 23, 16, 24, 50
    student_hidden = torch.randn(positions, student_dim, requires_grad=True)
    student_weight = torch.randn(vocab, student_dim, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(positions, teacher_dim), torch.randn(vocab, teacher_dim)

    expected = generalized_jsd_loss(
        student_hidden @ student_weight.T,
        teacher_hidden @ teacher_weight.T,
        labels=torch.zeros(positions, dtype=torch.long),
        beta=beta,
        temperature=temperature,
    )
    expected_grads = torch.autograd.grad(expected * 3.0, (student_hidden, student_weight))
    value = projected_jsd_loss(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        beta=beta,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    grads = torch.autograd.grad(value * 3.0, (student_hidden, student_weight))  # the incoming gradient scales
    torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_num_items_in_batch_divides_the_sum():
    torch.manual_seed(1)
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    mean = projected_jsd_loss(hidden, weight, hidden.flip(0), weight)
    total = projected_jsd_loss(hidden, weight, hidden.flip(0), weight, num_items_in_batch=1)
    torch.testing.assert_close(total, mean * 5)


def test_no_grad_path_and_bad_shapes():
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    with torch.no_grad():
        value = projected_jsd_loss(hidden, weight, hidden.detach(), weight.detach())
    assert value.requires_grad is False and float(value) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="positions"):
        projected_jsd_loss(hidden, weight, hidden[:3].detach(), weight.detach())
    with pytest.raises(ValueError, match="Vocabulary sizes differ"):
        projected_jsd_loss(hidden, weight, hidden.detach(), weight[:5].detach())


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and still alive (CPU has no allocator statistics)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes


def peak_bytes(loss_fn, positions, vocab=4000, dim=32):
    torch.manual_seed(2)
    hidden = torch.randn(positions, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    teacher = torch.randn(positions, dim)
    with PeakTensorBytes() as mode:
        loss_fn(hidden, weight, teacher).backward()
    return mode.peak


def test_extra_memory_is_bounded_by_the_chunk_not_the_positions():
    def full(hidden, weight, teacher):
        return generalized_jsd_loss(hidden @ weight.T, teacher @ weight.detach().T, beta=0.5)

    def lean(hidden, weight, teacher):
        return projected_jsd_loss(hidden, weight, teacher, weight.detach(), beta=0.5, chunk_size=64)

    logits_bytes = 1024 * 4000 * 4  # one float32 (positions x vocab) tensor
    assert peak_bytes(full, 1024) > 8 * logits_bytes  # measured: 13 logits-sized tensors alive at the peak
    lean_peak = peak_bytes(lean, 1024)
    assert lean_peak < logits_bytes  # measured: 0.7 of one (a couple of 64 x 4000 chunks' temporaries)
    assert peak_bytes(lean, 2048) < lean_peak * 1.3  # doubling the positions barely moves it


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_module_lean_loss_equals_the_full_logits_loss(student, teacher, tokenizer, beta):
    datamodule = ChatDataModule(tokenizer, addition_rows("train", 8), batch_size=8, max_length=64)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    results = []
    for lean in (True, False):
        module = GKDModule(
            student,
            teacher,
            tokenizer,
            divergence={"beta": beta, "lean_loss": lean, "loss_chunk_size": 5, "loss_temperature": 0.8},
        )
        student.zero_grad()
        loss = module.distillation_loss(batch).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}))
    (lean_loss, lean_grads), (full_loss, full_grads) = results
    assert module.lean_path.enabled is False and float(lean_loss) > 0
    torch.testing.assert_close(lean_loss, full_loss, atol=1e-5, rtol=1e-5)
    for name, grad in full_grads.items():
        torch.testing.assert_close(lean_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_figures_ride_along_without_changing_the_loss(beta, temperature):
    """With ``figures``, each chunk's logits also give the sample figures (ops.sample_figures' float64 reference;
    at temperature 1, from the loss's own log-softmaxes, before it reuses their storage; at another loss
    temperature, from the logits): the loss and its gradients are those without them."""
    from lightning_gkd.ops.divergence.sample_figures import SampleFigures

    torch.manual_seed(3)
    positions, student_dim, teacher_dim, vocab = 19, 12, 16, 40
    student_hidden = torch.randn(positions, student_dim, requires_grad=True)
    student_weight = torch.randn(vocab, student_dim, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(positions, teacher_dim), torch.randn(vocab, teacher_dim)
    tokens = torch.randint(vocab, (positions,))

    def run(figures):
        value = projected_jsd_loss(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            beta=beta,
            temperature=temperature,
            chunk_size=6,
            figures=figures,
        )
        return value.detach(), torch.autograd.grad(value, (student_hidden, student_weight))

    figures = SampleFigures(tokens)
    with_figures, without = run(figures), run(None)
    assert torch.equal(with_figures[0], without[0])
    for got, want in zip(with_figures[1], without[1], strict=True):
        assert torch.equal(got, want)
    expected = reference_figures(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, tokens)
    got = {name: value.item() for name, (value, _) in figures.means().items()}
    assert got == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("teacher_dtype", [torch.float32, torch.bfloat16])
def test_row_blocks_and_reused_buffers_with_uneven_last_chunk(monkeypatch, beta, temperature, teacher_dtype):
    """Chunks of 7 of 23 positions (the last has 2), each split into row blocks of at most 3 (3, 3, 1; then 2) that
    share the scratch buffers: equal to the full-logits loss, and a second call (fresh buffers) gives the same."""
    monkeypatch.setattr(chunked_jsd, "ROW_BLOCK_ELEMENTS", 3 * 50 + 10)
    torch.manual_seed(3)
    positions, vocab = 23, 50
    student_hidden = torch.randn(positions, 16, requires_grad=True)
    student_weight = torch.randn(vocab, 16, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(positions, 24).to(teacher_dtype), torch.randn(vocab, 24)
    teacher_weight = teacher_weight.to(teacher_dtype)
    expected = generalized_jsd_loss(
        student_hidden @ student_weight.T,
        (teacher_hidden @ teacher_weight.T).float(),
        labels=torch.zeros(positions, dtype=torch.long),
        beta=beta,
        temperature=temperature,
    )
    expected_grads = torch.autograd.grad(expected, (student_hidden, student_weight))
    for _ in range(2):
        value = projected_jsd_loss(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            beta=beta,
            temperature=temperature,
            chunk_size=7,
        )
        grads = torch.autograd.grad(value, (student_hidden, student_weight))
        torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_row_blocks_split_a_chunk_evenly(monkeypatch):
    monkeypatch.setattr(chunked_jsd, "ROW_BLOCK_ELEMENTS", 55 * 100)
    assert chunked_jsd._row_blocks(64, 100) == [slice(0, 32), slice(32, 64)]
    assert chunked_jsd._row_blocks(7, 100) == [slice(0, 7)]
    monkeypatch.setattr(chunked_jsd, "ROW_BLOCK_ELEMENTS", 10)  # less than a row: one row a block
    assert chunked_jsd._row_blocks(3, 100) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def test_a_second_backward_is_refused_with_a_clear_error():
    """The gradients are handed over (scaled in place) once; a retained graph's second backward says so."""
    torch.manual_seed(4)
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(5, 8), torch.randn(11, 8)
    loss = projected_jsd_loss(hidden, weight, teacher_hidden, teacher_weight, beta=0.5)
    (loss * 2).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call backward on it once"):
        loss.backward()
    once = torch.autograd.grad(projected_jsd_loss(hidden, weight, teacher_hidden, teacher_weight, beta=0.5), hidden)
    torch.testing.assert_close(hidden.grad, 2 * once[0])
