"""`lightning-gkd teacher=server` end to end against a stand-in vLLM server (lightning_gkd/testing/fake_vllm_server.py:
vLLM's JSON, log-probs from the shipped toy teacher): a server that goes down mid-run stops the job cleanly (no
export, a summary naming the checkpoint, exit status 1), and `ckpt_path=last` with the server back finishes the job
with the same losses, step for step, as a run that never lost its server."""

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.hydra_compose import compose_train
from omegaconf import open_dict
from transformers import AutoModelForCausalLM

from lightning_gkd.cli.train import main, run
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer
from lightning_gkd.toy.tiny import asset_path

SERVERS: list[FakeVLLMServer] = []  # the module's server, for the callback Hydra builds from its name


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fake server's forwards share the cores with the training
    teacher = AutoModelForCausalLM.from_pretrained(asset_path("toy/teacher"), dtype=torch.float32)
    with FakeVLLMServer(teacher, load_tokenizer(asset_path("toy/teacher"))) as fake:
        SERVERS.append(fake)
        yield fake
    SERVERS.clear()
    torch.set_num_threads(threads)


class ServerDownAfter(L.Callback):
    """From the end of optimizer step ``step`` on, the server answers 503 to everything."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            SERVERS[0].fail_next(10_000, status=503)


def compose(tmp_path: Path, url: str, name: str, extra: list[str], teacher: list[str] | None = None):
    if teacher is None:
        teacher = ["teacher=server", f"teacher.url={url}", "teacher.top_k=20"]
    remote = [] if teacher == ["teacher=local"] else ["teacher.retries=2", "teacher.backoff=0.01"]
    cfg = compose_train(
        tmp_path,
        [
            *teacher,
            *remote,
            "method.lmbda=1.0",
            "method.sampling.max_new_tokens=6",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "trainer.limit_val_batches=1",
            "trainer.log_every_n_steps=1",
            "data.batch_size=4",
            "data.val_batch_size=8",
            "data.test_data=null",
            "callbacks.held_out_eval=null",
            "callbacks.sample_table=null",
            "print_config=false",
            *extra,
        ],
    )
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "outputs" / "runs" / name)
    return cfg


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(handle) if r.get("train/loss")}


@pytest.mark.slow
def test_a_server_outage_stops_the_job_and_ckpt_path_last_finishes_it(server, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "outputs" / "runs"
    assert run(compose(tmp_path, server.url, "a_whole", []))["global_step"] == 4
    expected = losses(runs / "a_whole")
    capsys.readouterr()

    down = [f"+callbacks.down._target_={__name__}.ServerDownAfter", "+callbacks.down.step=2"]
    with pytest.raises(SystemExit) as exited:
        main.__wrapped__(compose(tmp_path, server.url, "b_stopped", down))  # hydra.main's own function
    assert exited.value.code == 1
    out = capsys.readouterr().out
    saved = runs / "b_stopped" / "checkpoints" / "last.ckpt"
    assert "stopped: the teacher server stayed unavailable" in out and f"resume with: ckpt_path={saved}" in out
    assert "trained model exported" not in out and not (runs / "b_stopped" / "student").exists()
    assert torch.load(saved, weights_only=True)["global_step"] == 2

    server.reset()  # the server is back
    result = run(compose(tmp_path, server.url, "c_resumed", ["ckpt_path=last"]))
    assert result["resumed_from"] == str(saved) and result["global_step"] == 4 and result["student_dir"]
    assert result["run_dir"] == str(runs / "b_stopped")  # resumed into its own run folder
    assert losses(runs / "b_stopped") == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_teacher_server_hidden_trains_as_the_teacher_in_process(server, tmp_path, monkeypatch):
    """`teacher=server_hidden`: the same server (its /pooling route), the head read from the teacher's folder,
    float32 on the wire: on-policy GKD (λ=1, β=0.5) logs the losses of `teacher=local`, step for step."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "outputs" / "runs"
    run(
        compose(tmp_path, server.url, "local", ["method.training.frozen_dtype=float32"], teacher=["teacher=local"])
    )  # as served
    hidden = ["teacher=server_hidden", f"teacher.url={server.url}", f"teacher.head={asset_path('toy/teacher')}"]
    result = run(compose(tmp_path, server.url, "hidden", [], teacher=[*hidden, "teacher.dtype=float32"]))
    assert result["global_step"] == 4
    assert losses(runs / "hidden") == pytest.approx(losses(runs / "local"), rel=1e-4)
