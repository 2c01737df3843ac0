"""A two-process DDP fit on CPU (gloo) for tests/methods/test_gkd_teachers.py: a teacher server that goes down for
rank 1 only. Every rank writes <out>/rank<r>.json: how its fit ended, its step, what its ``TeacherOutage`` saved.

    python tests/helpers/teacher_outage_ddp_worker.py <out_dir>

Lightning starts rank 1 by re-running this script. Each rank serves the teacher (a tiny random Qwen2) from its own
stand-in vLLM server (lightning_gkd/testing/fake_vllm_server.py), as when every node has its own; rank 1's server stops
after optimizer step ``DOWN_AFTER``, so from step ``DOWN_AFTER + 1`` on its requests are refused. The process
group's timeout is ``TIMEOUT_S``: a rank left waiting in a collective the other never joins fails after it.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.*

from helpers.launch import two_process_trainer  # noqa: E402
from lightning_gkd import ChatDataModule, GKDModule  # noqa: E402
from lightning_gkd.data.tokenizer import build_chatml_tokenizer  # noqa: E402
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer  # noqa: E402
from lightning_gkd.toy import addition_rows  # noqa: E402
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm  # noqa: E402
from lightning_gkd.training.teacher_outage import TeacherOutage  # noqa: E402

DOWN_AFTER, MAX_STEPS, TIMEOUT_S = 2, 5, 30


class ServerDownOnRank1(L.Callback):
    """Stops ``server`` at the end of optimizer step ``DOWN_AFTER`` on rank 1 (connections then refused)."""

    def __init__(self, server: FakeVLLMServer) -> None:
        self.server = server

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == 1 and trainer.global_step == DOWN_AFTER:
            self.server.stop()


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    tokenizer = build_chatml_tokenizer()
    teacher = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)
    with FakeVLLMServer(teacher, tokenizer, max_model_len=128) as server:
        spec = {"kind": "server", "url": server.url, "top_k": 20, "retries": 1, "backoff": 0.01, "timeout": 10}
        module = GKDModule(
            tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
            spec,
            tokenizer,
            lmbda=0.0,
            divergence={"beta": 0.0},
            training={"optimizer": partial(torch.optim.SGD, lr=0.1)},
        )
        data = ChatDataModule(tokenizer, addition_rows("train", 32), batch_size=2, max_length=64)
        trainer = two_process_trainer(out, "ddp", MAX_STEPS, timeout_s=TIMEOUT_S, callbacks=[ServerDownOnRank1(server)])
        started = time.perf_counter()
        try:
            trainer.fit(module, datamodule=data)
            ended = {"error": None, "message": None}
        except BaseException as error:  # what each rank saw: the point of the test
            ended = {"error": type(error).__name__, "message": str(error)}
    outage = next(c for c in trainer.callbacks if isinstance(c, TeacherOutage))  # type: ignore[attr-defined]
    result = {
        **ended,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "saved": str(outage.saved_path) if outage.saved_path else None,
        "seconds": time.perf_counter() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
