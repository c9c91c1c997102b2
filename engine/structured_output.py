"""Grammar-constrained generation (JSON schema, JSON object, regex, choice, Lark grammar).

The grammar engine is llguidance (a maintained library: JSON schema, regex and Lark grammars to
token masks; nothing here turns a schema into a grammar by hand). A ``StructuredSpec`` travels
with a request's ``SamplingParams``; the API process validates it (``GrammarCompiler.validate``)
so bad input is a 400 before it reaches the engine. The engine process keeps one matcher per
constrained request (``StructuredOutputManager``): grammars compile on a thread pool, cached by
(kind, text), while other requests keep running; each step it fills the token bitmask of every
constrained request the step samples, and it advances the matchers with the emitted tokens.
Under speculative decoding a request's mask has one row per verified position (the state after
the drafts before it, computed by advancing the matcher along the drafts and rolling it back).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

# Longest schema / regex / grammar text accepted (characters); longer ones are refused.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
GRAMMAR_CACHE_SIZE = 256
COMPILE_THREADS = 2
# Compile and per-step mask time histograms (seconds).
GRAMMAR_TIME_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON as OpenAI's strict mode writes it: no free whitespace (a sampled model cannot pad the
# output with spaces forever).
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be served: "{param}: {detail}", where ``param``
    names the request field."""

    def __init__(self, detail: str, param: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.detail = detail
        self.param = param


@dataclass(frozen=True)
class StructuredSpec:
    """What a constrained request must match. ``text`` is the JSON schema (``json_schema``), the
    regex, the Lark grammar, or a JSON list of strings (``choice``); empty for ``json_object``.
    ``param`` is the request field it came from (for error messages).

    ``after`` (reasoning models): the constraint starts after this marker (``</think>``); the
    text up to and including its first occurrence is free, then up to four whitespace
    characters, then what ``kind`` and ``text`` say. ``after_special``: the marker is a special
    token of the tokenizer (matched as that token, not as text)."""

    kind: Kind
    text: str = ""
    param: str = "structured_outputs"
    after: str = ""
    after_special: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(
                f"the kind {self.kind!r} is invalid; allowed: {', '.join(KINDS)}",
                self.param,
            )
        if not isinstance(self.text, str):
            raise StructuredOutputError("must be text", self.param)
        if len(self.text) > MAX_SPEC_CHARS:
            raise StructuredOutputError(
                f"too large: {len(self.text)} characters; this server accepts at most "
                f"{MAX_SPEC_CHARS}",
                self.param,
            )

    @property
    def key(self) -> tuple[str, str, str, bool]:
        return (self.kind, self.text, self.after, self.after_special)

    @classmethod
    def choice(cls, options: list[str], param: str = "structured_outputs.choice") -> StructuredSpec:
        if not options or len(options) > MAX_CHOICES:
            raise StructuredOutputError(
                f"needs 1 to {MAX_CHOICES} strings, got {len(options)}", param
            )
        if any(not isinstance(o, str) or not o for o in options):
            raise StructuredOutputError("must hold non-empty strings", param)
        return cls("choice", json.dumps(options), param)


def _own_grammar(spec: StructuredSpec) -> str:
    """The llguidance grammar of ``spec``'s kind and text (raises ``StructuredOutputError`` on
    unreadable input; unsupported features are reported when the grammar is built)."""
    import llguidance

    m = llguidance.LLMatcher
    try:
        if spec.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            _check_type_lists(schema)
            return m.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return m.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            options = json.loads(spec.text)
            # A Lark string literal takes JSON's escapes.
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        return m.grammar_from_lark(spec.text)
    except (ValueError, TypeError, RecursionError) as e:
        raise StructuredOutputError(f"invalid: {e}", spec.param) from None


def _check_type_lists(schema: dict[str, Any]) -> None:
    """JSON Schema's ``type`` lists must not repeat a type. llguidance compiles a repeated one
    into as many alternatives, and thousands of them pass its parser's row limit only once the
    output starts: the request failed mid-generation."""
    todo: list[Any] = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            types = node.get("type")
            if isinstance(types, list):
                seen = [t for t in types if isinstance(t, str)]
                if len(set(seen)) != len(seen):
                    raise ValueError(f"a 'type' list repeats a type ({len(types)} entries)")
            todo += node.values()
        elif isinstance(node, list):
            todo += node


def to_grammar(spec: StructuredSpec) -> str:
    """The llguidance grammar for ``spec``: its own (``_own_grammar``), after free text up to
    ``spec.after`` when that is set (the inner grammar becomes a named sub-grammar)."""
    inner = _own_grammar(spec)
    if not spec.after:
        return inner
    top = json.loads(inner) if inner.lstrip().startswith("{") else None
    if top is None:
        top = {"grammars": [{"lark_grammar": inner}]}
    answer = {**top["grammars"][0], "name": "answer"}
    if spec.after_special:  # a special token: only that token ends the free text
        head = f"start: FREE {spec.after} WS @answer\nFREE: /(?s:.*)/"
    else:  # the first occurrence of the text ends it (a lazy lexeme)
        marker = "".join(f"\\x{{{ord(c):x}}}" for c in spec.after)  # each character escaped
        head = f"start: free WS @answer\nfree[lazy]: /(?s:.*){marker}/"
    lark = head + "\nWS: /[ \\t\\r\\n]{0,4}/"
    return json.dumps({**top, "grammars": [{"lark_grammar": lark}, answer]})


def build_ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer, ``vocab_size`` wide (the model's
    logits; ids the tokenizer lacks are never allowed). Costs ~0.1-0.3 s: build it once."""
    import llguidance.hf

    eos = sorted(eos_token_ids) or None
    n_vocab = max(vocab_size, len(tokenizer))
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)


def compile_matcher(ll_tokenizer: Any, spec: StructuredSpec) -> Any:
    """A fresh ``LLMatcher`` for ``spec``; raises ``StructuredOutputError`` naming what is wrong
    (unsupported schema keys, a bad regex, a grammar that matches nothing)."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, to_grammar(spec), log_level=0)
    if matcher.is_error():
        raise StructuredOutputError(f"cannot be used: {matcher.get_error().strip()}", spec.param)
    # A grammar that matches no text at all fails at its first mask.
    matcher.compute_bitmask()
    if matcher.is_error():
        raise StructuredOutputError(
            "cannot be used: it matches no text (the grammar allows no first token)", spec.param
        )
    matcher.reset()
    return matcher


class GrammarCompiler:
    """Builds matchers for one tokenizer, caching the compiled grammar (a pristine matcher that
    is deep-copied per request) and compile errors by (kind, text), LRU."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        self.ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_times = Histogram(GRAMMAR_TIME_BUCKETS)

    def template(self, spec: StructuredSpec) -> Any:
        """The compiled grammar of ``spec`` (cached; compiled once even when several threads ask
        for it at the same time)."""
        with self._lock:
            entry = self._cache.get(spec.key)
            owner = entry is None
            if owner:
                entry = self._cache[spec.key] = Future()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec.key)
        if owner:
            start = time.perf_counter()
            try:
                entry.set_result(compile_matcher(self.ll_tokenizer, spec))
            except StructuredOutputError as e:
                entry.set_result(e)
            except BaseException as e:  # not the grammar's fault: do not cache it
                with self._lock:
                    self._cache.pop(spec.key, None)
                entry.set_exception(e)
                raise
            with self._lock:
                self.compile_times.observe(time.perf_counter() - start)
        hit = entry.result()
        if isinstance(hit, StructuredOutputError):
            raise StructuredOutputError(hit.detail, spec.param)
        return hit

    def validate(self, spec: StructuredSpec) -> None:
        """Raise ``StructuredOutputError`` if ``spec`` cannot be served."""
        self.template(spec)

    def matcher(self, spec: StructuredSpec) -> Any:
        """A matcher of its own for one request."""
        return self.template(spec).deep_copy()


@dataclass
class Histogram:
    """Cumulative observations in fixed buckets (``counts[i]``: values <= ``buckets[i]``), as a
    stats snapshot can carry them to Prometheus."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


def matcher_error(matcher: Any) -> str:
    """The first line of a matcher's error: the rest dumps its state and the whole grammar."""
    return ((matcher.get_error() or "").strip().splitlines() or [""])[0]


# How the matcher refuses a token its grammar does not allow (in its error message).
TOKEN_REFUSED = "doesn't satisfy the grammar"


@dataclass(frozen=True)
class GrammarFailure:
    """A token the request's matcher refused (``StructuredOutputManager.advance``)."""

    message: str
    request_at_fault: bool  # the grammar passed a matcher limit; False: an unmasked token


@dataclass
class StepMasks:
    """One step's bitmasks: ``masks[request_id]`` is a [ceil(V / 32)] int32 tensor (bit j of word
    i allows token 32 i + j); ``dead`` are requests whose grammar allows no token now."""

    masks: dict[str, torch.Tensor]
    dead: dict[str, str]


class StructuredOutputManager:
    """The engine side: compiles grammars off the step loop and owns each constrained request's
    matcher. A request is ``pending`` until its grammar is compiled; the engine schedules it only
    once ``ready`` returns it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.pending: dict[str, tuple[Any, Future[Any]]] = {}  # id -> (request, its matcher)
        self.matchers: dict[str, Any] = {}
        self.mask_times = Histogram(GRAMMAR_TIME_BUCKETS)
        self._executor: Any = None

    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler

    @property
    def used(self) -> bool:
        """Whether any constrained request came."""
        return self._compiler is not None

    @property
    def compile_times(self) -> Histogram | None:
        """A copy of the compile time histogram (None before the first grammar)."""
        if self._compiler is None:
            return None
        with self._compiler._lock:
            return self._compiler.compile_times.copy()

    def submit(self, request: Any) -> None:
        """Start compiling ``request``'s grammar; it waits in ``pending`` meanwhile."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        spec = request.params.structured
        self.pending[request.request_id] = (request, self._pool.submit(self._matcher, spec))

    def _matcher(self, spec: StructuredSpec) -> Any:
        return self.compiler.matcher(spec)

    def ready(self, wait_s: float = 0.0) -> tuple[list[Any], list[tuple[Any, str]]]:
        """Pending requests whose grammar is compiled (their matcher is kept), and those whose
        grammar failed, with the reason. ``wait_s``: wait that long for the first one."""
        if wait_s > 0 and self.pending:
            futures = [f for _, f in self.pending.values()]
            wait_futures(futures, timeout=wait_s, return_when="FIRST_COMPLETED")
        ok, failed = [], []
        for rid, (request, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[rid]
            try:
                self.matchers[rid] = future.result()
                ok.append(request)
            except Exception as e:  # a compile error: fail this request only
                failed.append((request, str(e)))
        return ok, failed

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self.matchers

    def masks(
        self,
        request_ids: list[str],
        width: int,
        drafts: dict[str, list[int]] | None = None,
        parents: dict[str, list[int]] | None = None,
    ) -> StepMasks:
        """The next-token bitmask of each request (all of them constrained).

        Without ``drafts`` a request's mask is [W]. With ``drafts`` (speculative decoding: the
        draft tokens each request verifies this step, possibly none) it is [d + 1, W]: row j is
        the grammar's state after the request's emitted tokens and its first j drafts (the
        matcher is advanced along the drafts and rolled back, so its state is unchanged). Rows
        past a draft the grammar forbids are all ones: that draft is rejected at verification
        (the masked target gives it probability 0), so they are never used. A row past 0 that
        allows nothing (a dead end after the drafts) is all ones too: if it is reached, the token
        emitted there fails the request, as the dead end would without speculation. Only row 0
        decides ``dead``.

        ``parents`` (draft trees: each draft node's parent, -1 for the root's children): row
        j + 1 is the state after the path from the root to node j instead (all ones when the
        grammar forbids a token on that path: the node is never accepted).
        """
        import llguidance
        import llguidance.torch
        import torch

        start = time.perf_counter()
        ahead = [drafts.get(rid, []) if drafts is not None else [] for rid in request_ids]
        lens = [len(d) for d in ahead]
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n + 1)
        bitmask = torch.zeros((offsets[-1], width), dtype=torch.int32)
        matchers = [self.matchers[rid] for rid in request_ids]
        if self._executor is None:
            self._executor = llguidance.LLExecutor(COMPILE_THREADS)
        # Depth by depth: every request still on its drafts fills row ``depth`` in parallel, then
        # consumes its draft ``depth``; ``consumed[i]`` is how far request i went.
        consumed = [0] * len(request_ids)
        live = list(range(len(request_ids)))
        chain = parents is None  # trees: row 0 here, the nodes' rows below (_fill_tree_rows)
        depth = 0
        while live:
            llguidance.torch.fill_next_token_bitmask_par(
                self._executor, [(matchers[i], offsets[i] + depth) for i in live], bitmask
            )
            nxt = []
            for i in live:
                if chain and depth < lens[i] and not matchers[i].is_stopped():
                    if matchers[i].try_consume_tokens([ahead[i][depth]]) == 1:
                        consumed[i] += 1
                        nxt.append(i)
            live = nxt
            depth += 1
        # Row j + 1 is valid when draft j's path was consumed.
        valid = [[j < consumed[i] for j in range(lens[i])] for i in range(len(request_ids))]
        for i, rid in enumerate(request_ids):
            if consumed[i]:
                matchers[i].rollback(consumed[i])
            if not chain and lens[i] and not matchers[i].is_error():
                valid[i] = _fill_tree_rows(
                    matchers[i], ahead[i], parents[rid], bitmask, offsets[i] + 1
                )
        out = StepMasks({}, {})
        allowed = bitmask.ne(0).any(dim=1).tolist()
        for i, rid in enumerate(request_ids):
            m = matchers[i]
            lo = offsets[i]
            if m.is_error():  # e.g. a limit of the parser passed along the drafts
                out.dead[rid] = f"the grammar cannot be followed: {matcher_error(m)}"
                continue
            if not allowed[lo]:
                out.dead[rid] = (
                    "the structured output's grammar allows no token here (no token of this "
                    "model continues the text)"
                )
                continue
            for j in range(1, lens[i] + 1):
                if not valid[i][j - 1] or not allowed[lo + j]:
                    bitmask[lo + j] = -1
            rows = bitmask[lo : offsets[i + 1]]
            out.masks[rid] = rows.clone() if drafts is not None else rows[0].clone()
        self.mask_times.observe(time.perf_counter() - start)
        return out

    def valid_drafts(self, request_id: str, tokens: list[int]) -> int:
        """How many of ``tokens`` (the next step's drafts) the grammar accepts in a row from the
        request's current state (the matcher is not advanced)."""
        m = self.matchers[request_id]
        if not tokens or m.is_stopped():
            return 0
        return int(m.validate_tokens(tokens))

    def advance(self, request_id: str, token_id: int) -> str | GrammarFailure | None:
        """Feed an emitted token to the request's matcher. Returns "stop" when the grammar is
        complete (nothing but EOS may follow), a ``GrammarFailure`` if the matcher refused the
        token, else None."""
        m = self.matchers[request_id]
        if not m.consume_token(token_id):
            error = matcher_error(m)
            # The mask forbids a token the grammar refuses: one sampled anyway is the server's
            # fault. Any other refusal is a limit the grammar passed (e.g. the parser's items
            # per row, as for an object of thousands of properties): the request's.
            refused = TOKEN_REFUSED in error
            return GrammarFailure(
                f"the sampled token {token_id} broke the grammar: {error}"
                if refused
                else f"the grammar cannot be followed: {error}",
                request_at_fault=not refused,
            )
        return "stop" if m.is_stopped() else None

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.matchers.pop(request_id, None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _fill_tree_rows(
    matcher: Any, tokens: list[int], parents: list[int], bitmask: Any, row: int
) -> list[bool]:
    """Draft-tree masks: ``bitmask[row + j]`` is the grammar's state after the path from the
    root to node j (its ancestors' tokens, then its own; parents precede their children).
    Returns which nodes' paths the grammar accepts; the matcher ends as it began."""
    import llguidance.torch

    from tandem.engine.speculative.tree import node_path

    valid = []
    for j in range(len(tokens)):
        path = node_path(tokens, parents, j)
        n = 0 if matcher.is_stopped() else matcher.try_consume_tokens(path)
        valid.append(n == len(path))
        if valid[-1]:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row + j)
        if n:
            matcher.rollback(n)
    return valid
