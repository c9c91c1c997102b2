"""Token sampling: pure tensor functions over the last-position logits of a batch.

One engine step calls `sample(logits, st)` once. Every stage is a side-effect-free function of
its inputs (the only state touched is the random generators), there are no Python loops over
the vocabulary, and nothing here reads a tensor value on the host: the engine does the step's
single `.tolist()` on the result. Host-side decisions (which stages to skip) come from flags
computed by `SamplingTensors.from_params` out of the Python parameters.

Semantics follow what users know from OpenAI / Hugging Face / vLLM:
- ``logit_bias`` (OpenAI) adds its values to the raw logits, before the penalties;
- presence / frequency penalties count OUTPUT tokens only (OpenAI);
- repetition penalty covers prompt + output tokens: logit > 0 -> logit / p, else logit * p;
- order for random rows: min_tokens' stop-token ban -> logit bias -> penalties -> temperature ->
  min_p -> top-k -> top-p -> softmax (the speculative verifier bans per verified position first,
  and counts the drafts before each verified position as output: ``with_path_counts``);
- greedy rows (temperature 0) take the argmax of the biased, penalised logits;
- reported logprobs are those of the RAW model logits;
- structured output: the model runner masks a constrained row's logits with its grammar's bitmask
  (`apply_token_bitmask`) before `sample`, so every stage and the logprobs see the masked row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.kernels import cpu_decode

# Temperatures below this are treated as greedy (division would overflow anyway).
GREEDY_EPS = 1e-5


@dataclass
class RowSamplingInfo:
    """Host-side sampling parameters of one row (one sequence) of the batch."""

    temperature: float
    top_k: int  # 0 or -1 (or >= vocab) disables
    top_p: float  # (0, 1]; 1 disables
    min_p: float  # [0, 1); 0 disables
    presence_penalty: float  # 0 disables
    frequency_penalty: float  # 0 disables
    repetition_penalty: float  # 1 disables
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # None -> default RNG
    num_logprobs: int  # 0 = none, N = chosen token's logprob + top-N
    # min_tokens: the stop tokens (EOS unless ignore_eos, and stop_token_ids) are banned from
    # the next ``min_tokens_left`` tokens (output indices n_out .. min_tokens - 1).
    min_tokens_left: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit


@dataclass
class SamplingTensors:
    """A batch's sampling parameters as device tensors, plus host-side flags to skip stages."""

    temperature: Tensor  # [B] float32; 0 = greedy row
    top_k: Tensor  # [B] int64; <= 0 or >= V = disabled
    top_p: Tensor  # [B] float32 in (0, 1]; 1 = disabled
    min_p: Tensor  # [B] float32 in [0, 1); 0 = disabled
    presence_penalty: Tensor  # [B] float32; 0 = disabled
    frequency_penalty: Tensor  # [B] float32; 0 = disabled
    repetition_penalty: Tensor  # [B] float32; 1 = disabled
    output_token_counts: Tensor | None  # [B, V] int32; None when the batch has no penalties
    prompt_token_mask: Tensor | None  # [B, V] bool; None when no repetition penalty
    generators: list[torch.Generator | None]  # per row; None -> default RNG
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool
    max_num_logprobs: int  # 0 -> no logprobs in this batch
    # min_tokens (``ban_stop_tokens``): [B, V] bool stop tokens of each row and [B] int64 how
    # many tokens from the step's first they are banned for; None when no row bans any.
    stop_ban: Tensor | None = None
    stop_ban_left: Tensor | None = None
    logit_bias: Tensor | None = None  # [B, V] float32; None when no row has a bias

    @property
    def adjusts_logits(self) -> bool:
        """Whether a row's logits change with a bias or a penalty before sampling (eager work:
        a captured draft loop has neither)."""
        return not self.no_penalties or self.logit_bias is not None

    @property
    def greedy_mask(self) -> Tensor:
        """[B] bool, True for greedy rows."""
        return self.temperature == 0

    @classmethod
    def from_params(
        cls, rows: list[RowSamplingInfo], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        """Build the batch tensors; [B, V] tensors only when some row uses a penalty.

        Raises ValueError on out-of-range parameters. Greedy rows drop their generator (they
        draw no noise, so their request's RNG stream is not advanced).
        """
        if not rows:
            raise ValueError("rows must not be empty")
        for i, r in enumerate(rows):
            _validate_row(i, r)
        greedy = [r.temperature < GREEDY_EPS for r in rows]
        pairs = list(zip(rows, greedy, strict=True))
        rand = [r for r, g in pairs if not g]

        def vec(values: list[float], dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        uses_penalty = [
            r.presence_penalty != 0.0 or r.frequency_penalty != 0.0 or r.repetition_penalty != 1.0
            for r in rows
        ]
        pen_rows = [i for i, used in enumerate(uses_penalty) if used]
        rep_rows = [i for i, r in enumerate(rows) if r.repetition_penalty != 1.0]
        shape = (len(rows), vocab_size)
        counts = prompt_mask = None
        if pen_rows:
            output_ids = [(i, rows[i].output_token_ids) for i in pen_rows]
            counts = _scatter_ids(output_ids, shape, torch.int32, device)
        if rep_rows:
            prompt_ids = [(i, rows[i].prompt_token_ids) for i in rep_rows]
            prompt_mask = _scatter_ids(prompt_ids, shape, torch.bool, device)
        ban_rows = [
            (i, list(r.stop_token_ids)) for i, r in enumerate(rows) if r.min_tokens_left > 0
        ]
        stop_ban = stop_ban_left = None
        if any(ids for _, ids in ban_rows):
            stop_ban = _scatter_ids(ban_rows, shape, torch.bool, device)
            stop_ban_left = vec([max(0, r.min_tokens_left) for r in rows], torch.int64)
        bias = None
        if any(r.logit_bias for r in rows):
            bias = _scatter_bias(rows, shape, device)

        return cls(
            temperature=vec([0.0 if g else r.temperature for r, g in pairs], torch.float32),
            top_k=vec([r.top_k for r in rows], torch.int64),
            top_p=vec([r.top_p for r in rows], torch.float32),
            min_p=vec([r.min_p for r in rows], torch.float32),
            presence_penalty=vec([r.presence_penalty for r in rows], torch.float32),
            frequency_penalty=vec([r.frequency_penalty for r in rows], torch.float32),
            repetition_penalty=vec([r.repetition_penalty for r in rows], torch.float32),
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            generators=[None if g else r.generator for r, g in pairs],
            all_greedy=not rand,
            all_random=not any(greedy),
            # Stage flags look at random rows only: greedy rows ignore these stages.
            no_top_k=all(r.top_k <= 0 or r.top_k >= vocab_size for r in rand),
            no_top_p=all(r.top_p >= 1.0 for r in rand),
            no_min_p=all(r.min_p <= 0.0 for r in rand),
            no_penalties=not pen_rows,
            max_num_logprobs=max(r.num_logprobs for r in rows),
            stop_ban=stop_ban,
            stop_ban_left=stop_ban_left,
            logit_bias=bias,
        )


@dataclass
class SamplerOutput:
    """What one sampling step returns (all on the logits' device)."""

    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] float32, chosen token under the raw model distribution
    topk_ids: Tensor | None  # [B, N] int64, N = max requested in the batch
    topk_logprobs: Tensor | None  # [B, N] float32, sorted descending


def _validate_row(i: int, r: RowSamplingInfo) -> None:
    checks = [
        ("temperature", r.temperature, r.temperature >= 0.0, ">= 0"),
        ("top_k", r.top_k, r.top_k >= -1, "-1, 0 (disabled) or a positive integer"),
        ("top_p", r.top_p, 0.0 < r.top_p <= 1.0, "in (0, 1]"),
        ("min_p", r.min_p, 0.0 <= r.min_p < 1.0, "in [0, 1)"),
        ("repetition_penalty", r.repetition_penalty, r.repetition_penalty > 0.0, "> 0"),
        ("num_logprobs", r.num_logprobs, r.num_logprobs >= 0, ">= 0"),
    ]
    for name, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"row {i}: {name}={value!r} is invalid; allowed: {allowed}")


