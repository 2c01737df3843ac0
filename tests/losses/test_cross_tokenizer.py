"""GKDModule with a teacher whose tokenizer differs from the student's (lightning_gkd.losses.cross_tokenizer, the
``CrossTokenizerDistillation`` loss object):
the cross path equals plain GKD with identical tokenizers, fits on- and off-policy (plain and grouped generation)
with a BPE teacher and the byte-level student, and what it cannot do is refused before any model loads."""

import copy

import pytest
import torch
from helpers import fitting
from helpers.fitting import logged, small_trainer, with_group_defaults
from transformers import AutoModelForCausalLM

from lightning_gkd import ChatDataModule, GKDModule, OPDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer
from lightning_gkd.losses.cross_tokenizer import CrossTokenizerDistillation
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import CrossTokenizerLoss
from lightning_gkd.ops.decoding.sampling import completion_batch
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm


@pytest.fixture(scope="module")
def bpe_tokenizer(toy_rows):
    corpus = [message["content"] for row in toy_rows["train"] for message in row["messages"]]
    return build_chatml_bpe_tokenizer(corpus, merges=60)


@pytest.fixture()
def bpe_teacher(bpe_tokenizer):
    return tiny_causal_lm(TINY_TEACHER, bpe_tokenizer, seed=1)


def make_module(student, teacher, tokenizer, **kwargs):
    return fitting.make_module(student, teacher, tokenizer, **with_group_defaults(kwargs, validation={"metrics": {}}))


def is_cross(module: GKDModule) -> bool:
    """Whether the module trains with the cross-tokenizer loss."""
    return isinstance(module.loss, CrossTokenizerDistillation)


def steps_on_one_batch(module, batch, steps: int) -> list[float]:
    """AdamW (lr 3e-3) steps of the student on ``batch``'s distillation loss; the losses before each step."""
    optimizer = torch.optim.AdamW(module.student.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = module.distillation_loss(batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fit(module, tokenizer, rows, root, max_steps=3, val=None, **data_kwargs):
    val = rows["val"] if val is None else val
    datamodule = ChatDataModule(tokenizer, rows["train"], val, batch_size=4, max_length=64, **data_kwargs)
    trainer = small_trainer(root, csv=True, max_steps=max_steps, limit_val_batches=1, val_check_interval=max_steps)
    trainer.fit(module, datamodule=datamodule)
    return trainer


def sample_shaped_batch(tokenizer, rows):
    """Dataset completions shaped like samples (prompt, content, EOS; no ChatML "\\n" after it): exactly the batch a
    teacher with the same tokenizer reads, so the cross path and plain GKD score the same positions."""
    collated = ChatMLCollator(tokenizer, max_length=64, carry_prompt_messages=True)(rows)
    completions = [[t for t in labels if t != IGNORE_INDEX][:-1] for labels in collated["labels"].tolist()]
    width = max(len(ids) for ids in completions)
    padded = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in completions])
    batch = completion_batch(collated["prompts"], collated["prompt_attention_mask"], padded, tokenizer.eos_token_id)
    return {**batch, "prompt_messages": collated["prompt_messages"]}


# --------------------------------------------------------------------------- the same tokenizer: plain GKD


@pytest.mark.parametrize("lean_loss, tolerance", [(False, 1e-12), (True, 1e-7)])
def test_identical_tokenizers_give_the_plain_gkd_loss_and_gradients(
    student, teacher, tokenizer, toy_rows, lean_loss, tolerance
):
    student, teacher = student.double(), teacher.double()
    answers = ["2", "13", "953", "9051", "caf\u00e9 \U0001f44d"]  # 1, 2, 3, 4 and 10 bytes
    rows = [
        {"messages": [*row["messages"][:-1], {"role": "assistant", "content": a}]}
        for row, a in zip(toy_rows["train"][: len(answers)], answers, strict=True)
    ]
    batch = sample_shaped_batch(tokenizer, rows)
    lengths = (batch["labels"] != IGNORE_INDEX).sum(1).tolist()
    assert lengths == [2, 3, 4, 5, 11]  # uneven completion lengths (content bytes + EOS)
    plain = make_module(
        copy.deepcopy(student), copy.deepcopy(teacher), tokenizer, divergence={"beta": 0.3, "lean_loss": lean_loss}
    )
    settings = {"enabled": "always", "loss": "hybrid", "skip_student_eos": False, "skip_teacher_eos": False}
    cross = make_module(
        student, teacher, tokenizer, cross_tokenizer=settings, divergence={"beta": 0.3, "lean_loss": lean_loss}
    )
    assert not is_cross(plain) and is_cross(cross)
    assert cross.loss.matched_count == len(tokenizer)  # every column matched: the hybrid is its JSD

    plain_out, cross_out = plain.distillation_loss(batch), cross.distillation_loss(batch)
    plain_loss, cross_loss = plain_out.loss, cross_out.loss
    assert int(cross_out.count) == sum(lengths)  # one group per token
    assert int(plain_out.count) == sum(lengths)  # one student token each
    torch.testing.assert_close(cross_loss.double(), plain_loss.double(), rtol=tolerance, atol=tolerance)
    plain_loss.backward()
    cross_loss.backward()
    plain_grads = dict(plain.student.named_parameters())
    for name, parameter in cross.student.named_parameters():
        expected = plain_grads[name].grad
        torch.testing.assert_close(parameter.grad, expected, rtol=tolerance * 10, atol=tolerance * 10)
    assert max(p.grad.abs().max() for p in cross.student.parameters()) > 1e-4  # the gradients are not all ~0


