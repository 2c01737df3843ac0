"""One rank of a 2-process gloo group decoding with an FSDP2-sharded model whose ranks finish at different steps;
for tests/training/test_ddp.py. Each rank writes <out>/rank<r>.json.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/helpers/sharded_sampling_worker.py <out_dir>

The model is the shipped toy student (a 2x64 Qwen2 that answers the toy task and ends with <|im_end|>; a random tiny
model only repeats its last prompt token, so it never stops at different steps). Rank 0 plans on the unsharded
model and broadcasts: ``eos_token_id = [<|im_end|>, x]`` where ``x`` is the first greedy token of rank 0's prompts,
so rank 0's rows are all finished after one token; rank 1's prompts are ones whose greedy answers never produce
``x`` and end (at <|im_end|>) only after several tokens. Then both ranks decode greedily with the sharded model
(every forward all-gathers parameters, so a rank that stopped early would leave the other waiting forever; the
group's timeout turns such a hang into an error) and with an unsharded copy, and record both outputs.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.models.sharding import is_sharded, shard_causal_lm
from lightning_gkd.ops.decoding.sampling import sample_tokens
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

MAX_NEW_TOKENS = 12
ROWS_PER_RANK = 2


def load_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(asset_path("toy/student_init")).eval()


def greedy(model, batch, eos, pad_id) -> torch.Tensor:
    return sample_tokens(
        model,
        batch["prompts"],
        batch["prompt_attention_mask"],
        max_new_tokens=MAX_NEW_TOKENS,
        pad_token_id=pad_id,
        eos_token_id=eos,
        do_sample=False,
    )


def finish_step(tokens: list[int], eos: list[int]) -> int:
    """Tokens a row decodes until (and including) its first EOS; MAX_NEW_TOKENS when it has none."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), MAX_NEW_TOKENS)


def plan(model, tokenizer, collator) -> dict:
    """Rows per rank and the EOS ids: rank 0 done after its first token, rank 1 after several."""
    rows = addition_rows("test", 48)
    free = greedy(model, collator(rows), None, tokenizer.pad_token_id).tolist()
    end = tokenizer.eos_token_id
    firsts = [seq[0] for seq in free]
    x = max(set(firsts), key=lambda t: (firsts.count(t), -t))  # the most common first token
    rank0 = [i for i, t in enumerate(firsts) if t == x][:ROWS_PER_RANK]
    eos = [end, x]
    late = [
        i
        for i, seq in enumerate(free)
        if firsts[i] != x and finish_step(seq, eos) >= 4 and end in seq[: finish_step(seq, eos)]
    ]  # ends at <|im_end|>, never at x, after >= 4 tokens
    late.sort(key=lambda i: (-finish_step(free[i], eos), i))
    assert len(rank0) == ROWS_PER_RANK and len(late) >= ROWS_PER_RANK, (firsts, late)
    rank1 = [late[0], late[-1]]  # the longest and the shortest qualifying answers
    return {
        "eos": eos,
        "rows": [[rows[i] for i in rank0], [rows[i] for i in rank1]],
        "unsharded_steps": [[finish_step(free[i], eos) for i in rank0], [finish_step(free[i], eos) for i in rank1]],
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    tokenizer = build_chatml_tokenizer()
    collator = ChatMLCollator(tokenizer, max_length=64)
    plain = load_model()
    box = [plan(plain, tokenizer, collator) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    the_plan = box[0]
    eos, pad_id = the_plan["eos"], tokenizer.pad_token_id

    from torch.distributed.device_mesh import init_device_mesh

    sharded = shard_causal_lm(load_model(), init_device_mesh("cpu", (dist.get_world_size(),)))
    forwards = []
    sharded.register_forward_hook(lambda module, args, output: forwards.append(1))
    batch = collator(the_plan["rows"][rank])  # different prompts on each rank
    start = time.perf_counter()
    sharded_out = greedy(sharded, batch, eos, pad_id)
    seconds = time.perf_counter() - start
    plain_out = greedy(plain, batch, eos, pad_id)
    dist.barrier()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world_size": dist.get_world_size(),
                "is_sharded": is_sharded(sharded),
                "eos": eos,
                "pad": pad_id,
                "max_new_tokens": MAX_NEW_TOKENS,
                "unsharded_steps": the_plan["unsharded_steps"],
                "sharded": sharded_out.tolist(),
                "unsharded": plain_out.tolist(),
                "sharded_forwards": len(forwards),
                "seconds": seconds,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
