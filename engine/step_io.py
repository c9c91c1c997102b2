"""A step's tensors in and out: a ``StepInput`` turned into the forward's tensors
(``prepare_step``, ``verify_layout``), and the results read back in one host sync
(``host_rows``)."""

from __future__ import annotations

import struct
from functools import partial
from typing import Any

import torch

from tandem.engine.speculative.interface import VerifyLayout
from tandem.engine.step import PreparedInputs, RequestStep, StepInput
from tandem.kernels.attention_torch import build_attention_plan
from tandem.kernels.launch import gpu_paths
from tandem.models.attention import AttentionMetadata


def host_rows(*parts: torch.Tensor) -> list[list[list[Any]]]:
    """Several [B, ...] device tensors read back in one copy (one host sync): per part, B rows
    of its values flattened: ints for integer (and bool) parts, floats for floating ones. The
    parts travel as one int64 tensor, a floating part as its float32 bit patterns, so ids stay
    exact and are never converted value by value; only floating parts are unpacked on the host
    (struct, per row)."""
    b = parts[0].shape[0]
    if b == 0:
        return [[] for _ in parts]
    flat = [p.reshape(b, -1) for p in parts]
    wire = [
        f.float().view(torch.int32).to(torch.int64) if f.is_floating_point() else f.to(torch.int64)
        for f in flat
    ]
    rows = torch.cat(wire, dim=1).tolist()
    out: list[list[list[Any]]] = []
    start = 0
    for f in flat:
        end = start + f.shape[1]
        if f.is_floating_point():
            n = f.shape[1]
            out.append(
                [list(struct.unpack(f"{n}f", struct.pack(f"{n}i", *r[start:end]))) for r in rows]
            )
        else:
            out.append([r[start:end] for r in rows])
        start = end
    return out


def prepare_step(
    step: StepInput, device: torch.device, block_size: int, k: int, speculative: bool, vanilla: bool
) -> PreparedInputs:
    """The forward's tensors for ``step`` (ids, positions, attention metadata, the rows to
    sample, and, under speculation, each request's next prompt token and verify layout;
    ``vanilla``: vanilla MTP's future tokens). One host-to-device copy per tensor."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    logits_indices: list[int] = []
    sampled: list[RequestStep] = []
    next_tokens: list[int] = []
    future: list[list[int]] = []
    row_req: list[int] = []
    row_last: list[int] = []
    max_blocks = max(len(r.block_ids) for r in step.requests)
    tables: list[list[int]] = []
    # The window group's table and slots (sliding-window layers), when the model has one.
    windowed = bool(step.requests[0].window_block_ids)
    window_tables: list[list[int]] = []
    window_slots: list[int] = []
    for r in step.requests:
        n = len(r.token_ids)
        ids.extend(r.token_ids)
        pos = range(r.start, r.start + n)
        positions.extend(pos)
        blocks = r.block_ids
        slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
        seq_lens.append(r.start + n)
        qsl.append(qsl[-1] + n)
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        if windowed:
            wb = r.window_block_ids
            window_slots.extend(wb[p // bs] * bs + p % bs for p in pos)
            window_tables.append(wb + [0] * (max_blocks - len(wb)))
        next_tokens.append(r.next_token)
        if vanilla:
            fut = [r.next_token, *r.future_tokens][: k + 1]
            future.append(fut + [0] * (k + 1 - len(fut)))
            row_req += [len(seq_lens) - 1] * n
            row_last += [qsl[-1] - 1] * n
        if r.sample:
            logits_indices.append(qsl[-1] - 1)
            sampled.append(r)

    dev = device

    def t(x: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

    block_tables = t(tables, torch.int32)
    seq_lens_t = t(seq_lens, torch.int32)
    qsl_t = t(qsl, torch.int32)
    max_q = max(qsl[i + 1] - qsl[i] for i in range(len(seq_lens)))
    max_s = max(seq_lens)
    slot_mapping = t(slots, torch.int64)
    plan = None
    if not gpu_paths(dev):  # the CPU attention path's indices
        plan = partial(
            build_attention_plan,
            block_tables,
            seq_lens_t,
            qsl_t,
            bs,
            max_q,
            max_s,
            num_tokens=len(ids),
            full_keys=all(n == max_s for n in seq_lens),
            slot_mapping=slot_mapping,
        )
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens_t,
        query_start_loc=qsl_t,
        max_query_len=max_q,
        max_seq_len=max_s,
        plan=plan,
    )
    if windowed:  # the window group's tables, slots and CPU plan (models/attention.py)
        window_tables_t = t(window_tables, torch.int32)
        window_slots_t = t(window_slots, torch.int64)
        meta.window = AttentionMetadata(
            slot_mapping=window_slots_t,
            block_tables=window_tables_t,
            seq_lens=seq_lens_t,
            query_start_loc=qsl_t,
            max_query_len=max_q,
            max_seq_len=max_s,
            plan=(
                partial(
                    plan.func,
                    window_tables_t,
                    *plan.args[1:],
                    **{**plan.keywords, "slot_mapping": window_slots_t},
                )
                if plan is not None
                else None
            ),
        )
    inp = PreparedInputs(
        t(ids, torch.int64),
        t(positions, torch.int64),
        meta,
        t(logits_indices, torch.int64),
        sampled,
    )
    if speculative:
        inp.next_tokens = t(next_tokens, torch.int64)
        if future:
            inp.future = t(future, torch.int64)
            inp.row_req = t(row_req, torch.int64)
            inp.row_last = t(row_last, torch.int64)
        if sampled:
            inp.layout = verify_layout(step, k, tables, max_s, t, window_tables)
    return inp


def verify_layout(
    step: StepInput,
    k: int,
    tables: list[list[int]],
    max_s: int,
    t: Any,
    window_tables: list[list[int]] | None = None,
) -> VerifyLayout:
    """Where each sampled request's K + 1 verify rows, drafts and block table (and the window
    group's, when ``window_tables`` is not empty) sit in the step's rows (``t``: a host list to
    a device tensor)."""
    rows, drafts, num_drafts, first_rows, first_pos, sampled_tables = [], [], [], [], [], []
    sampled_window_tables = []
    owner: list[int] = []
    offset = 0
    for i, r in enumerate(step.requests):
        n = len(r.token_ids)
        owner += [len(rows) if r.sample else -1] * n
        if r.sample:
            first = offset + n - 1 - r.num_drafts
            rows.append([first + min(j, r.num_drafts) for j in range(k + 1)])
            d = r.token_ids[n - r.num_drafts :] if r.num_drafts else []
            drafts.append(d + [0] * (k - len(d)))
            num_drafts.append(r.num_drafts)
            first_rows.append(first)
            first_pos.append(r.start + n - 1 - r.num_drafts)
            sampled_tables.append(tables[i])
            if window_tables:
                sampled_window_tables.append(window_tables[i])
        offset += n
    return VerifyLayout(
        rows=t(rows, torch.int64),
        drafts=t(drafts, torch.int64),
        num_drafts=t(num_drafts, torch.int64),
        first_row=t(first_rows, torch.int64),
        positions=t(first_pos, torch.int64),
        block_tables=t(sampled_tables, torch.int32),
        row_owner=t(owner, torch.int64),
        max_seq_len=max_s + k,
        window_block_tables=(
            t(sampled_window_tables, torch.int32) if sampled_window_tables else None
        ),
    )
