"""Every export writes a README.md model card: base models, method and knobs, data, steps, final metrics."""

from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.evaluation.model_card import describe_source, is_hub_id, model_card


def test_export_without_a_trainer_writes_models_and_hyperparameters(student, teacher, tokenizer, tmp_path):
    teacher.save_pretrained(tmp_path / "teacher")
    module = GKDModule(student, str(tmp_path / "teacher"), tokenizer, lmbda=0.25, divergence={"beta": 0.1})
    card = (module.export(tmp_path / "out", card_info={"note": "hello"}) / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "- gkd" in card and "base_model:" not in card  # an in-memory student: no hub id to name
    assert f"- teacher: `{tmp_path / 'teacher'}`" in card
    assert "## Method: GKDModule" in card and "- lmbda: `0.25`" in card and "- divergence.beta: `0.1`" in card
    assert "- note: hello" in card


def test_export_after_fit_records_steps_data_and_metrics(student, teacher, tokenizer, toy_rows, tmp_path):
    data = ChatDataModule(tokenizer, toy_rows["train"][:8], val_data=toy_rows["val"][:4], batch_size=4, max_length=64)
    module = GKDModule(student, teacher, tokenizer, lmbda=0.0)
    trainer = small_trainer(tmp_path, max_steps=2, limit_val_batches=1.0, val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    card = (module.export(tmp_path / "out") / "README.md").read_text()
    assert "- steps: 2" in card
    assert "- train: 8 rows (list)" in card and "- val: 4 rows (list)" in card
    val_loss = float(trainer.callback_metrics["val/loss"])
    assert f"| val/loss | {val_loss:.4f} |" in card


def test_base_model_is_named_only_for_hub_ids(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert not is_hub_id(str(tmp_path)) and not is_hub_id("relative/../x/y") and not is_hub_id(None)
    assert describe_source({"config": {"model_type": "qwen2"}}) == "config: qwen2"

    class Fake:
        model_sources = {"student": "Qwen/Qwen2.5-0.5B-Instruct", "teacher": "Qwen/Qwen2.5-1.5B-Instruct"}
        model_role = "student"
        hparams = {"lmbda": 0.5}

    card = model_card(Fake())
    assert "base_model: Qwen/Qwen2.5-0.5B-Instruct" in card
    assert "- teacher: `Qwen/Qwen2.5-1.5B-Instruct`" in card