# --------------------------------------------------------------------------- another tokenizer


def test_a_bpe_teacher_takes_the_cross_path_and_the_byte_student_learns_on_a_fixed_batch(
    student, tokenizer, bpe_tokenizer, bpe_teacher, toy_rows
):
    gold = {"loss": "hybrid", "skip_student_eos": True, "skip_teacher_eos": True}  # TRL's GOLDTrainer defaults
    module = make_module(student, bpe_teacher, tokenizer, teacher_tokenizer=bpe_tokenizer, cross_tokenizer=gold)
    step = module.loss
    assert is_cross(module) and step.teacher_tokenizer is bpe_tokenizer
    # the byte symbols and ChatML specials are the strings both vocabularies hold; the BPE merges are not
    assert step.matched_count == len(tokenizer) and len(bpe_tokenizer) > len(tokenizer)
    batch = ChatMLCollator(tokenizer, max_length=64, carry_prompt_messages=True)(toy_rows["train"][:6])
    completions, teacher_rows = step.teacher_inputs(batch)
    contents = [row["messages"][-1]["content"] for row in toy_rows["train"][:6]]
    assert [c.text for c in completions] == contents
    assert [bpe_tokenizer.decode(ids[:-1]) for ids in teacher_rows["completion_ids"]] == contents
    assert sum(map(len, teacher_rows["completion_ids"])) < sum(len(c.ids) for c in completions)  # merges

    losses = steps_on_one_batch(module, batch, 15)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.6 * losses[0], losses
    assert module.teacher.training is False


@pytest.mark.parametrize("loss", ["likelihood", "projected"])
def test_the_likelihood_losses_raise_the_students_likelihood_of_the_teachers_answers(
    student, tokenizer, bpe_tokenizer, bpe_teacher, toy_rows, loss
):
    """The chunk-likelihood losses (not in TRL) on a fixed batch: the loss falls and the student's log-likelihood of
    the answers (which the teacher prefers) rises; ``projected`` builds its token map once, over the teacher's
    vocabulary."""
    settings = {"loss": loss, "skip_student_eos": False, "skip_teacher_eos": False}
    module = make_module(student, bpe_teacher, tokenizer, teacher_tokenizer=bpe_tokenizer, cross_tokenizer=settings)
    step = module.loss
    assert step.matched is None
    assert (step.projection is None) == (loss == "likelihood")
    if loss == "projected":
        first_token = step.projection.first_token
        assert first_token.numel() == len(bpe_tokenizer) and int(first_token.max()) < len(tokenizer)
    batch = ChatMLCollator(tokenizer, max_length=64, carry_prompt_messages=True)(toy_rows["train"][:6])

    def answer_log_likelihood() -> float:
        with torch.no_grad():
            logits = module.student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        log_probs = logits[:, :-1].log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        return float((log_probs * (labels != -100)).sum())

    before = answer_log_likelihood()
    losses = steps_on_one_batch(module, batch, 10)
    assert losses[-1] < 0.7 * losses[0], losses
    assert answer_log_likelihood() > before + 1.0


