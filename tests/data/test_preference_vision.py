"""Preference pairs whose prompts hold images (PreferenceDataModule(processor=...)) for a tiny LLaVA
(lightning_gkd.toy.tiny_vlm): batches against hand-built ids, DPO fits through a real Trainer, the precomputed
reference log-probs against a direct forward, and the checks setup runs."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from helpers.fitting import small_trainer
from helpers.vlm import PAD, assert_same_vision, hand_completion, hand_prompt, picture, processor_prompt

from lightning_gkd import DPOModule, PreferenceDataModule
from lightning_gkd.data.preference import VisionPreferenceCollator
from lightning_gkd.data.rows import ROW_INDEX
from lightning_gkd.evaluation import exact_match
from lightning_gkd.models.vision import input_side_modules
from lightning_gkd.toy.shapes import shape_rows
from lightning_gkd.toy.tiny_vlm import tiny_vlm

ADAMW = partial(torch.optim.AdamW, lr=1e-2)
QUESTION = "What shape?"


@pytest.fixture(scope="module")
def llava():
    return tiny_vlm("llava", seed=0)


@pytest.fixture(scope="module")
def processor(llava):
    return llava[1]


def user(*parts) -> dict:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content}


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def pair_row(image, chosen: str = "red square", rejected: str = "a blue circle") -> dict:
    return {"prompt": [user({"type": "image", "image": image}, QUESTION)], "chosen": answer(chosen),
            "rejected": answer(rejected)}  # fmt: skip


def shape_pairs(n: int) -> list[dict]:
    """Pairs from the toy shape rows: the right answer chosen, another row's answer rejected."""
    rows = shape_rows("train", num_rows=n + 1)
    pairs = []
    for row, other in zip(rows[:n], rows[1:], strict=True):
        wrong = other["answer"] if other["answer"] != row["answer"] else "nothing"
        pairs.append({"prompt": row["messages"][:-1], "chosen": answer(row["answer"]), "rejected": answer(wrong)})
    return pairs


def pad_left(ids: list[int], width: int, value: int) -> list[int]:
    return [value] * (width - len(ids)) + ids


def vision_of(processor, prompt: list[dict], images: list) -> dict[str, torch.Tensor]:
    encoded = processor_prompt(processor, {"messages": prompt}, images)
    length = encoded["input_ids"].shape[1]
    return {
        key: value
        for key, value in encoded.items()
        if key not in ("input_ids", "attention_mask") and not (value.dim() >= 2 and value.shape[:2] == (1, length))
    }


