"""ServerTeacher and ServerSampler (lightning_gkd/teachers/server.py) against a fake vLLM server (lightning_gkd/testing/
fake_vllm_server.py: vLLM 0.32's JSON, log-probs from the shipped toy teacher): the signal equals LocalTeacher's, the
retries and the probe's errors, the sampler's contract. The real server: tests/teachers/test_server_vllm.py."""

from __future__ import annotations

import copy
import math
import pickle
import socket
import time

import pytest
import torch
from helpers.padded_vocab import pad_vocabulary
from transformers import AutoModelForCausalLM

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.ops.decoding.sampling import generate_completions, sampling_logits
from lightning_gkd.ops.divergence.sparse_kd import MASKED_ID, topk_distillation_loss
from lightning_gkd.ops.hf.forward import position_ids_from_mask
from lightning_gkd.ops.hf.heads import hidden_states_and_head
from lightning_gkd.teachers import LocalTeacher, supervised_positions
from lightning_gkd.teachers.http import TeacherRequestError
from lightning_gkd.teachers.server import ServerSampler, ServerTeacher, TeacherUnavailable
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

FAST = {"retries": 3, "backoff": 0.01, "timeout": 10.0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def toy():
    path = asset_path("toy/teacher")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, load_tokenizer(path)


@pytest.fixture(scope="module")
def server(toy):
    with FakeVLLMServer(*toy) as fake:
        yield fake


@pytest.fixture()
def fake(server):
    server.reset()
    yield server
    server.reset()


@pytest.fixture(scope="module")
def batch(toy) -> dict[str, torch.Tensor]:
    """Real collated rows of uneven lengths (left-padded)."""
    collated = ChatMLCollator(toy[1], max_length=64)(addition_rows(split="val")[:6])
    assert collated["attention_mask"].sum(1).unique().numel() > 1
    return collated


def teacher_for(fake: FakeVLLMServer, **kwargs) -> ServerTeacher:
    return ServerTeacher(fake.url, **{"top_k": 20, **FAST, **kwargs})


def assert_same_signal(ours, reference) -> None:
    assert torch.equal(ours.ids, reference.ids)
    assert ours.ids.dtype == torch.long and ours.logprobs.dtype == ours.next_logprobs.dtype == torch.float32
    torch.testing.assert_close(ours.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.next_logprobs, reference.next_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_topk_equals_the_local_teacher_on_collated_rows(k, toy, fake, batch):
    positions = supervised_positions(batch["labels"])
    teacher = teacher_for(fake, top_k=k, concurrency=3)
    try:
        teacher.check(toy[1], 259)
        ours = teacher.topk(batch, positions)
    finally:
        teacher.close()
    assert ours.ids.shape == (int(positions.sum()), k)
    assert_same_signal(ours, LocalTeacher(toy[0], top_k=k).topk(batch, positions))
    assert fake.count("/v1/completions") == 6 + 2  # one per row, and check's two vocabulary probes


def test_topk_on_a_sampled_completion_batch(toy, fake, batch):
    """Completions with EOS and padding after it (attention 0 there), as the student's samples come."""
    model, tokenizer = toy
    sampled = generate_completions(
        model,
        batch["prompts"],
        batch["prompt_attention_mask"],
        max_new_tokens=8,
        pad_token_id=0,
        eos_token_id=2,
        temperature=1.5,
        seed=3,
    )
    assert (sampled["attention_mask"][:, -1] == 0).any()  # some rows ended early
    positions = supervised_positions(sampled["labels"])
    teacher = teacher_for(fake)
    ours = teacher.topk(sampled, positions)
    assert_same_signal(ours, LocalTeacher(model, top_k=20).topk(sampled, positions))
    empty = teacher.topk(sampled, torch.zeros_like(positions))
    assert empty.ids.shape == (0, 20) and empty.next_logprobs.shape == (0,)


def test_transient_failures_are_retried(toy, fake, batch):
    positions = supervised_positions(batch["labels"])
    reference = LocalTeacher(toy[0], top_k=20).topk(batch, positions)
    teacher = teacher_for(fake, concurrency=1)
    teacher.topk(batch, positions)  # resolves the model name first
    fake.reset()
    fake.fail_next(3, status=503)
    assert_same_signal(teacher.topk(batch, positions), reference)
    assert fake.count("/v1/completions") == 6 + 3
    fake.reset()
    fake.fail_next(1, status=429)
    fake.drop_next(2)  # connections closed without an answer
    assert_same_signal(teacher.topk(batch, positions), reference)
    assert fake.count("/v1/completions") == 6 + 3
    slow = teacher_for(fake, concurrency=1, timeout=0.3)
    slow.topk(batch, positions)
    fake.reset()
    fake.delay_next(1, 1.0)  # past the client's timeout
    assert_same_signal(slow.topk(batch, positions), reference)
    assert fake.count("/v1/completions") == 6 + 1


def test_a_server_that_stays_down_raises_teacher_unavailable_after_the_retries(toy, fake, batch):
    positions = supervised_positions(batch["labels"])
    teacher = teacher_for(fake, concurrency=1, retries=3, backoff=0.01)
    teacher.topk(batch, positions)
    fake.reset()
    fake.fail_next(100, status=503)
    with pytest.raises(TeacherUnavailable, match=r"after 4 attempt\(s\).*HTTP 503") as raised:
        teacher.topk(batch, positions)
    assert fake.url in str(raised.value) and "vllm.entrypoints.openai.api_server" in str(raised.value)
    assert fake.count("/v1/completions") == 4  # the first row's retries; the other rows were not sent


def test_a_stopped_server_fails_fast_for_every_row(toy, batch):
    """Connections refused: one row's retries decide for all (the others stop waiting), not retries per row."""
    with FakeVLLMServer(*toy) as fake:
        teacher = ServerTeacher(fake.url, top_k=20, concurrency=2, retries=3, backoff=0.2)
        teacher.topk(batch, supervised_positions(batch["labels"]))
    started = time.perf_counter()
    with pytest.raises(TeacherUnavailable, match="ConnectionRefusedError"):
        teacher.topk(batch, supervised_positions(batch["labels"]))
    assert time.perf_counter() - started < 2.8  # 0.2 + 0.4 + 0.8 s of backoff once, not for 3 waves of 2 rows
    teacher.close()


def test_a_client_error_is_not_retried(toy, fake, batch):
    teacher = teacher_for(fake, top_k=21)  # above the server's max-logprobs (20)
    with pytest.raises(TeacherRequestError, match="greater than max allowed: 20"):
        teacher.topk(batch, supervised_positions(batch["labels"]))
    assert fake.count("/v1/completions") <= teacher.server.concurrency


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_check_names_a_url_that_does_not_answer(toy):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TeacherUnavailable, match="did not answer GET /health") as raised:
        ServerTeacher(url, **FAST).check(toy[1], 259)
    message = str(raised.value)
    assert url in message and "Start it with: python -m vllm.entrypoints.openai.api_server" in message
    assert f"--port {url.rsplit(':', 1)[1]}" in message


def test_check_lists_the_served_models(toy):
    with FakeVLLMServer(*toy, served=["teacher-a", "teacher-b"], name="teacher-a") as fake:
        with pytest.raises(ValueError, match="does not serve teacher.model='nope'; it serves teacher-a, teacher-b"):
            ServerTeacher(fake.url, "nope", **FAST).check(toy[1], 259)
        with pytest.raises(ValueError, match=r"serves 2 models \(teacher-a, teacher-b\): name one"):
            ServerTeacher(fake.url, **FAST).check(toy[1], 259)
        named = ServerTeacher(fake.url + "/v1/", "teacher-a", **FAST)  # an OpenAI-style base URL is fine
        named.check(toy[1], 259)
        assert named.url == fake.url and named.max_model_len == 64


def test_check_finds_another_tokenizer(toy):
    def shifted(text: str, special: bool) -> list[int]:
        return [(i + 1) % 259 for i in toy[1](text, add_special_tokens=special)["input_ids"]]

    with FakeVLLMServer(*toy, tokenize=shifted) as fake:
        with pytest.raises(ValueError, match="tokenizes differently") as raised:
            ServerTeacher(fake.url, **FAST).check(toy[1], 259)
    ours = toy[1]("Hello", add_special_tokens=False)["input_ids"]
    message = str(raised.value)
    assert fake.url in message and str(ours)[1:-1] in message and str(shifted("Hello", False))[1:-1] in message


def test_check_refuses_a_served_vocabulary_smaller_than_the_students(toy):
    """The student could sample ids the teacher cannot score: refused (a larger one is accepted, below)."""
    with FakeVLLMServer(*toy, vocab_size=259) as fake:
        with pytest.raises(
            ValueError, match="rejects token id 299: its vocabulary is smaller than the student's 300"
        ) as raised:
            ServerTeacher(fake.url, **FAST).check(toy[1], 300)
        assert fake.url in str(raised.value)


def test_check_accepts_a_served_vocabulary_padded_past_the_students(toy):
    """A served model over the same tokenizer with more rows (as Qwen2.5-7B against 0.5B) is accepted: its ids past
    the student's vocabulary are masked in ``topk`` (test_a_padded_served_teacher_masks_its_padded_ids)."""
    with FakeVLLMServer(*toy, vocab_size=300) as fake:
        teacher = ServerTeacher(fake.url, **FAST)
        teacher.check(toy[1], 259)
        assert teacher.padded_vocabulary is True and teacher.vocab_size == 259
    with FakeVLLMServer(*toy) as fake:
        teacher = ServerTeacher(fake.url, **FAST)
        teacher.check(toy[1], 259)
        assert teacher.padded_vocabulary is False


@pytest.fixture(scope="module")
def padded(toy):
    """The toy teacher with its embedding and head padded from 259 to 300 rows, the new rows random at the spread of
    the real ones: they take a share of every top-20 (a trained model gives them ~0; here they must be masked)."""
    model = pad_vocabulary(copy.deepcopy(toy[0]), 300, seed=7, scale=1.5).eval()
    assert model.config.vocab_size == 300
    return model


def reference_kept(log_probs: torch.Tensor, k: int, vocab: int) -> list[tuple[list[int], list[float]]]:
    """Per position of ``log_probs`` ``(N, V_padded)``: the top-k ids below ``vocab`` and their log-probs."""
    values, ids = log_probs.topk(k, dim=-1)
    return [
        ([i for i in row_ids if i < vocab], [v for v, i in zip(row_values, row_ids, strict=True) if i < vocab])
        for row_values, row_ids in zip(values.tolist(), ids.tolist(), strict=True)
    ]


def test_a_padded_served_teacher_masks_its_padded_ids(toy, padded, batch):
    """Top-k ids past the student's 259 rows come back masked (``MASKED_ID``, log-prob −inf) after the kept ids; the
    kept ids and log-probs are the padded model's own (normalised over all 300 rows); the top-k loss equals the one
    of the signal with the masked entries removed, and the hand-computed coarse forward KL (the padded rows' mass in
    the tail bucket)."""
    positions = supervised_positions(batch["labels"])
    with FakeVLLMServer(padded, toy[1]) as fake:
        teacher = ServerTeacher(fake.url, **{"top_k": 20, **FAST})
        teacher.check(toy[1], 259)
        signal = teacher.topk(batch, positions)
        teacher.close()
    kept = reference_kept(padded_log_probs(padded, batch), 20, 259)
    masked = signal.ids == MASKED_ID
    assert masked.any() and not masked.all(dim=1).any()  # padded rows were in the top-20, never all of it
    for row, (ids, values) in enumerate(kept):
        assert signal.ids[row, : len(ids)].tolist() == ids and bool(masked[row, len(ids) :].all())
        torch.testing.assert_close(signal.logprobs[row, : len(ids)], torch.tensor(values), atol=1e-4, rtol=0)
        assert bool(torch.isneginf(signal.logprobs[row, len(ids) :]).all())

    student = AutoModelForCausalLM.from_pretrained(asset_path("toy/student_init"), dtype=torch.float32).eval()
    hidden, head = hidden_states_and_head(student, batch["input_ids"], batch["attention_mask"], positions)
    loss = topk_distillation_loss(hidden, head, signal.ids, signal.logprobs, beta=0.0)
    removed = [
        topk_distillation_loss(hidden[row : row + 1], head, torch.tensor([ids]), torch.tensor([values]))
        for row, (ids, values) in enumerate(kept)
    ]
    assert float(loss.detach()) == pytest.approx(float(torch.stack(removed).mean().detach()), rel=1e-5)
    assert float(loss.detach()) == pytest.approx(hand_forward_kl(student, batch, kept), rel=1e-4)


def padded_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(N, V_padded)`` the padded model's log-softmax (over all its rows) at the batch's supervised positions."""
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask))
    return logits.logits.float().log_softmax(-1)[supervised_positions(batch["labels"])]


def hand_forward_kl(student, batch, kept: list[tuple[list[int], list[float]]]) -> float:
    """Σ_k p_k (t_k − s_k) + p_rest (t_rest − s_rest) per position over the kept ids only (float64; p_rest = 1 − Σ
    kept p: the padded rows' mass is in it), averaged over positions."""
    mask = batch["attention_mask"]
    with torch.no_grad():
        out = student(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask))
    s = out.logits.double().log_softmax(-1)[supervised_positions(batch["labels"])]
    total = 0.0
    for row, (ids, values) in enumerate(kept):
        t, s_k = torch.tensor(values, dtype=torch.float64), s[row, ids]
        t_rest, s_rest = math.log1p(-float(t.exp().sum())), math.log1p(-float(s_k.exp().sum()))
        total += float((t.exp() * (t - s_k)).sum()) + math.exp(t_rest) * (t_rest - s_rest)
    return total / len(kept)


def test_a_gkd_step_with_a_padded_served_teacher(toy, padded, batch, tmp_path):
    """GKD's training loss (the step's loss object) against the padded server is the hand-computed loss over the kept
    ids, and a real Trainer fits two steps with it."""
    from helpers.fitting import fit, logged, make_module

    tokenizer = toy[1]
    student = AutoModelForCausalLM.from_pretrained(asset_path("toy/student_init"), dtype=torch.float32)
    with FakeVLLMServer(padded, tokenizer) as fake:
        spec = {"kind": "server", "url": fake.url, "top_k": 20, **FAST}
        module = make_module(student, spec, tokenizer, lmbda=0.0, divergence={"beta": 0.0})
        assert module.teacher_source.padded_vocabulary is True
        with torch.no_grad():
            out = module.training_loss(dict(batch))
        kept = reference_kept(padded_log_probs(padded, batch), 20, 259)
        assert any(len(ids) < 20 for ids, _ in kept)
        assert float(out.loss) == pytest.approx(hand_forward_kl(module.student, batch, kept), rel=1e-4)
        rows = {"train": addition_rows("train", 16), "val": addition_rows("val", 4)}
        fit(module, tokenizer, rows, tmp_path, max_steps=2)
    losses = logged(tmp_path, "train/loss")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


def test_check_names_the_max_logprobs_flag(toy):
    with FakeVLLMServer(*toy, max_logprobs=5) as fake:
        with pytest.raises(ValueError, match="Restart it with --max-logprobs 20 or more"):
            ServerTeacher(fake.url, **FAST).check(toy[1], 259)
        ServerTeacher(fake.url, top_k=5, **FAST).check(toy[1], 259)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": "localhost:8000"}, "must look like 'http://host:port'"),
        ({"url": "http://127.0.0.1:x"}, "bad port"),
        ({"top_k": 0}, "teacher.top_k must be an integer >= 1"),
        ({"concurrency": 0}, "teacher.concurrency"),
        ({"retries": -1}, "teacher.retries"),
        ({"timeout": 0}, "teacher.timeout"),
        ({"backoff": -1.0}, "teacher.backoff"),
        ({"model": ""}, "teacher.model"),
    ],
)
def test_arguments_are_checked_without_a_request(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerTeacher(**{"url": "http://127.0.0.1:1", **kwargs})


def test_rows_longer_than_the_server_allows_and_positions_in_padding_are_refused(toy, fake, batch):
    teacher = teacher_for(fake)
    long = torch.full((1, 64), 19)
    with pytest.raises(ValueError, match="max_model_len=64"):
        teacher.topk({"input_ids": long, "attention_mask": torch.ones_like(long)}, supervised_positions(long))
    positions = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
    row = int(batch["attention_mask"].sum(1).argmin())  # the most padded row
    positions[row, 0] = True
    with pytest.raises(ValueError, match=f"row {row} has positions"):
        teacher.topk(batch, positions)


def test_the_teacher_pickles_and_closes(toy, fake, batch):
    teacher = teacher_for(fake)
    positions = supervised_positions(batch["labels"])
    first = teacher.topk(batch, positions)
    copy = pickle.loads(pickle.dumps(teacher))
    teacher.close()
    assert teacher.server._pool is None
    assert_same_signal(copy.topk(batch, positions), first)
    assert_same_signal(teacher.topk(batch, positions), first)  # a new pool after close
    teacher.close()
    copy.close()


def test_the_sampler_returns_completion_batches_reproducible_per_seed(toy, fake, batch):
    model, tokenizer = toy
    sampler = ServerSampler(teacher_for(fake), max_new_tokens=8, temperature=2.0, top_k=50, eos_token_id=2)
    prompts, mask = batch["prompts"], batch["prompt_attention_mask"]
    first = sampler.sample(None, prompts, mask, seed=5)
    again = sampler.sample(model, prompts, mask, seed=5)
    other = sampler.sample(None, prompts, mask, seed=6)
    assert set(first) == {"input_ids", "attention_mask", "labels", "sampled_logprobs"}
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["input_ids"], other["input_ids"])
    width = prompts.shape[1]
    assert first["input_ids"].shape[0] == prompts.shape[0] and first["input_ids"].shape[1] <= width + 8
    assert torch.equal(first["input_ids"][:, :width], prompts) and (first["labels"][:, :width] == -100).all()
    completion = first["input_ids"][:, width:]
    is_eos = (completion == 2).long()
    supervised = first["labels"][:, width:] != -100
    assert torch.equal(supervised, (is_eos.cumsum(1) - is_eos) == 0)  # through the first EOS
    assert torch.equal(first["attention_mask"][:, width:].bool(), supervised)
    # the server's (raw) log-probs of the sampled tokens: the teacher's full softmax at temperature 1
    with torch.no_grad():
        logits = model(input_ids=first["input_ids"], attention_mask=first["attention_mask"]).logits[:, :-1]
    raw = logits.float().log_softmax(-1).gather(-1, first["input_ids"][:, 1:, None]).squeeze(-1)
    keep = first["labels"][:, 1:] != -100
    torch.testing.assert_close(first["sampled_logprobs"][:, 1:][keep], raw[keep], atol=1e-4, rtol=0)
    assert (first["sampled_logprobs"][first["labels"] == -100] == 0).all()


