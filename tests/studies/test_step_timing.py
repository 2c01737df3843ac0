"""lightning_gkd.studies.step_timing: the scripts' plain Trainer and the step ends it records."""

from lightning_gkd import ChatDataModule, SFTModule
from lightning_gkd.studies.step_timing import StepEnds, plain_trainer
from lightning_gkd.toy import addition_rows


def test_a_plain_fit_records_each_step_end_after_synchronizing(tokenizer, student, tmp_path):
    synchronized = []
    step_ends = StepEnds(lambda: synchronized.append(len(synchronized)))
    trainer = plain_trainer(3, callbacks=[step_ends], default_root_dir=tmp_path)
    assert trainer.logger is None and trainer.limit_val_batches == 0 and trainer.gradient_clip_val == 1.0
    datamodule = ChatDataModule(tokenizer, addition_rows("train", 12), batch_size=4, max_length=64)
    trainer.fit(SFTModule(student, tokenizer), datamodule=datamodule)
    assert trainer.global_step == 3 and len(step_ends.ends) == 3 and synchronized == [0, 1, 2]
    assert step_ends.ends == sorted(step_ends.ends)
