"""Several named validation sets: one loader each, logged as val/<name>/loss and val/<name>/<metric>."""

import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.evaluation import exact_match


def direct_loss(module: GKDModule, data: ChatDataModule, rows) -> float:
    batch = data.val_collator([{**row, "row_index": i} for i, row in enumerate(rows)])
    with torch.no_grad():
        return float(module.completion_loss(batch).loss)


def test_named_sets_log_one_loss_each_equal_to_a_direct_computation(student, teacher, tokenizer, toy_rows, tmp_path):
    sets = {"easy": toy_rows["val"][:5], "hard": toy_rows["val"][5:16]}
    data = ChatDataModule(
        tokenizer, toy_rows["train"][:8], val_data=sets, batch_size=4, val_batch_size=16, max_length=64
    )
    module = GKDModule(
        student, teacher, tokenizer, lmbda=0.0, validation={"metrics": {"accuracy": exact_match}, "max_new_tokens": 4}
    )
    assert data.val_names == ["easy", "hard"]
    results = small_trainer(tmp_path, limit_val_batches=1.0).validate(module, datamodule=data, verbose=False)
    logged = {key: float(value) for result in results for key, value in result.items()}
    assert set(logged) == {"val/easy/loss", "val/hard/loss", "val/easy/accuracy", "val/hard/accuracy"}
    for name, rows in sets.items():
        assert logged[f"val/{name}/loss"] == pytest.approx(direct_loss(module, data, rows), rel=1e-5)
    assert logged["val/easy/loss"] != pytest.approx(logged["val/hard/loss"])
    assert all(0.0 <= logged[f"val/{name}/accuracy"] <= 1.0 for name in sets)


def test_named_sets_in_a_fit(student, teacher, tokenizer, toy_rows, tmp_path):
    data = ChatDataModule(
        tokenizer,
        toy_rows["train"][:8],
        batch_size=4,
        max_length=64,
        val_data={"a": toy_rows["val"][:4], "b": toy_rows["val"][4:8]},
    )
    module = GKDModule(student, teacher, tokenizer, lmbda=0.0)
    fit = small_trainer(tmp_path, max_steps=2, limit_val_batches=1.0, val_check_interval=2, num_sanity_val_steps=0)
    fit.fit(module, datamodule=data)
    keys = {key for key in fit.callback_metrics if key.startswith("val/")}
    assert keys == {"val/a/loss", "val/b/loss"}


def test_a_single_set_still_logs_val_loss(student, teacher, tokenizer, toy_rows, tmp_path):
    data = ChatDataModule(
        tokenizer, toy_rows["train"][:8], val_data=toy_rows["val"][:6], val_batch_size=16, max_length=64
    )
    module = GKDModule(
        student, teacher, tokenizer, lmbda=0.0, validation={"metrics": {"accuracy": exact_match}, "max_new_tokens": 4}
    )
    assert data.val_names is None
    (result,) = small_trainer(tmp_path, limit_val_batches=1.0).validate(module, datamodule=data, verbose=False)
    assert set(result) == {"val/loss", "val/accuracy"}
    assert result["val/loss"] == pytest.approx(direct_loss(module, data, toy_rows["val"][:6]), rel=1e-5)


def test_bad_set_names_are_refused(tokenizer, toy_rows):
    with pytest.raises(ValueError, match=r"val_data names must be non-empty strings without '/'.*'a/b'"):
        ChatDataModule(tokenizer, toy_rows["train"], val_data={"a/b": toy_rows["val"]})
    with pytest.raises(ValueError, match="val_data is an empty dict"):
        ChatDataModule(tokenizer, toy_rows["train"], val_data={})


def test_a_bad_row_in_a_named_set_names_the_set(tokenizer, toy_rows):
    data = ChatDataModule(tokenizer, toy_rows["train"], val_data={"ok": toy_rows["val"], "broken": [{"x": 1}]})
    with pytest.raises(ValueError, match=r"val_data\['broken'\] row 0: missing field 'messages'"):
        data.setup("fit")


def test_named_sets_from_the_command_line(tmp_path, tokenizer, toy_rows):
    import json

    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    paths = {}
    for name, rows in (("train", toy_rows["train"][:4]), ("easy", toy_rows["val"][:3]), ("hard", toy_rows["val"][3:8])):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("\n".join(json.dumps({"messages": r["messages"]}) for r in rows))
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "data=chat_files",
                f"data.train_data={paths['train']}",
                f"data.val_data={{easy:{paths['easy']},hard:{paths['hard']}}}",
            ],
        )
    data = instantiate(cfg.data, tokenizer=tokenizer, _convert_="all")
    assert data.val_names == ["easy", "hard"]
    loaders = data.val_dataloader()
    assert [sum(b["input_ids"].shape[0] for b in loader) for loader in loaders] == [3, 5]
