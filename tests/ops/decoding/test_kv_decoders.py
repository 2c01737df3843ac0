"""lightning_gkd.ops.decoding.kv_decoders and the decode loop's properties a GPU feels, held on the CPU: the static and
compiled decoders sample what the dynamic one does (across families), a decode reads the device back a constant
number of times (not once per token), and the compiled path compiles once per shape bucket."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers.tiny_registry import build_tiny, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gkd.ops.decoding.kv_decoders import (
    DynamicKVDecoder,
    StaticKVDecoder,
    make_decoder,
    resolve_decode,
)
from lightning_gkd.ops.decoding.sampling import LaggedFlag, sample_tokens

VOCAB = 64
#: families with a static cache in transformers: the sampler tests' three (fast tier), then sliding windows (gemma2,
#: mistral, gemma3_text), fused projections (phi3) and per-layer norms (olmo2, qwen3) in the slow tier
FAMILIES = ["qwen2", "llama", "gpt2"] + [
    pytest.param(family, marks=pytest.mark.slow)
    for family in ("gemma2", "mistral", "phi3", "olmo2", "gemma3_text", "qwen3")
]


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.casts: list[tuple[tuple[int, ...], torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        if name == "_to_copy" and "dtype" in kwargs and kwargs["dtype"] != args[0].dtype:
            self.casts.append((tuple(args[0].shape), args[0].dtype, kwargs["dtype"]))
        return func(*args, **kwargs)

    @property
    def host_reads(self) -> int:
        """Reads of a tensor's value by the host (``.item()``, ``bool(t)``, ``int(t)``): on a GPU, each one waits for
        the device to drain."""
        return self.counts["_local_scalar_dense"] + self.counts["item"]


def prompts(batch: int = 3, length: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of uneven lengths."""
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : row % 3 * 2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def decode(model, ids, mask, decoder=None, **options):
    options = {"max_new_tokens": 12, "pad_token_id": 0, "eos_token_id": None, "do_sample": False} | options
    logprobs: list[torch.Tensor] = []
    out = sample_tokens(model, ids, mask, decoder=decoder, logprobs_out=logprobs, **options)
    return out, logprobs[0]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return build_tiny(tiny_config(request.param, VOCAB), seed=0).eval()


def greedy_against_dynamic_and_generate(model, decoder) -> None:
    ids, mask = prompts()
    want, want_logprobs = decode(model, ids, mask, DynamicKVDecoder())
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(want, generated[:, ids.shape[1] :])
    got, got_logprobs = decode(model, ids, mask, decoder)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logprobs, want_logprobs, atol=1e-4, rtol=0)


def test_static_greedy_equals_the_dynamic_decode_and_generate(family_model):
    greedy_against_dynamic_and_generate(family_model, StaticKVDecoder())


@pytest.mark.slow
def test_compiled_greedy_equals_the_dynamic_decode_and_generate(family_model):
    """Traced by dynamo (the eager backend: no kernels generated), prompts and batch padded to their buckets."""
    greedy_against_dynamic_and_generate(family_model, StaticKVDecoder(compile=True, backend="eager", prompt_bucket=16))


def test_static_seeded_sampling_equals_the_dynamic_decode():
    model = build_tiny(tiny_config("qwen2", VOCAB), seed=0).eval()
    ids, mask = prompts(batch=4, seed=1)
    options = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.95, "max_new_tokens": 16}
    want = decode(model, ids, mask, DynamicKVDecoder(), generator=torch.Generator().manual_seed(5), **options)
    got = decode(model, ids, mask, StaticKVDecoder(), generator=torch.Generator().manual_seed(5), **options)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)


def eos_after_a_few_tokens(model, ids, mask) -> list[int]:
    """EOS ids that end every row's greedy decode within its first five tokens, at different steps."""
    greedy, _ = decode(model, ids, mask)
    return sorted({int(greedy[row, 1 + row]) for row in range(ids.shape[0])})


@pytest.mark.parametrize("lag", [1, 3, 8])
@pytest.mark.parametrize("sample", [False, True])
def test_a_late_finished_flag_decodes_past_the_last_eos_and_trims_to_the_same_samples(lag, sample):
    model = build_tiny(tiny_config("llama", VOCAB), seed=2).eval()
    ids, mask = prompts()
    eos = eos_after_a_few_tokens(model, ids, mask)
    options = {"eos_token_id": eos, "do_sample": sample, "temperature": 0.7, "max_new_tokens": 16}
    want = decode(model, ids, mask, finished_lag=0, generator=torch.Generator().manual_seed(3), **options)
    assert want[0].shape[1] < 16  # every row stopped early
    for decoder in (DynamicKVDecoder(), StaticKVDecoder()):
        got = decode(model, ids, mask, decoder, finished_lag=lag, generator=torch.Generator().manual_seed(3), **options)
        assert torch.equal(got[0], want[0])
        # the static cache attends over its whole (masked) length: the same log-probs up to summation order
        torch.testing.assert_close(got[1], want[1], atol=1e-5 if isinstance(decoder, StaticKVDecoder) else 0, rtol=0)


def test_lagged_flag_returns_each_flag_lag_pushes_late():
    flag = LaggedFlag(2, torch.device("cpu"))
    seen = [flag.push(torch.tensor(value)) for value in (False, True, False, True, True)]
    assert seen == [False, False, False, True, False]
    assert [LaggedFlag(0, torch.device("cpu")).push(torch.tensor(v)) for v in (False, True)] == [False, True]


