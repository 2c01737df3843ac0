"""The toy studies' configs (conf/recipe, conf/experiment/study_*.yaml): every recipe composes with both study
experiments into its method, settings and the study's protocol, and names itself for the tables."""

from pathlib import Path

import pytest
from helpers.hydra_compose import compose_train
from helpers.paths import ROOT
from hydra.utils import instantiate

RECIPES = sorted(path.stem for path in (ROOT / "conf" / "recipe").glob("*.yaml"))
TARGETS = {"sft": "lightning_gkd.SFTModule", "gkd": "lightning_gkd.GKDModule", "opd": "lightning_gkd.OPDModule"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_into_its_method_with_the_studys_sampling(tmp_path, recipe):
    cfg = compose_train(tmp_path, ["experiment=study_chain", f"recipe={recipe}"])
    named = cfg.study.recipe
    assert named.name and named.description and isinstance(named.on_policy, bool)
    assert cfg.method._target_ == TARGETS[named.kind]
    if named.kind != "sft":  # the methods that sample: the study's temperature and the task's budget
        assert (cfg.method.sampling.temperature, cfg.method.sampling.max_new_tokens) == (1.0, 40)
    if named.kind == "opd":
        assert named.gamma == cfg.method.policy_gradient.gamma


def test_the_addition_study_samples_the_addition_tasks_budget(tmp_path):
    cfg = compose_train(tmp_path, ["experiment=study_addition", "recipe=gkd_beta1"])
    assert (cfg.method.sampling.temperature, cfg.method.sampling.max_new_tokens, cfg.trainer.max_steps) == (1.0, 8, 200)


def test_the_recipes_set_what_their_names_say(tmp_path):
    def compose(recipe: str):
        return compose_train(tmp_path, ["experiment=study_chain", f"recipe={recipe}"])

    assert [
        (compose(r).method.lmbda, compose(r).method.divergence.beta)
        for r in ("supervised_kd", "gkd_beta05", "mixed_lambda05")
    ] == [
        (0.0, 0.0),
        (1.0, 0.5),
        (0.5, 0.5),
    ]
    assert compose("seqkd").method.seq_kd is True
    skd = compose("skd_k25")
    assert skd.sampler._target_.endswith("SpeculativeKDSampler") and (
        skd.sampler.accept_top_k,
        skd.sampler.draft_tokens,
    ) == (25, 4)
    opd = compose("opd_gamma1_normalised_baseline").method
    assert (opd.policy_gradient.gamma, opd.policy_gradient.length_normalize, opd.policy_gradient.baseline) == (
        1.0,
        True,
        "row",
    )
    served = compose("opd_top1_server")
    assert (served.teacher.kind, served.teacher.top_k) == ("server", 1)


def test_the_study_protocol_and_its_record(tmp_path):
    cfg = compose_train(tmp_path, ["experiment=study_chain", "recipe=gkd_beta1", "seed=2", "optimizer.lr=3e-4"])
    assert (cfg.trainer.max_steps, cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches) == (300, 50, None)
    assert cfg.trainer.num_sanity_val_steps == 0 and cfg.scheduler.warmup_ratio == 0.1
    assert (cfg.optimizer.weight_decay, cfg.optimizer.fused, cfg.export) == (0.01, False, False)
    assert cfg.callbacks.model_checkpoint is None and cfg.callbacks.sample_table is None
    record = instantiate(cfg.callbacks.study_record)
    assert (record.task, record.arm, record.seed, record.lr) == ("chain", "full", 2, 3e-4)
    assert record.recipe["name"] == "GKD β=1" and record.completions and record.reference
    assert record.metric.func.__name__ == "final_answer_match" and record.max_new_tokens == 40
    assert Path(record.served_teacher).name == "teacher"
    addition = instantiate(compose_train(tmp_path, ["experiment=study_addition"]).callbacks.study_record)
    assert addition.recipe == {} and addition.task == "addition" and not addition.completions
