"""The cross-tokenizer ``likelihood`` / ``projected`` loss as it was before it was vectorised (per-token Python
loops), kept as the reference the vectorised batch path must equal: the projection tables as mappings, the projected
targets walking the tokens, and one row's per-group terms."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lightning_gkd.data.retokenize import _TokenBytes
from lightning_gkd.ops.cross_tokenizer.chunk_likelihood import (
    _project,
    binary_jsd,
    chunk_log_likelihoods,
    projected_distance,
)
from lightning_gkd.ops.cross_tokenizer.token_alignment import align_byte_spans, end_token_count, token_id_list


def reference_tables(student_tokenizer, teacher_tokenizer):
    """``(first_token, token_bytes, extensions)`` built token by token (the old ``projection_tables``)."""
    teacher_bytes = _TokenBytes(teacher_tokenizer)
    token_bytes: list[bytes | None] = []
    for index in range(len(teacher_tokenizer)):
        if index in teacher_bytes.added:
            token_bytes.append(None)
            continue
        pieces = teacher_bytes._mapped([index])
        token_bytes.append(pieces[0] if pieces is not None else teacher_bytes.text([index]).encode())

    def first_tokens(texts):
        out = []
        for raw in texts:
            try:
                ids = student_tokenizer(raw.decode("utf-8"), add_special_tokens=False)["input_ids"]
            except UnicodeDecodeError:
                ids = []
            out.append(ids[0] if ids else -1)
        return out

    student_vocab = student_tokenizer.get_vocab()
    plain = {index: raw for index, raw in enumerate(token_bytes) if raw is not None}
    first = torch.full((len(token_bytes),), -1, dtype=torch.long)
    for index, target in zip(plain, first_tokens(list(plain.values())), strict=True):
        first[index] = target
    for index, token in teacher_tokenizer.added_tokens_decoder.items():
        if index < len(token_bytes) and token.content in student_vocab:
            first[index] = student_vocab[token.content]
    teacher_eos, student_eos = teacher_tokenizer.eos_token_id, student_tokenizer.eos_token_id
    if teacher_eos is not None and student_eos is not None and int(first[teacher_eos]) < 0:
        first[teacher_eos] = student_eos
    extensions: dict[bytes, tuple[list[int], list[int]]] = {}
    for index, raw in plain.items():
        for cut in range(1, len(raw)):
            (target,) = first_tokens([raw[cut:]])
            if target >= 0:
                ids, cols = extensions.setdefault(raw[:cut], ([], []))
                ids.append(index)
                cols.append(target)
    return first, token_bytes, {key: (torch.tensor(ids), torch.tensor(cols)) for key, (ids, cols) in extensions.items()}


def reference_targets(
    teacher_probs: torch.Tensor,
    teacher_ids: Sequence[int],
    teacher_spans: Sequence[Sequence[int]],
    student_starts: Sequence[int],
    *,
    student_vocab: int,
    first_token: torch.Tensor,
    token_bytes: Sequence[bytes | None],
    extensions: Mapping[bytes, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The old ``projected_teacher_targets``: a walk over the student positions with a teacher cursor."""
    n_t = teacher_probs.size(0)
    a_rows, a_cols, a_teacher_rows, a_teacher_cols = [], [], [], []
    b_rows, b_here, b_next, b_token = [], [], [], []
    previous = None
    cursor, n_spans = 0, len(teacher_spans)
    for p, b in enumerate(student_starts):
        if b == previous:
            continue
        previous = b
        if b == 0:
            if n_t:
                b_rows.append(p)
                b_here.append(-1)
                b_next.append(0)
                b_token.append(-1)
            continue
        while cursor < n_spans and teacher_spans[cursor][1] < b:
            cursor += 1
        if cursor == n_spans or teacher_spans[cursor][0] >= b:
            continue
        k = cursor
        start, end = teacher_spans[k]
        raw = token_bytes[teacher_ids[k]] if teacher_ids[k] < len(token_bytes) else None
        if raw is not None and (found := extensions.get(raw[: b - start])) is not None:
            ids, cols = found
            within = ids < teacher_probs.size(-1)
            a_rows += [p] * int(within.sum())
            a_cols.append(cols[within])
            a_teacher_rows += [k] * int(within.sum())
            a_teacher_cols.append(ids[within])
        if end == b and k + 1 < n_t:
            b_rows.append(p)
            b_here.append(k)
            b_next.append(k + 1)
            b_token.append(teacher_ids[k])
    targets = teacher_probs.new_zeros(len(student_starts), student_vocab)
    if a_rows:
        values = teacher_probs[torch.tensor(a_teacher_rows), torch.cat(a_teacher_cols)]
        targets.index_put_((torch.tensor(a_rows), torch.cat(a_cols)), values, accumulate=True)
    if b_rows:
        projected = _project(teacher_probs[torch.tensor(b_next)], first_token, student_vocab)
        here = torch.tensor(b_here)
        scale = torch.where(
            here >= 0,
            teacher_probs[here.clamp_min(0), torch.tensor(b_token).clamp_min(0)],
            torch.ones_like(here, dtype=teacher_probs.dtype),
        )
        targets.index_add_(0, torch.tensor(b_rows), projected * scale[:, None])
    mass = targets.sum(-1)
    positions = torch.nonzero(mass > 0).squeeze(-1)
    return positions, targets[positions] / mass[positions, None]