def test_a_static_decode_reads_the_device_a_constant_number_of_times_not_once_per_token():
    """Today's decode (dynamic cache, flag read at once) reads a device value at every token: transformers' mask
    check and the 'all rows finished?' check. The static cache with a late flag reads it once or twice a decode."""
    model = build_tiny(tiny_config("qwen2", VOCAB), seed=0).eval()
    ids, mask = prompts()
    eos = [VOCAB - 1]  # never sampled greedily here: the decode runs all its tokens
    reads = {}
    for name, decoder, lag in (("dynamic", DynamicKVDecoder(), 0), ("static", StaticKVDecoder(), 4)):
        for new_tokens in (8, 24):
            with OpCounter() as counter:
                decode(model, ids, mask, decoder, max_new_tokens=new_tokens, eos_token_id=eos, finished_lag=lag)
            reads[name, new_tokens] = counter.host_reads
    assert reads["dynamic", 24] - reads["dynamic", 8] >= 16  # one per token (and a finished check on a GPU)
    assert reads["static", 24] == reads["static", 8] <= 2


@pytest.mark.parametrize("trainable", [True, False])
def test_the_sampling_copy_decodes_under_autocast_without_casting_a_weight(trainable):
    """Under bf16 autocast (the step of bf16-mixed training) a float32 model's weights are cast to bf16 for the
    decode: once per step for trainable weights (autocast's cache), at every forward for frozen ones (a LoRA base, a
    frozen teacher). Its bf16 sampling copy decodes with autocast off and casts no weight, in fewer operators."""
    from lightning_gkd.samplers import KVCacheSampler

    model = build_tiny(tiny_config("qwen2", VOCAB), seed=0).eval().requires_grad_(trainable)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_shapes = {tuple(p.shape) for p in weights}
    ids, mask = prompts()
    tokenizer = type("Tok", (), {"pad_token_id": 0, "eos_token_id": None})()
    ops, casts = {}, {}
    for dtype in (None, "bfloat16"):
        sampler = KVCacheSampler(tokenizer, max_new_tokens=10, weights_dtype=dtype, matmul_precision=None)
        sampler.sample(model, ids, mask, seed=0)  # the copy is made outside the count
        with torch.autocast("cpu", dtype=torch.bfloat16), OpCounter() as counter:
            out = sampler.sample(model, ids, mask, seed=0)
        tokens = out["input_ids"].shape[1] - ids.shape[1]
        casts[dtype] = [c for c in counter.casts if c[0] in weight_shapes and c[1] == torch.float32]
        ops[dtype] = sum(counter.counts.values()) / tokens
    forwards = 10
    assert len(casts[None]) >= len(weights) * (1 if trainable else forwards)
    assert casts["bfloat16"] == []
    assert ops["bfloat16"] < ops[None]


def test_the_compiled_decode_compiles_once_per_shape_bucket():
    """Prompts of 5, 9 and 13 tokens and batches of 3 and 4 share one bucket (16 tokens, 4 rows): one graph; a
    20-token prompt opens the next bucket: one more."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_tiny(tiny_config("qwen2", VOCAB), seed=0).eval()
    decoder = StaticKVDecoder(compile=True, backend="eager", prompt_bucket=16)
    graphs = []
    for batch, length in ((3, 5), (4, 9), (3, 13), (4, 13), (3, 20)):
        ids, mask = prompts(batch, length)
        got, _ = decode(model, ids, mask, decoder, max_new_tokens=6)
        assert torch.equal(got, decode(model, ids, mask, max_new_tokens=6)[0])
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1, 1, 2]
    assert not counters["recompiles"] or sum(counters["recompiles"].values()) <= 1


@pytest.mark.slow
def test_the_inductor_compiled_decode_equals_eager_greedy_and_does_not_recompile():
    """The default backend (inductor, C++ kernels on the CPU): ~15 s to compile a tiny model."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_tiny(tiny_config("qwen2", VOCAB), seed=0).eval()
    decoder = make_decoder("compiled", prompt_bucket=16)
    for length in (7, 12):
        ids, mask = prompts(3, length)
        assert torch.equal(decode(model, ids, mask, decoder)[0], decode(model, ids, mask)[0])
    assert counters["stats"]["unique_graphs"] == 1


def test_resolve_decode_picks_the_dynamic_decoder_on_the_cpu_and_refuses_static_for_other_models(monkeypatch):
    from lightning_gkd.ops.decoding import kv_decoders

    model = build_tiny(tiny_config("qwen2", VOCAB), seed=0)
    cpu = torch.device("cpu")
    assert resolve_decode("auto", model, cpu) == "dynamic"
    assert resolve_decode("auto", model, torch.device("cuda")) == "compiled"
    with monkeypatch.context() as patch:  # an FSDP2-sharded student: each forward is a collective
        patch.setattr(kv_decoders, "is_sharded", lambda module: True)
        assert resolve_decode("auto", model, torch.device("cuda")) == "dynamic"
    assert resolve_decode("static", model, cpu) == "static"
    with pytest.raises(ValueError, match=r"decode=compiled needs a transformers model .* Use decode=dynamic"):
        resolve_decode("compiled", torch.nn.Linear(2, 2), cpu)
    with pytest.raises(ValueError, match=r"decode must be one of"):
        resolve_decode("graphs", model, cpu)
