"""DDP with 2 CPU processes (gloo), and decoding with a sharded model whose ranks finish at different steps.

tests/helpers/ddp_worker.py runs the DDP fits (Lightning re-runs that script for rank 1) and its own single-process
references; tests/helpers/sharded_sampling_worker.py is started once per rank. These tests check what they measured.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.launch import TIMEOUT, clean_env
from helpers.paths import TESTS

from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer
from lightning_gkd.toy.tiny import TINY_TEACHER, tiny_causal_lm

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ddp") / "run"
    # the hidden_server scenario's one teacher server (both ranks are its clients): the worker's teacher, seed 1
    tokenizer = build_chatml_tokenizer()
    teacher = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)
    head = out.parent / "teacher"
    teacher.save_pretrained(head)
    with FakeVLLMServer(teacher, tokenizer, max_model_len=128) as server:
        done = subprocess.run(
            [sys.executable, str(TESTS / "helpers" / "ddp_worker.py"), str(out)],
            cwd=out.parent,
            env=clean_env(LIGHTNING_GKD_TEST_HIDDEN_URL=server.url, LIGHTNING_GKD_TEST_HIDDEN_HEAD=str(head)),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    return result


def test_ddp_loss_equals_one_process_with_the_doubled_batch(ddp):
    """Rows whose completions all have the same token count: DDP's per-rank losses are token means over equal
    counts, so the mean of the two ranks' losses IS the token mean over all 8 rows, and DDP's averaged gradient is
    the gradient of one process training on the doubled batch (the real loader at batch_size=8, same rows per
    step). Loss per step (mean over ranks) and final weights must match that process."""
    r = ddp["parity_equal"]
    assert all(n == r["completion_tokens"][0][0] for rank in r["completion_tokens"] for n in rank)
    assert r["prompts_match_rank_groups"] == [True, True]  # each rank trained on its rank_groups share
    assert r["doubled_rows_are_both_ranks"]  # the single process saw exactly the union, step by step
    assert r["sources"] == [["dataset"] * 3] * 2
    assert r["ddp_mean_losses"] == pytest.approx(r["doubled_losses"], rel=1e-5)
    assert r["ddp_mean_losses"] == pytest.approx(r["half_mean_losses"], rel=1e-5)
    assert r["weights_rank0_vs_rank1"] == 0.0  # replicas stay identical
    assert r["weights_changed"] > 1e-3  # the steps did move the student...
    assert r["weights_vs_doubled"] < 1e-6 and r["weights_vs_half_mean"] < 1e-6  # ...the same way as one process


def test_ddp_with_uneven_token_counts_equals_one_process_with_the_doubled_batch(ddp):
    """Natural rows: the ranks' completion token counts differ. With loss_normalization="step" (the default) each
    rank backpropagates its token sum and the step's gradients are divided by the token count of both ranks
    (all-reduced), so DDP trains on the token mean over the doubled batch, as one process would (TRL's
    num_items_in_batch) -- not on the mean of the two ranks' token means, which weights a token of the shorter rank
    more."""
    r = ddp["parity_uneven"]
    n0, n1 = r["completion_tokens"]
    assert n0 != n1  # the case this test is about
    assert r["prompts_match_rank_groups"] == [True, True] and r["doubled_rows_are_both_ranks"]
    assert r["ddp_token_mean_losses"] == pytest.approx(r["doubled_losses"], rel=1e-5)  # every step
    assert r["weights_rank0_vs_rank1"] == 0.0
    assert r["weights_changed"] > 1e-3 and r["weights_vs_doubled"] < 1e-6
    (t0, t1) = (n0[0], n1[0])
    assert t0 + t1 == r["doubled_step0_tokens"]
    # the mean of the per-rank means is a different objective, and it shows in the weights
    assert r["weights_vs_half_mean"] > 100 * max(r["weights_vs_doubled"], 1e-9)


def test_ddp_ranks_flip_the_same_coin(ddp):
    r = ddp["flips"]
    rank0, rank1 = r["flips"]
    assert len(rank0) == 8 and rank0 == rank1  # [global_step, batch_idx, source] per step, on both ranks
    sources = [source for _, _, source in rank0]
    assert set(sources) == {"student", "dataset"}
    assert r["trained_sources"] == [sources, sources]
    assert r["sampling_calls"] == [sources.count("student")] * 2  # one per on-policy step, on each rank


def test_ddp_grouped_generation_samples_once_per_group_on_each_rank(ddp):
    r = ddp["grouped"]
    steps, k = r["steps"], r["k"]
    trained_by_rank = []
    for rank in r["ranks"]:
        assert rank["sampling_calls"] == steps // k == len(rank["sampled"])
        assert rank["steps"] == list(range(steps)) and set(rank["sources"]) == {"student"}
        sampled = [tuple(p) for call in rank["sampled"] for p in call]
        trained = [tuple(p) for step in rank["trained"] for p in step]
        # each group's k micro-batches are a permutation of the group's sampled prompts
        for g in range(steps // k):
            group = [tuple(p) for p in rank["sampled"][g]]
            micro = [tuple(p) for step in rank["trained"][g * k : (g + 1) * k] for p in step]
            assert sorted(micro) == sorted(group)
        assert sampled == [tuple(p) for p in rank["expected"]]  # the loader's rank_groups share, in order
        assert len(set(trained)) == len(trained)
        trained_by_rank.append(set(trained))
    assert not trained_by_rank[0] & trained_by_rank[1]  # the ranks' prompts are disjoint


def test_ddp_asynchronous_rollouts_sample_each_ranks_own_rows_one_step_behind(ddp):
    r = ddp["asynchronous"]
    trained_by_rank = []
    for rank in r["ranks"]:
        assert rank["sources"] == ["student"] * r["steps"]
        trained = [tuple(p) for step in rank["trained"] for p in step]
        assert trained == [tuple(p) for p in rank["expected"]]  # this rank's rows, in the loader's order, once each
        staleness = rank["staleness"]
        assert staleness["staleness/0"] == 1 and staleness["staleness/1"] == r["steps"] - 1
        assert staleness["dropped"] == 0
        trained_by_rank.append(set(trained))
    assert not trained_by_rank[0] & trained_by_rank[1]  # no row sampled by two ranks


def test_sharded_sampling_with_uneven_eos_does_not_hang(tmp_path):
    """Regression for the all-reduced early stop in sample_tokens: with an FSDP2-sharded model every forward is a
    collective, so rank 0 (all rows done after 1 token) must keep decoding until rank 1 is done."""
    out = tmp_path / "out"
    env = clean_env(WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "helpers" / "sharded_sampling_worker.py"), str(out)],
            cwd=tmp_path,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n" + "\n".join(log[-3000:] for log in logs)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    steps = ranks[0]["unsharded_steps"]  # unsharded greedy: tokens until the first EOS, per rank and row
    assert max(steps[0]) == 1 and min(steps[1]) > 1  # rank 0 finishes at its first token, rank 1 does not
    expected_n = max(max(s) for s in steps)
    for rank, r in enumerate(ranks):
        assert r["is_sharded"] and r["world_size"] == 2
        n = len(r["sharded"][0])
        assert n == expected_n  # every rank decodes as long as the slowest one
        assert r["sharded_forwards"] == n  # prefill + n - 1 decode steps, the same on both ranks
        unsharded = r["unsharded"]
        assert len(unsharded[0]) == max(steps[rank])  # alone, a rank stops at its own last EOS
        for got, want in zip(r["sharded"], unsharded, strict=True):
            assert got[: len(want)] == want and all(t == r["pad"] for t in got[len(want) :])


def test_ddp_with_accumulation_on_top_equals_one_process_with_the_whole_step(ddp):
    """2 ranks x 2 accumulated micro-batches of 2 natural rows (uneven token counts): the update is the gradient of
    the token mean over all 8 rows of the step, as one process training on them."""
    r = ddp["accumulated"]
    assert r["micro_batches_per_step"] == [4, 4]  # 2 ranks x 2 micro-batches each
    assert any(len(set(tokens)) > 1 for tokens in r["micro_batch_tokens"])
    assert r["token_mean_losses"] == pytest.approx(r["doubled_losses"], rel=1e-5)
    assert r["weights_changed"] > 1e-3 and r["weights_vs_doubled"] < 1e-6


def test_ddp_with_a_teacher_of_another_tokenizer_equals_one_process_with_the_doubled_batch(ddp):
    """Cross-tokenizer distillation under DDP: the loss is a mean over byte-aligned groups, and the step's normaliser
    counts groups over both ranks (all-reduced like tokens), so the update equals one process's on the doubled
    batch (its rows' prompt messages travel with them through the rank-sharded loader)."""
    r = ddp["cross_tokenizer"]
    assert r["cross_path"]
    assert r["weights_rank0_vs_rank1"] == 0.0
    assert r["weights_changed"] > 1e-3 and r["weights_vs_doubled"] < 1e-6


def test_ddp_with_tools_equals_one_process_rolling_out_the_doubled_batch(ddp):
    """Each rank rolls out its own rows (the tools run on that rank); the transcripts' token counts differ between
    ranks, and the step's token mean over both ranks gives the weights of one process on the doubled batch."""
    r = ddp["tools"]
    assert r["completion_tokens"][0] != r["completion_tokens"][1]
    assert r["weights_changed"] > 1e-3 and r["weights_vs_doubled"] < 1e-6


def test_ddp_with_one_hidden_state_server_equals_one_process_with_the_teacher_in_process(ddp):
    """Both ranks read their rows' teacher states from one pooling server (float32 on the wire) and score them with
    the head read from the teacher's folder: the update equals one process with the teacher in process on the
    doubled batch."""
    r = ddp["hidden_server"]
    assert r["weights_rank0_vs_rank1"] == 0.0
    assert r["weights_changed"] > 1e-3 and r["weights_vs_doubled"] < 1e-5