def _scatter_ids(
    row_ids: list[tuple[int, list[int]]],
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """[B, V] tensor counting (int) or marking (bool) each row's token ids."""
    out = torch.zeros(shape, dtype=dtype, device=device)
    rows = [i for i, ids in row_ids for _ in ids]
    if not rows:
        return out
    cols = [t for _, ids in row_ids for t in ids]
    bad = [t for t in (min(cols), max(cols)) if not 0 <= t < shape[1]]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of range; allowed: [0, {shape[1]})")
    index = (
        torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(cols, dtype=torch.int64).to(device, non_blocking=True),
    )
    ones = torch.ones(len(rows), dtype=dtype, device=device)
    # accumulate=True counts duplicates; for bool it is a logical OR.
    return out.index_put_(index, ones, accumulate=dtype != torch.bool)


def _scatter_bias(
    rows: list[RowSamplingInfo], shape: tuple[int, int], device: torch.device
) -> Tensor:
    """[B, V] float32: each row's ``logit_bias`` values at their token ids, 0 elsewhere."""
    out = torch.zeros(shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        for token, value in (r.logit_bias or {}).items():
            if not 0 <= token < shape[1]:
                raise ValueError(f"logit_bias token id {token} is out of range [0, {shape[1]})")
            out[i, token] = value
    return out.to(device, non_blocking=True)


def apply_logit_bias(logits: Tensor, st: SamplingTensors) -> Tensor:
    """``logits`` [B, V] plus each row's ``logit_bias`` (a new tensor), or ``logits``."""
    if st.logit_bias is None:
        return logits
    return logits + st.logit_bias.to(logits.dtype)


def adjusted_logits(logits: Tensor, st: SamplingTensors) -> Tensor:
    """The logits every sampling path starts from: biased, then penalised."""
    return apply_penalties(apply_logit_bias(logits, st), st)


def apply_penalties(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties.

    logits: [B, V]. Returns a new tensor; rows with neutral penalties are unchanged.
    """
    if st.no_penalties:
        return logits
    counts = st.output_token_counts
    if counts is None:
        raise ValueError("output_token_counts is required when the batch uses penalties")
    in_output = counts > 0  # [B, V]
    rep = st.repetition_penalty.unsqueeze(1)  # [B, 1]
    if st.prompt_token_mask is not None:
        seen = in_output | st.prompt_token_mask
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - st.frequency_penalty.unsqueeze(1) * counts.to(logits.dtype)
    return logits - st.presence_penalty.unsqueeze(1) * in_output.to(logits.dtype)


def ban_stop_tokens(logits: Tensor, st: SamplingTensors, depths: Tensor | None = None) -> Tensor:
    """``min_tokens``: each row's stop tokens at -inf in the columns before its min_tokens is
    reached, as vLLM masks them (an answer that ended and goes on is not what was asked for).

    logits: [B, C, V], column c predicting the token ``depths[b, c]`` after the step's first
    (None: c; a draft tree's nodes sit at their depth), so a verified position is banned iff
    its depth < ``stop_ban_left``. A row the ban would leave without a finite logit (a grammar
    that allows only a stop token) keeps its logits. Returns a new tensor, or ``logits``."""
    if st.stop_ban is None or st.stop_ban_left is None:
        return logits
    b, c, _ = logits.shape
    if depths is None:
        depths = torch.arange(c, device=logits.device).expand(b, c)
    return mask_banned(logits, st.stop_ban, depths < st.stop_ban_left[:, None])


def mask_banned(logits: Tensor, ban: Tensor, active: Tensor) -> Tensor:
    """``logits`` [R, C, V] with the tokens ``ban`` [R, V] marks at -inf in the columns
    ``active`` [R, C] marks; a row left without a finite logit keeps its logits."""
    banned = logits.masked_fill(active[:, :, None] & ban[:, None, :], float("-inf"))
    empty = (banned == float("-inf")).all(dim=-1, keepdim=True)
    return torch.where(empty, logits, banned)


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits / temperature per row; greedy rows (temperature 0) are divided by 1. A logit a
    penalty or the division took past the largest float is held at it (+inf would make the
    softmax NaN: inf - inf); -inf (masked) stays."""
    t = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)
    scaled = logits / t.unsqueeze(1).to(logits.dtype)
    return scaled.clamp(max=torch.finfo(scaled.dtype).max)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask to -inf tokens whose probability is below min_p * (max probability) of their row.

    Done in log space: p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p); min_p = 0
    gives log 0 = -inf, so nothing is masked for disabled rows.
    """
    max_logit = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    threshold = max_logit + torch.log(min_p).unsqueeze(1).to(logits.dtype)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask to -inf everything outside the top-k, then outside the top-p nucleus.

    top_k: [B] int64, <= 0 or >= V disables the row; ties with the k-th logit are kept (as HF).
    top_p: [B] float, keeps the smallest prefix of the descending distribution whose mass
    reaches top_p, the boundary token included (a token is kept iff the mass strictly before it
    is < top_p). The most likely token is always kept. Pass None to skip a stage.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
        kth = sorted_logits.gather(-1, (k - 1).unsqueeze(1))  # [B, 1]
        drop = sorted_logits < kth
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V], exclusive prefix sum
        p = top_p.unsqueeze(1).to(probs.dtype)
        drop = drop | ((mass_before >= p) & (p < 1.0))
    drop[:, 0] = False  # never empty a row
    mask = torch.empty_like(drop).scatter_(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(mask, float("-inf"))


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Mask to -inf every token a row's bitmask does not allow (structured output).

    logits: [B, V]; bitmask: [B, W] int32, bit j of word i allows token 32 i + j (all ones for
    an unconstrained row). Tokens past 32 W are not allowed. Returns a new tensor.
    """
    allowed = token_bitmask_allowed(bitmask, logits.shape[-1]).to(logits.device)
    return torch.where(allowed, logits, float("-inf"))


def token_bitmask_allowed(bitmask: Tensor, vocab: int) -> Tensor:
    """[B, W] int32 bitmask -> [B, vocab] bool, True where a token is allowed. Unpacked byte by
    byte (the int32 words read as little-endian bytes: byte 4 i + b holds tokens 32 i + 8 b ...
    + 7), 1 byte per bit rather than 4: ~20x faster than shifting the int32 words on a CPU."""
    octets = bitmask.contiguous().view(torch.uint8)  # [B, 4 W]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (octets.unsqueeze(-1) >> shifts) & 1  # [B, 4 W, 8], 0 / 1
    allowed = bits.view(torch.bool).reshape(bitmask.shape[0], -1)  # [B, 32 W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed[:, :vocab]


def random_sample(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """Draw one token per row from probs [B, V] with the exponential race argmax(p / Exp(1)).

    Rows with a generator draw their noise from it alone, so a seeded request samples the same
    token whatever else is in the batch; the other rows share one draw from the default RNG.
    Returns [B] int64.
    """
    noise = torch.empty_like(probs, dtype=torch.float32)
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if len(seeded) < probs.shape[0]:
        noise.exponential_()
    for i, g in seeded:
        noise[i].exponential_(generator=g)
    # Exp(1) can round to 0; a tiny floor keeps p / noise finite (never 0 / 0).
    noise = noise.clamp_min(torch.finfo(torch.float32).tiny)
    return (probs.float() / noise).argmax(dim=-1)


def compute_logprobs(
    logits: Tensor, token_ids: Tensor, num_logprobs: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities under the raw model distribution.

    Returns (chosen [B], topk_ids [B, N], topk_logprobs [B, N]) with N = num_logprobs, the top-N
    sorted descending.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logprobs.gather(-1, token_ids.unsqueeze(1)).squeeze(1)
    topk_logprobs, topk_ids = logprobs.topk(num_logprobs, dim=-1, sorted=True)
    return chosen, topk_ids, topk_logprobs


def _processed_logits(penalised: Tensor, st: SamplingTensors) -> Tensor:
    """Penalised logits -> temperature -> min_p -> top-k/top-p, skipping unused stages."""
    logits = apply_temperature(penalised, st.temperature)
    if not st.no_min_p:
        logits = apply_min_p(logits, st.min_p)
    if not (st.no_top_k and st.no_top_p):
        logits = apply_top_k_top_p(
            logits,
            None if st.no_top_k else st.top_k,
            None if st.no_top_p else st.top_p,
        )
    return logits


def probs_for_rows(logits: Tensor, st: SamplingTensors) -> Tensor:
    """The processed target distribution [B, V] that `sample` draws from (float32).

    Random rows: softmax after bias / penalties / temperature / min_p / top-k / top-p. Greedy
    rows: one-hot at the argmax of the biased, penalised logits. The speculative verifier uses this for p.
    """
    penalised = adjusted_logits(logits.float(), st)
    one_hot = None
    if not st.all_random:
        greedy_ids = penalised.argmax(dim=-1, keepdim=True)  # [B, 1]
        one_hot = torch.zeros_like(penalised).scatter_(-1, greedy_ids, 1.0)
        if st.all_greedy:
            return one_hot
    probs = _processed_logits(penalised, st).softmax(dim=-1)
    if one_hot is None:
        return probs
    return torch.where(st.greedy_mask.unsqueeze(1), one_hot, probs)


def sample(logits: Tensor, st: SamplingTensors) -> SamplerOutput:
    """Sample one token per row from logits [B, V] (last position of each sequence)."""
    plain = not st.adjusts_logits and st.stop_ban is None
    if st.all_greedy and plain and st.max_num_logprobs == 0:
        return SamplerOutput(cpu_decode.argmax(logits), None, None, None)  # no float copy
    raw = logits.float()
    penalised = adjusted_logits(ban_stop_tokens(raw[:, None], st)[:, 0], st)
    if st.all_greedy:
        token_ids = cpu_decode.argmax(penalised)
    else:
        probs = _processed_logits(penalised, st).softmax(dim=-1)
        token_ids = random_sample(probs, st.generators)
        if not st.all_random:
            token_ids = torch.where(st.greedy_mask, penalised.argmax(dim=-1), token_ids)
    if st.max_num_logprobs == 0:
        return SamplerOutput(token_ids, None, None, None)
    chosen, topk_ids, topk_logprobs = compute_logprobs(raw, token_ids, st.max_num_logprobs)
    return SamplerOutput(token_ids, chosen, topk_ids, topk_logprobs)