def test_the_samplers_greedy_equals_hf_greedy(toy, fake, batch):
    model, _ = toy
    sampler = ServerSampler(teacher_for(fake), max_new_tokens=8, temperature=1.0, eos_token_id=2, pad_token_id=0)
    ours = sampler.greedy(None, batch["prompts"], batch["prompt_attention_mask"], max_new_tokens=8)
    reference = generate_completions(
        model,
        batch["prompts"],
        batch["prompt_attention_mask"],
        max_new_tokens=8,
        pad_token_id=0,
        eos_token_id=2,
        do_sample=False,
    )
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(ours[key], reference[key]), key
    torch.testing.assert_close(ours["sampled_logprobs"], reference["sampled_logprobs"], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_model_len=64"):
        sampler.greedy(None, batch["prompts"], batch["prompt_attention_mask"], max_new_tokens=60)
    sampler.close()


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_sampler_probes_whether_its_log_probs_are_those_it_sampled_from(mode, toy, batch):
    model, _ = toy
    prompts, mask = batch["prompts"], batch["prompt_attention_mask"]
    with FakeVLLMServer(*toy, logprobs_mode=mode) as fake:
        plain = ServerSampler(teacher_for(fake), max_new_tokens=4, temperature=1.0, eos_token_id=2)
        assert plain.sampled_logprobs_problem() is None  # temperature 1, no top-k/top-p: raw is what it samples
        assert fake.count("/v1/completions") == 0  # ... known without asking
        sampler = ServerSampler(teacher_for(fake), max_new_tokens=8, temperature=0.7, top_k=5, eos_token_id=2)
        problem = sampler.sampled_logprobs_problem()
        assert sampler.sampled_logprobs_problem() == problem and fake.count("/v1/completions") == 1  # probed once
        if mode == "raw_logprobs":
            assert "returns raw log-probs" in problem and "--logprobs-mode raw_logprobs" in problem
            assert "temperature=0.7, top_k=5, top_p=1.0" in problem
            return
        assert problem is None
        out = sampler.sample(None, prompts, mask, seed=3)
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits[:, :-1].float()
    flat = sampling_logits(logits.reshape(-1, logits.shape[-1]), temperature=0.7, top_k=5, top_p=1.0)
    processed = flat.log_softmax(-1).reshape(logits.shape).gather(-1, out["input_ids"][:, 1:, None]).squeeze(-1)
    keep = out["labels"][:, 1:] != -100
    assert keep.sum() > 0 and (processed[keep] > -20).all()  # every sampled token is inside the top 5
    torch.testing.assert_close(out["sampled_logprobs"][:, 1:][keep], processed[keep], atol=1e-4, rtol=0)