@pytest.mark.parametrize("lmbda", [0.0, 1.0])
def test_fit_on_and_off_policy_with_a_bpe_teacher(
    student, tokenizer, bpe_tokenizer, bpe_teacher, toy_rows, tmp_path, monkeypatch, lmbda
):
    module = make_module(
        student,
        bpe_teacher,
        tokenizer,
        teacher_tokenizer=bpe_tokenizer,
        lmbda=lmbda,
        cross_tokenizer={"loss": "hybrid"},
    )
    assert module.loss.loss_settings.loss == "hybrid"
    counts = []
    original = module.token_normalizer.micro_batch_loss
    monkeypatch.setattr(
        module.token_normalizer, "micro_batch_loss", lambda loss, n: counts.append(int(n)) or original(loss, n)
    )
    teacher_before = {k: v.clone() for k, v in module.teacher.state_dict().items()}

    trainer = fit(module, tokenizer, toy_rows, tmp_path)

    assert trainer.global_step == 3
    assert logged(tmp_path, "train/on_policy") == [lmbda] * 3
    losses = logged(tmp_path, "train/loss")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))) and all(x > 0 for x in losses)
    groups = logged(tmp_path, "train/cross_tokenizer/groups")
    assert len(groups) == 3 and all(g >= 4 for g in groups)  # at least one group per row
    assert counts == [int(g) for g in groups]  # the step's normaliser counts aligned groups
    matched, unmatched = (
        logged(tmp_path, "train/cross_tokenizer/matched"),
        logged(tmp_path, "train/cross_tokenizer/unmatched"),
    )
    # every student token string is a teacher's too: no unmatched student column, so ULD's part is 0 (as TRL)
    assert len(matched) == 3 and all(x > 0 for x in matched) and unmatched == [0.0] * 3
    assert len(logged(tmp_path, "val/loss")) == 1 and len(logged(tmp_path, "val/cross_tokenizer/groups")) == 1
    assert all(torch.equal(v, teacher_before[k].to(v.dtype)) for k, v in module.teacher.state_dict().items())


def test_grouped_generation_samples_once_per_group_and_named_val_sets_log_apart(
    student, tokenizer, bpe_tokenizer, bpe_teacher, toy_rows, tmp_path
):
    uld = CrossTokenizerLoss(loss="uld")  # the ops' settings object works too
    module = make_module(
        student, bpe_teacher, tokenizer, teacher_tokenizer=bpe_tokenizer, lmbda=1.0, cross_tokenizer=uld
    )
    named = {"short": toy_rows["val"][:4], "long": toy_rows["val"][4:]}
    trainer = fit(module, tokenizer, toy_rows, tmp_path, max_steps=4, val=named, steps_per_generation=2)
    assert trainer.global_step == 4 and module.sampling_calls == 2
    assert len(logged(tmp_path, "train/cross_tokenizer/groups")) == 4
    for name in named:  # named validation sets: their own keys
        assert len(logged(tmp_path, f"val/{name}/cross_tokenizer/groups")) == 1
    assert logged(tmp_path, "train/cross_tokenizer/matched") == []  # ULD has no matched part
    assert all(torch.isfinite(torch.tensor(logged(tmp_path, "train/loss"))))
    # a checkpoint mid-run keeps the group's samples with their prompt messages, and loads weights-only
    trainer.save_checkpoint(tmp_path / "grouped.ckpt")
    checkpoint = torch.load(tmp_path / "grouped.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["cross_tokenizer"]["loss"] == "uld"
    (micro_batch, *_) = checkpoint["generation_group"]["micro_batches"]
    assert len(micro_batch["prompt_messages"]) == 4 and micro_batch["prompt_messages"][0][0]["role"] == "user"


def test_crossentropy_weight_adds_the_students_cross_entropy(student, tokenizer, bpe_tokenizer, bpe_teacher, toy_rows):
    batch = ChatMLCollator(tokenizer, max_length=64, carry_prompt_messages=True)(toy_rows["train"][:4])
    base = make_module(student, bpe_teacher, tokenizer, teacher_tokenizer=bpe_tokenizer)
    both = make_module(
        student,
        bpe_teacher,
        tokenizer,
        teacher_tokenizer=bpe_tokenizer,
        cross_tokenizer={"crossentropy_weight": 0.5, "distillation_weight": 2},
    )
    positions = torch.nn.functional.pad(batch["labels"][:, 1:] != IGNORE_INDEX, (0, 1), value=False)
    logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:][batch["labels"][:, 1:] != IGNORE_INDEX]
    crossentropy = torch.nn.functional.cross_entropy(logits[positions].float(), targets)
    assert both.hparams["cross_tokenizer"] == {  # what was used, nulls resolved: plain values for checkpoints
        "enabled": "auto",
        "loss": "projected",
        "alignment": "bytes",
        "merge": "observed",
        "beta": 0.5,
        "student_temperature": 1.0,
        "teacher_temperature": 1.0,
        "skip_student_eos": False,
        "skip_teacher_eos": False,
        "matched_weight": None,
        "unmatched_weight": None,
        "matched_divergence": "clamped",
        "teacher_max_length": None,
        "projection_cache": None,
        "distillation_weight": 2,
        "crossentropy_weight": 0.5,
    }
    with torch.no_grad():
        expected = 2 * base.distillation_loss(batch).loss + 0.5 * crossentropy
        out = both.distillation_loss(batch)
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.logs["cross_tokenizer/crossentropy"].value, crossentropy)


