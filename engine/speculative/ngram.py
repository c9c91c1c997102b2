"""N-gram (prompt-lookup) drafting: drafts copied from earlier in the request's own text.

The last n tokens of a request (prompt + output), for n from ``prompt_lookup_max`` down to
``prompt_lookup_min``, are looked up among the n-grams that end earlier in its text; at the
longest n that occurs, the most recent earlier occurrence wins and the (up to) K tokens that
followed it are the drafts. No model and no forward pass: the lookup runs on the host, in the
engine, after the step's tokens are read (the step's one host sync), so it adds none.

Each request keeps one index per n (n-gram -> end position of its latest occurrence), extended
by the tokens appended since its last lookup: a lookup costs O(n_max - n_min + K) whatever the
text's length. Drafts are deterministic (a point mass), so verification accepts a draft d with
probability p(d) and otherwise samples p without d (the one-hot q of ``SpecDecoder._stored_q``):
exactly the target's distribution at temperature > 0, the target's argmax under greedy. The
ranks' side is ``DraftlessDecoder`` (engine/speculative/decoder.py): verification only.
"""

from __future__ import annotations


class NgramIndex:
    """The n-grams of one growing token sequence, for n in [n_min, n_max]."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        # n -> {n-gram: end index (exclusive) of its latest occurrence}, for the n-grams that end
        # before the sequence's last token (the suffix being looked up is not its own match).
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens``; every n-gram that now ends before the last token is indexed."""
        seq = self.tokens
        for tok in tokens:
            end = len(seq)  # the n-grams ending at the previous last token become lookable
            for n, table in self.ends.items():
                if end >= n:
                    table[tuple(seq[end - n : end])] = end
            seq.append(tok)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
        (n in [n_min, n_max]) that occurred before; [] when none did."""
        seq = self.tokens
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(seq) <= n:
                continue
            end = self.ends[n].get(tuple(seq[-n:]))
            if end is not None:
                return seq[end : end + k]
        return []


class NgramProposer:
    """Per-request n-gram indexes on the engine's side, fed from each request's token list."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Drafts for a request whose whole text is ``tokens`` (it only ever grows)."""
        if k <= 0:
            return []
        index = self.indexes.get(request_id)
        if index is None:
            index = self.indexes[request_id] = NgramIndex(self.n_min, self.n_max)
        index.extend(tokens[len(index.tokens) :])
        return index.propose(k)

    def forget(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)


def pad_drafts(drafts: list[int], last_token: int, k: int) -> list[int]:
    """``drafts`` filled to ``k`` with their last token (the request's last token when there are
    none): the shape a captured step verifies. A filler is verified like any draft, so it is
    accepted exactly when the target agrees."""
    filler = drafts[-1] if drafts else last_token
    return drafts + [filler] * (k - len(drafts))