def reference_row_terms(
    student_logits, teacher_logits, student_ids, teacher_ids, student_spans, teacher_spans, *, settings, parts=None
) -> torch.Tensor:
    """One row's per-group ``likelihood`` / ``projected`` terms, the old way; ``parts``: ``(first_token,
    token_bytes, extensions)``."""
    s_ids, t_ids = token_id_list(student_ids), token_id_list(teacher_ids)
    n_s, n_t = len(s_ids), len(t_ids)
    if settings.skip_student_eos:
        n_s -= end_token_count(student_spans)
    if settings.skip_teacher_eos:
        n_t -= end_token_count(teacher_spans)
    if settings.alignment == "bytes":
        s_groups, t_groups = align_byte_spans(student_spans[:n_s], teacher_spans[:n_t])
        pairs = [(sg, tg) for sg, tg in zip(s_groups, t_groups, strict=True) if sg and tg]
    else:
        pairs = [([k], [k]) for k in range(min(n_s, n_t))]
    student_logp = chunk_log_likelihoods(
        student_logits[:n_s], [sg for sg, _ in pairs], s_ids[:n_s], settings.student_temperature
    )
    teacher_logp = chunk_log_likelihoods(
        teacher_logits[:n_t], [tg for _, tg in pairs], t_ids[:n_t], settings.teacher_temperature
    )
    chunks = binary_jsd(student_logp, teacher_logp, settings.beta)
    if settings.loss == "likelihood":
        return chunks
    first_token, token_bytes, extensions = parts
    logits = teacher_logits[:n_t]
    logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    with torch.no_grad():
        teacher_probs = torch.softmax(logits / settings.teacher_temperature, dim=-1)
    positions, targets = reference_targets(
        teacher_probs,
        t_ids[:n_t],
        teacher_spans[:n_t],
        [start for start, _ in student_spans[:n_s]],
        student_vocab=student_logits.size(-1),
        first_token=first_token,
        token_bytes=token_bytes,
        extensions=extensions,
    )
    per_position = student_logits.new_zeros(n_s, dtype=chunks.dtype)
    if positions.numel():
        distances = projected_distance(student_logits[positions], targets, settings.beta, settings.student_temperature)
        per_position = per_position.index_put((positions,), distances.to(chunks.dtype))
    owner = torch.tensor([g for g, (sg, _) in enumerate(pairs) for _ in sg], dtype=torch.long)
    members = torch.tensor([k for sg, _ in pairs for k in sg], dtype=torch.long)
    per_group = chunks.new_zeros(len(pairs)).index_add(0, owner, per_position[members]) if pairs else chunks
    return per_group + chunks