# --------------------------------------------------------------------------- where the teacher's tokenizer comes from


def test_the_teacher_tokenizer_comes_from_the_teachers_folder(student, tokenizer, bpe_tokenizer, bpe_teacher, tmp_path):
    bpe_teacher.save_pretrained(tmp_path / "with_tokenizer")
    bpe_tokenizer.save_pretrained(tmp_path / "with_tokenizer")
    module = make_module(student, str(tmp_path / "with_tokenizer"), tokenizer)
    assert is_cross(module)
    assert module.loss.teacher_tokenizer.get_vocab() == bpe_tokenizer.get_vocab()
    spec = {"kind": "local", "model": {"name_or_path": str(tmp_path / "with_tokenizer")}, "tokenizer": None}
    assert is_cross(make_module(student, spec, tokenizer))

    # no tokenizer in the folder: the student's is assumed, and the vocabulary sizes then disagree
    bpe_teacher.save_pretrained(tmp_path / "bare")
    message = (
        rf"Student vocabulary size 259 differs from the teacher's {len(bpe_tokenizer)}, and its tokenizer is not.*"
    )
    with pytest.raises(ValueError, match=message + r"model\.teacher\.tokenizer=<folder or hub id>.*enabled=always"):
        make_module(student, str(tmp_path / "bare"), tokenizer)
    bare_spec = {"name_or_path": str(tmp_path / "bare"), "tokenizer": str(tmp_path / "with_tokenizer")}
    assert is_cross(make_module(student, bare_spec, tokenizer))  # the model spec's key

    # the same tokenizer in the folder: the usual path; enabled=never: never looked at
    teacher = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)
    teacher.save_pretrained(tmp_path / "same")
    tokenizer.save_pretrained(tmp_path / "same")
    assert not is_cross(make_module(student, str(tmp_path / "same"), tokenizer))
    with pytest.raises(ValueError, match="Student vocabulary size 259 differs"):
        make_module(
            student, bpe_teacher, tokenizer, teacher_tokenizer=bpe_tokenizer, cross_tokenizer={"enabled": "never"}
        )


# --------------------------------------------------------------------------- refusals, before models load


@pytest.fixture()
def folders(tokenizer, bpe_tokenizer, bpe_teacher, tmp_path, monkeypatch):
    """Student and BPE teacher folders (with their tokenizers); loading any model's weights fails the test."""
    tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0).save_pretrained(tmp_path / "student")
    bpe_teacher.save_pretrained(tmp_path / "teacher")
    bpe_tokenizer.save_pretrained(tmp_path / "teacher")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("model weights loaded"))
    return str(tmp_path / "student"), str(tmp_path / "teacher")


