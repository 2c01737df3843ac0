"""HiddenServerTeacher (lightning_gkd/teachers/hidden_server.py) against a real vLLM pooling server (the generative
model run with ``--runner pooling --convert embed``, per-token pooling, no activation) on CPU, for three families:
qwen2 (tied head), llama (untied) and gemma2 (a soft-capped head): the served states are the model's final hidden
states (after the final norm) as Hugging Face computes them, and the loss from them equals the in-process lean loss.

These tests run in the vLLM virtual environment that .ci/run builds; elsewhere they are skipped. One server per
family (tests/helpers/vllm_server.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.paths import SCRIPTS
from helpers.vllm_models import vllm_tiny
from helpers.vllm_server import vllm_server

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.losses.dense import DenseDistillation
from lightning_gkd.losses.settings import DivergenceSettings
from lightning_gkd.teachers import LocalTeacher, supervised_positions
from lightning_gkd.teachers.hidden_server import POOLER_CONFIG, HiddenServerTeacher
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm

if os.environ.get("LIGHTNING_GKD_REQUIRE_VLLM"):  # .ci/run's vLLM environment: a missing vLLM is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM virtual environment (.ci/run)")

pytestmark = pytest.mark.vllm
FAMILIES = ("qwen2", "llama", "gemma2")
#: the largest difference from HF's float32 states, relative to their largest magnitude, per wire dtype
TOLERANCE = {"float32": 1e-3, "bfloat16": 2**-7}


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """``(family, url, the model, its folder)``: a tiny model of ``family`` served as a pooling model."""
    family = request.param
    tokenizer = build_chatml_tokenizer()
    model = vllm_tiny(family, tokenizer, seed=3).eval()
    folder = tmp_path_factory.mktemp(f"{family}_teacher")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    arguments = [
        *("--model", str(folder), "--runner", "pooling", "--convert", "embed", "--pooler-config", POOLER_CONFIG),
        *("--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager"),
    ]
    with vllm_server(arguments, folder / "server.log") as (url, _):
        yield family, url, model, folder, tokenizer


@pytest.fixture(scope="module")
def batch():
    collated = ChatMLCollator(build_chatml_tokenizer(), max_length=64)(addition_rows(split="val")[:6])
    assert collated["attention_mask"].sum(1).unique().numel() > 1  # uneven rows
    return collated


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_states_are_hugging_faces_final_hidden_states(served, batch, dtype):
    family, url, model, folder, tokenizer = served
    teacher = HiddenServerTeacher(url, dtype=dtype, retries=2, backoff=0.1)  # the head: the served folder
    try:
        teacher.check(tokenizer, model.config.vocab_size)
        positions = supervised_positions(batch["labels"])
        hidden, head = teacher.hidden_states(batch, positions)
    finally:
        teacher.close()
    expected, expected_head = LocalTeacher(model).hidden_states(batch, positions)
    scale = float(expected.abs().max())
    difference = float((hidden - expected).abs().max())
    print(f"{family} {dtype}: max |served - HF| = {difference:.3g} (max |h| {scale:.3g})")
    assert difference <= TOLERANCE[dtype] * max(scale, 1.0)
    assert torch.equal(head.weight, expected_head.weight) and head.softcap == expected_head.softcap
    assert (head.softcap == 30.0) == (family == "gemma2")


def test_the_loss_from_served_states_equals_the_in_process_lean_loss(served, batch):
    """β = 1: the full-vocabulary reverse KL, which a top-k server can only approximate."""
    family, url, model, folder, tokenizer = served
    student = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)
    teacher = HiddenServerTeacher(url, dtype="float32", retries=2, backoff=0.1)
    try:
        with torch.no_grad():
            served_loss = DenseDistillation(teacher, DivergenceSettings(beta=1.0))(student, batch).loss
            local_loss = DenseDistillation(LocalTeacher(model), DivergenceSettings(beta=1.0))(student, batch).loss
    finally:
        teacher.close()
    assert float((served_loss - local_loss).abs()) <= 1e-4 * float(local_loss)


def test_the_accuracy_script_runs_against_a_real_pooling_server(tmp_path):
    """scripts/hidden_teacher_accuracy.py --fast: its three teachers train and the page renders."""
    import subprocess
    import sys

    script = SCRIPTS / "hidden_teacher_accuracy.py"
    done = subprocess.run(
        [sys.executable, str(script), "--fast", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "hidden_teacher.md").read_text()
    for name in ("in process (dense)", "server, hidden states (bf16)", "top-20 + tail"):
        assert f"| {name} |" in page