def sequence_logps(model, ids: list[int], labels: list[int], vision: dict[str, torch.Tensor]) -> float:
    """Log-prob of the labelled tokens of one unpadded sequence, by a direct forward of ``model``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                       **vision).logits[0].float()  # fmt: skip
    logps = logits[:-1].log_softmax(-1)
    targets = torch.tensor(labels[1:])
    keep = targets != -100
    return float(logps[keep].gather(1, targets[keep][:, None]).sum())


# -- collation --------------------------------------------------------------------------------------------------------
def test_batch_matches_hand_built_ids_and_pairs_each_row_with_its_images(processor):
    first, second = picture(1), picture(2, size=(30, 50))
    rows = [
        pair_row(first),
        # TRL's form: an image part without its image, the image in the row's `images` column
        {
            "prompt": [user("Hi, what is this?", {"type": "image"})],
            "chosen": answer("a circle"),
            "rejected": answer("no"),
            "images": [second],
        },  # fmt: skip
    ]
    prompts = [
        hand_prompt("llava", processor.tokenizer, [first, QUESTION]),
        hand_prompt("llava", processor.tokenizer, ["Hi, what is this?", second]),
    ]
    chosen = [hand_completion("red square"), hand_completion("a circle")]
    rejected = [hand_completion("a blue circle"), hand_completion("no")]
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert all(prompt.count(image_token) == 4 for prompt in prompts)
    full = [p + c for p, c in zip(prompts + prompts, chosen + rejected, strict=True)]
    width, prompt_width = max(map(len, full)), max(map(len, prompts))

    batch = VisionPreferenceCollator(processor, 256)(rows)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "prompts", "prompt_attention_mask", "vision"}
    assert batch["input_ids"].tolist() == [pad_left(ids, width, PAD) for ids in full]
    assert batch["attention_mask"].tolist() == [pad_left([1] * len(ids), width, 0) for ids in full]
    assert batch["labels"].tolist() == [
        pad_left([-100] * len(p) + c, width, -100)
        for p, c in zip(prompts + prompts, chosen + rejected, strict=True)  # the image tokens too are -100
    ]
    assert batch["prompts"].tolist() == [pad_left(p, prompt_width, PAD) for p in prompts]
    assert batch["prompt_attention_mask"].tolist() == [pad_left([1] * len(p), prompt_width, 0) for p in prompts]
    want = [vision_of(processor, rows[0]["prompt"], [first]), vision_of(processor, rows[1]["prompt"], [second])]
    assert_same_vision(batch["vision"], want + want)  # [chosen rows; rejected rows], each with its prompt's images
    assert not torch.equal(batch["vision"][0]["pixel_values"], batch["vision"][1]["pixel_values"])


def test_datamodule_batches_carry_index_and_text_rows_get_no_images(processor):
    rows = [pair_row(picture(3)), {"prompt": [user(QUESTION)], "chosen": answer("yes"), "rejected": answer("no")}]
    data = PreferenceDataModule(
        processor.tokenizer, rows, processor=processor, batch_size=2, max_length=64, shuffle=False
    )
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["index"].tolist() == [0, 1]
    assert [sorted(v) for v in batch["vision"]] == [["pixel_values"], [], ["pixel_values"], []]
    assert batch["input_ids"].shape[0] == 4


def test_long_completion_is_cut_at_its_end_and_the_prompt_stays_whole(processor):
    row = pair_row(picture(4), chosen="a very long chosen answer", rejected="n")
    prompt = hand_prompt("llava", processor.tokenizer, [picture(4), QUESTION])
    batch = VisionPreferenceCollator(processor, len(prompt) + 3)([row])
    assert batch["input_ids"].shape[1] == len(prompt) + 3
    assert batch["labels"][0].tolist() == [-100] * len(prompt) + hand_completion("a very long chosen answer")[:3]
    assert batch["labels"][1].tolist() == [-100] * len(prompt) + hand_completion("n")  # 3 tokens: whole
    assert batch["prompts"][0].tolist() == prompt


def test_too_long_prompts_are_refused_at_setup_with_the_max_length_that_fits(processor):
    rows = [pair_row(picture(5))]
    length = len(hand_prompt("llava", processor.tokenizer, [picture(5), QUESTION]))
    data = PreferenceDataModule(processor.tokenizer, rows, processor=processor, max_length=length - 1)
    with pytest.raises(ValueError, match=rf"1 of 1 checked rows .*row 0, {length} tokens.*at least {length}"):
        data.setup("fit")
    data = PreferenceDataModule(processor.tokenizer, rows, processor=processor, max_length=length)
    with pytest.raises(ValueError, match=rf"train_data row 0: .*leaves no completion token.*at least {length + 1}"):
        data.setup("fit")
    with pytest.raises(ValueError, match="prompts are never truncated"):
        PreferenceDataModule(processor.tokenizer, rows, processor=processor, truncation_mode="keep_end")


# -- refusals ---------------------------------------------------------------------------------------------------------
def test_missing_image_file_names_the_row(processor, tmp_path):
    missing = tmp_path / "gone.png"
    rows = [pair_row(picture(6)), pair_row(picture(7))]
    rows[1]["prompt"] = [user({"type": "image", "path": str(missing)}, QUESTION)]
    data = PreferenceDataModule(processor.tokenizer, rows, processor=processor)
    with pytest.raises(ValueError, match=r"train_data row 1: image file .*gone\.png.* does not exist"):
        data.setup("fit")


def test_images_column_count_must_match_the_parts(processor):
    row = {"prompt": [user({"type": "image"}, QUESTION)], "chosen": answer("a"), "rejected": answer("b"),
           "images": [picture(8), picture(9)]}  # fmt: skip
    with pytest.raises(ValueError, match=r"train_data row 0: has 2 entries in its 'images' column"):
        PreferenceDataModule(processor.tokenizer, [row], processor=processor).setup("fit")


def test_text_only_datamodule_refuses_image_rows(processor):
    rows = [{"prompt": [user(QUESTION)], "chosen": answer("a"), "rejected": answer("b")}, pair_row(picture(10))]
    data = PreferenceDataModule(processor.tokenizer, rows)
    with pytest.raises(ValueError, match=r"train_data row 1: its prompt holds an image.*text-only tokenizer"):
        data.setup("fit")


def test_images_in_a_completion_are_refused(processor):
    row = pair_row(picture(11))
    row["chosen"] = [{"role": "assistant", "content": [{"type": "image", "image": picture(12)}]}]
    with pytest.raises(ValueError, match=r"train_data row 0: 'chosen' holds an image"):
        PreferenceDataModule(processor.tokenizer, [row], processor=processor).setup("fit")


# -- DPO --------------------------------------------------------------------------------------------------------------
def test_dpo_fit_with_images_trains_the_language_model_and_not_the_vision_side(tmp_path):
    policy, processor = tiny_vlm("llava", seed=0)
    reference = copy.deepcopy(policy)
    prefixes = tuple(f"{name}." for name in input_side_modules(policy))
    vision = {name for name, _ in policy.named_parameters() if name.startswith(prefixes)}
    assert vision
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    module = DPOModule(
        policy,
        processor.tokenizer,
        reference,
        training={"optimizer": ADAMW, "frozen_dtype": "float32"},
        validation={"max_new_tokens": 3, "metrics": {"accuracy": exact_match}},  # greedy decoding with images
    )
    pairs = shape_pairs(6)
    data = PreferenceDataModule(
        processor.tokenizer, pairs[:4], pairs[4:], processor=processor, batch_size=2, max_length=64
    )
    trainer = small_trainer(tmp_path, max_steps=2, limit_val_batches=1, val_check_interval=2)
    trainer.fit(module, datamodule=data)

    assert trainer.global_step == 2
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"])
    assert "train/rewards/accuracies" in metrics and "val/rewards/accuracies" in metrics
    assert torch.isfinite(metrics["val/loss"]) and "val/accuracy" in metrics
    assert module.processor is processor
    now = dict(policy.named_parameters())
    assert all(not now[name].requires_grad and torch.equal(before[name], now[name]) for name in vision)
    assert not torch.equal(before["lm_head.weight"], now["lm_head.weight"].detach())
    assert all(torch.equal(p, before[n]) for n, p in reference.named_parameters())


def test_precomputed_reference_logps_with_images_equal_a_direct_forward(tmp_path):
    policy, processor = tiny_vlm("llava", seed=0)
    initial = copy.deepcopy(policy).eval()
    pairs = shape_pairs(3)
    module = DPOModule(policy, processor.tokenizer, precompute_ref_logps=True, training={"optimizer": ADAMW})
    data = PreferenceDataModule(processor.tokenizer, pairs, processor=processor, batch_size=2, max_length=64)
    small_trainer(tmp_path, max_steps=1).fit(module, datamodule=data)

    cache = module.reference_logps_cache["train"]
    assert cache.shape == (3, 2) and torch.isfinite(cache).all()
    collator = VisionPreferenceCollator(processor, 64)
    for index, row in enumerate(pairs):
        batch = collator([{**row, ROW_INDEX: index}])
        want = []
        for side in range(2):
            keep = batch["attention_mask"][side].bool()
            ids, labels = batch["input_ids"][side][keep].tolist(), batch["labels"][side][keep].tolist()
            want.append(sequence_logps(initial, ids, labels, batch["vision"][side]))
        torch.testing.assert_close(cache[index], torch.tensor(want), atol=1e-4, rtol=1e-4)
        # the images reach that forward: another picture gives other log-probs
        other = {"pixel_values": torch.rand_like(batch["vision"][0]["pixel_values"])}
        keep = batch["attention_mask"][0].bool()
        moved = sequence_logps(initial, batch["input_ids"][0][keep].tolist(), batch["labels"][0][keep].tolist(), other)
        assert abs(moved - want[0]) > 1e-4