@pytest.mark.parametrize(
    "teacher_kind, kwargs, match",
    [
        ("folder", {"seq_kd": True}, r"seq_kd=true with a teacher whose tokenizer differs .* method\.seq_kd=false"),
        (
            "folder",
            {"divergence": {"sparse_loss": "topk_renorm"}},
            r"method\.divergence\.sparse_loss=topk_renorm with a teacher whose .* "
            r"Leave method\.divergence\.sparse_loss=topk",
        ),
        ("top_k", {}, r"teacher\.top_k=5 with a teacher whose tokenizer differs .* Set teacher\.top_k=null"),
        (
            "cache",
            {"cross_tokenizer": {"enabled": "always"}, "lmbda": 0.0},
            r"needs one in-process teacher \(teacher=local\), but "
            r"this run has teacher\.kind=cache",
        ),
        ("server", {"teacher_tokenizer": "BPE"}, r"needs one in-process teacher .* teacher\.kind=server"),
        (
            "multi",
            {},
            r"Cross-tokenizer distillation \(teacher 'bpe'\) needs one in-process teacher .* "
            r"teacher\.kind=multi",
        ),
        ("multi_folder", {}, r"Cross-tokenizer distillation \(teacher 'bpe'\) needs one in-process teacher"),
        (
            "folder",
            {"cross_tokenizer": {"enabled": "sometimes"}},
            r"cross_tokenizer\.enabled must be one of auto, "
            r"always, never, got 'sometimes'",
        ),
        ("folder", {"cross_tokenizer": {"los": "uld"}}, r"cross_tokenizer: unknown key\(s\) los; it takes"),
        (
            "folder",
            {"cross_tokenizer": {"matched_weight": 1.0}},
            r"cross_tokenizer\.matched_weight and "
            r"cross_tokenizer\.unmatched_weight go together",
        ),
        (
            "folder",
            {"cross_tokenizer": {"crossentropy_weight": -1.0}},
            r"cross_tokenizer\.crossentropy_weight must be a number >= 0, got -1\.0",
        ),
    ],
)
def test_what_the_cross_path_cannot_do_is_refused_before_models_load(
    tokenizer, bpe_tokenizer, folders, teacher_kind, kwargs, match
):
    student_dir, teacher_dir = folders
    teacher = {
        "folder": teacher_dir,
        "top_k": {"kind": "local", "model": teacher_dir, "top_k": 5},
        "cache": {"kind": "cache", "path": "/nowhere"},
        "server": {"kind": "server", "url": "http://127.0.0.1:9"},
        "multi": {
            "kind": "multi",
            "teachers": {
                "same": {"kind": "local", "model": student_dir},
                "bpe": {"kind": "local", "model": {"name_or_path": teacher_dir, "tokenizer": teacher_dir}},
            },
        },
        "multi_folder": {  # the teacher's folder holds its tokenizer
            "kind": "multi",
            "teachers": {
                "same": {"kind": "local", "model": student_dir},
                "bpe": {"kind": "local", "model": teacher_dir},
            },
        },
    }[teacher_kind]
    if kwargs.get("teacher_tokenizer") == "BPE":
        kwargs = {**kwargs, "teacher_tokenizer": bpe_tokenizer}
    with pytest.raises(ValueError, match=match):
        make_module(student_dir, teacher, tokenizer, **kwargs)


def test_opd_refuses_a_teacher_with_another_tokenizer_before_models_load(tokenizer, folders):
    student_dir, teacher_dir = folders
    with pytest.raises(
        ValueError,
        match=r"OPDModule cannot distil from a teacher whose tokenizer differs from the "
        r"student's: its reward is the teacher's log-prob .* Use method=gkd",
    ):
        OPDModule(student_dir, teacher_dir, tokenizer, sampling={"max_new_tokens": 4}, validation={"metrics": {}})


def test_the_datamodule_must_carry_prompt_messages_of_the_last_turn_only(
    student, tokenizer, bpe_tokenizer, bpe_teacher, toy_rows
):
    module = make_module(student, bpe_teacher, tokenizer, teacher_tokenizer=bpe_tokenizer)
    every_turn = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64, assistant_turns="all")
    with pytest.raises(
        ValueError,
        match=r"data\.assistant_turns=all with a teacher whose tokenizer differs .* "
        r"Set data\.assistant_turns=last",
    ):
        module.check_datamodule(every_turn)
    datamodule = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=50)
    module.check_datamodule(datamodule)
    assert datamodule.carries_prompt_messages and module.loss.max_length == 50 + 6
    prompts = {str(row["messages"][:-1]) for row in toy_rows["train"]}
    carried = next(iter(datamodule.train_dataloader()))["prompt_messages"]
    assert len(carried) == 4 and all(str(messages) in prompts for messages in carried)
    batch = ChatMLCollator(tokenizer, max_length=64)(toy_rows["train"][:2])
    with pytest.raises(ValueError, match=r"The batch has no 'prompt_messages'.*carry_prompt_messages"):
        module.distillation_loss(batch)


def test_projection_cache_option_writes_the_tables_once_and_reads_them_back(
    student, tokenizer, bpe_tokenizer, bpe_teacher, tmp_path
):
    """``cross_tokenizer.projection_cache``: the first module builds the projected loss's tables and writes them
    there (one file, named by both tokenizers' fingerprints); the next reads the same tables."""
    from lightning_gkd.data.token_projection import projection_cache_path

    settings = {"loss": "projected", "projection_cache": str(tmp_path)}
    first = make_module(student, bpe_teacher, tokenizer, teacher_tokenizer=bpe_tokenizer, cross_tokenizer=settings)
    assert list(tmp_path.iterdir()) == [projection_cache_path(tokenizer, bpe_tokenizer, tmp_path)]
    assert first.hparams.cross_tokenizer["projection_cache"] == str(tmp_path)
    second = make_module(student, bpe_teacher, tokenizer, teacher_tokenizer=bpe_tokenizer, cross_tokenizer=settings)
    assert torch.equal(second.loss.projection.first_token, first.loss.projection.first_token)
    assert torch.equal(second.loss.projection.extension_ids, first.loss.projection.extension_ids)
