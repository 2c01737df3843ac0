"""lightning_gkd.ops.decoding.turn_cache: which kept row a new row continues, the re-padded keys and values, the
suffixes, the consumed columns of a finished decode, and a prefill on kept KV against a prefill of the whole rows."""

from __future__ import annotations

import pytest
import torch

from lightning_gkd.ops.decoding.kv_decoders import DynamicKVDecoder
from lightning_gkd.ops.decoding.turn_cache import (
    KeptKV,
    gather_kv,
    is_left_padded,
    kept_kv,
    match_rows,
    row_tokens,
    suffix_inputs,
    weights_fingerprint,
)
from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm


def test_a_new_row_continues_the_longest_kept_row_it_starts_with():
    kept = [[1, 2, 3], [1, 2], [7, 8, 9, 10], []]
    new = [[1, 2, 3, 4], [1, 2, 5], [7, 8, 9, 10], [6], [7, 8], [1, 2, 3, 4, 5]]
    sources, reuse = match_rows(kept, new)
    assert sources == [0, 1, 2, -1, -1, 0]
    # the whole kept row, but at least one token left to prefill; no match, no reuse
    assert reuse == [3, 2, 3, 0, 0, 3]


def test_suffixes_are_the_tokens_after_the_reused_ones_left_padded():
    ids = torch.tensor([[0, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [0, 0, 0, 0, 11, 12]])
    mask = (ids != 0).long()
    assert is_left_padded(mask) and not is_left_padded(torch.tensor([[1, 0, 1]]))
    assert row_tokens(ids, mask) == [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]
    suffix, suffix_mask = suffix_inputs(ids, mask, torch.tensor([2, 3, 0]))
    assert suffix.tolist() == [[2, 3, 4], [8, 9, 10], [0, 11, 12]]
    assert suffix_mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 1, 1]]
    with pytest.raises(ValueError, match="at least one token"):
        suffix_inputs(ids, mask, torch.tensor([4, 0, 0]))


def test_a_finished_decode_keeps_its_context_and_the_sampled_tokens_it_fed():
    context_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion = torch.tensor([[20, 21, 2, 0], [30, 31, 32, 2]])  # EOS = 2: lengths 3 and 4; 3 steps fed
    keys = [torch.arange(2 * 1 * 6 * 1, dtype=torch.float32).reshape(2, 1, 6, 1)]
    kept = kept_kv(keys, keys, context_mask, [[5, 6], [7, 8, 9]], completion, torch.tensor([3, 4]), 3)
    # row 0: its EOS was fed (step 2 < 3 fed); row 1's EOS, the decode's last token, was not
    assert kept.columns.long().tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert kept.tokens == [[5, 6, 20, 21, 2], [7, 8, 9, 30, 31, 32]]
    with pytest.raises(ValueError, match="dropped or added columns"):
        kept_kv(keys, keys, context_mask, [[5, 6], [7, 8, 9]], completion, torch.tensor([3, 4]), 2)
    with pytest.raises(ValueError, match="context tokens"):
        kept_kv(keys, keys, context_mask, [[5], [7, 8, 9]], completion, torch.tensor([3, 4]), 3)


def test_reused_columns_are_re_padded_right_aligned_and_in_order():
    # kept row 0 holds tokens at columns 1, 2, 4 (column 3: a token it did not consume); row 1 at 0..4
    columns = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    keys = torch.arange(2 * 2 * 5 * 3, dtype=torch.float32).reshape(2, 2, 5, 3)
    kept = KeptKV([keys], [-keys], columns, [[1, 2, 3], [4, 5, 6, 7, 8]])
    past = gather_kv(kept, torch.tensor([0, -1, 1, 0]), torch.tensor([3, 0, 4, 2]))
    assert past.width == 4
    assert past.mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1]]
    out = past.keys[0]
    assert out.shape == (4, 2, 4, 3)
    assert torch.equal(out[0, :, 1:], keys[0, :, [1, 2, 4]]) and not out[0, :, 0].any()
    assert not out[1].any()
    assert torch.equal(out[2], keys[1, :, :4])
    assert torch.equal(out[3, :, 2:], keys[0, :, [1, 2]]) and not out[3, :, :2].any()
    assert torch.equal(past.values[0], -out)


def test_a_prefill_on_kept_kv_gives_the_logits_of_a_prefill_of_the_whole_rows(tokenizer):
    """Rows of uneven lengths: their first tokens prefilled (the kept cache), re-padded, then the rest prefilled on
    it; the logits after each row equal those of one prefill over the whole, left-padded rows."""
    model = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0).eval()
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
    split = [4, 1, 3]  # tokens each row reuses

    def padded(token_rows):
        width = max(len(r) for r in token_rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in token_rows])
        return ids, torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in token_rows])

    ids, mask = padded(rows)
    with torch.no_grad():
        full = DynamicKVDecoder().prefill(model, ids, mask, 1)
        first = DynamicKVDecoder()
        first_ids, first_mask = padded([r[:k] for r, k in zip(rows, split, strict=True)])
        first.prefill(model, first_ids, first_mask, 1)
        decoded = first.kept()
        assert decoded is not None and decoded.fed == 0
        kept = kept_kv(
            decoded.keys,
            decoded.values,
            decoded.context_mask,
            [r[:k] for r, k in zip(rows, split, strict=True)],
            torch.zeros(3, 1, dtype=torch.long),
            torch.ones(3, dtype=torch.long),
            0,
        )
        reuse = torch.tensor(split)
        past = gather_kv(kept, torch.arange(3), reuse)
        suffix, suffix_mask = suffix_inputs(ids, mask, reuse)
        logits = DynamicKVDecoder().prefill(model, suffix, suffix_mask, 1, past=past)
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)


def test_the_weights_fingerprint_sees_in_place_updates_and_replaced_parameters():
    layer = torch.nn.Linear(2, 2)
    before = weights_fingerprint(layer)
    with torch.no_grad():
        layer.weight.add_(1.0)
    after = weights_fingerprint(layer)
    assert after != before
    layer.bias = torch.nn.Parameter(torch.zeros(2))
    assert weights_fingerprint(layer) != after
    with torch.inference_mode():
        frozen = torch.nn.Linear(2, 2)
    assert weights_fingerprint(frozen) != weights_fingerprint(frozen)  # no version counter: never reused
