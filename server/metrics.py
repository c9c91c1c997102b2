"""Prometheus metrics under the ``tandem:`` prefix, in a registry owned by one app.

Latencies are observed in the API process as outputs arrive from the engine (``AsyncLLM`` calls
the ``RequestStatsSink`` methods); engine-side gauges and counters come from the engine's stats
snapshot, which travels with every step's outputs, and are read at scrape time. With
data-parallel replicas (``-dp N``) every engine series carries a ``replica`` label ("0".."N-1");
with one replica the series are labelled by model name only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tandem.engine.outputs import EngineStats
from tandem.engine.request import SpecStats
from tandem.engine.structured_output import GRAMMAR_TIME_BUCKETS
from tandem.engine.structured_output import Histogram as StatsHistogram

PREFIX = "tandem:"
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length")


def _spec(s: EngineStats) -> SpecStats:
    """The engine's speculation counts, for SpecStats' derived figures."""
    return SpecStats(s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)


# (kind, name, help, value from the engine's stats snapshot)
_ENGINE_METRICS: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("gauge", "num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    ("gauge", "num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    ("gauge", "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", lambda s: s.kv_cache_usage),
    ("gauge", "kv_cache_used_blocks", "KV cache blocks held by requests.", lambda s: s.num_used_kv_blocks),
    ("counter", "num_preemptions", "Requests preempted (recomputed later).", lambda s: s.num_preemptions),
    ("counter", "prompt_tokens", "Prompt tokens received.", lambda s: s.prompt_tokens),
    ("counter", "generation_tokens", "Tokens generated.", lambda s: s.generation_tokens),
    ("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries),
    ("counter", "prefix_cache_hits", "Prompt tokens served from the prefix cache.", lambda s: s.prefix_cache_hits),
    ("counter", "spec_decode_num_drafts", "Speculative verification steps that had drafts.", lambda s: s.spec_num_drafts),
    ("counter", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", lambda s: s.spec_num_draft_tokens),
    ("counter", "spec_decode_num_accepted_tokens", "Draft tokens accepted.", lambda s: s.spec_num_accepted_tokens),
    ("gauge", "spec_decode_mean_tokens_per_step", "Tokens emitted per verification step (accepted + 1), since start.", lambda s: _spec(s).mean_tokens_per_step),
    ("gauge", "spec_decode_mean_draft_tokens_per_step", "Draft tokens verified per step (K for a chain, the verified tree's size), since start.", lambda s: _spec(s).mean_draft_tokens_per_step),
    ("counter", "spec_decode_constrained_num_draft_tokens", "Draft tokens verified for grammar-constrained requests.", lambda s: s.spec_constrained_draft_tokens),
    ("counter", "spec_decode_constrained_num_accepted_tokens", "Draft tokens accepted for grammar-constrained requests.", lambda s: s.spec_constrained_accepted_tokens),
    ("counter", "eplb_num_rebalances", "Expert load balancing rounds done (--enable-eplb).", lambda s: s.eplb_rebalances),
    ("gauge", "eplb_imbalance_before", "At the last rebalance: max / mean routed load per rank of the loads measured since the one before, under the placement replaced (mean over MoE layers; 0: none yet).", lambda s: s.eplb_imbalance_before),
    ("gauge", "eplb_imbalance_after", "At the last rebalance: max / mean per rank of the same loads under the new placement.", lambda s: s.eplb_imbalance_after),
)  # fmt: skip


class _EngineStatsCollector(Collector):
    """Engine series from each replica's latest stats snapshot (None: not started yet)."""

    def __init__(
        self,
        model_name: str,
        source: Callable[[], Sequence[EngineStats | None]],
        spec_method: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.source = source
        self.spec_method = spec_method  # the vllm: series exist from the start with it

    def collect(self) -> Iterator[Metric]:
        replicas = list(self.source())
        labels = ["model_name"] if len(replicas) == 1 else ["model_name", "replica"]

        def values(i: int) -> list[str]:
            return [self.model_name] if len(replicas) == 1 else [self.model_name, str(i)]

        for kind, name, doc, value in _ENGINE_METRICS:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = cls(PREFIX + name, doc, labels=labels)
            for i, stats in enumerate(replicas):
                family.add_metric(values(i), float(value(stats)) if stats else 0.0)
            yield family
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Steps that accepted a draft token at each draft depth (position 0: depth 1).",
            labels=[*labels, "position"],
        )
        for i, stats in enumerate(replicas):
            for pos, count in enumerate(stats.spec_accepted_per_pos if stats else []):
                per_pos.add_metric([*values(i), str(pos)], float(count))
        yield per_pos
        by_len = CounterMetricFamily(
            PREFIX + "spec_decode_steps_by_draft_len",
            "Engine steps by the drafts they proposed per request (the num_speculative_tokens "
            "schedule's K for the step's batch size; 0: speculation paused).",
            labels=[*labels, "draft_len"],
        )
        for i, stats in enumerate(replicas):
            for k, count in sorted((stats.spec_steps_by_draft_len if stats else {}).items()):
                by_len.add_metric([*values(i), str(k)], float(count))
        yield by_len
        yield from self._vllm_spec_series(replicas, labels, values)
        for name, doc, field in _ENGINE_HISTOGRAMS:
            family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            for i, stats in enumerate(replicas):
                hist = getattr(stats, field) if stats else None
                if hist is None:  # no constrained request yet
                    hist = StatsHistogram(GRAMMAR_TIME_BUCKETS)
                family.add_metric(values(i), _buckets(hist), hist.total)
            yield family

    def _vllm_spec_series(
        self,
        replicas: list[EngineStats | None],
        labels: list[str],
        values: Callable[[int], list[str]],
    ) -> Iterator[Metric]:
        """The speculation counters under the names dashboards built for vLLM read
        (``vllm:spec_decode_*``), labelled by method; none without speculation."""
        method = self.spec_method or next(
            (s.spec_method for s in replicas if s is not None and s.spec_method), None
        )
        if not method:
            return
        names = [*labels, "method"]
        for name, doc, field in _VLLM_SPEC_COUNTERS:
            family = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=names)
            for i, stats in enumerate(replicas):
                value = float(getattr(stats, field)) if stats is not None else 0.0
                family.add_metric([*values(i), method], value)
            yield family
        per_pos = CounterMetricFamily(
            VLLM_PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft).",
            labels=[*names, "position"],
        )
        for i, stats in enumerate(replicas):
            for pos, count in enumerate(stats.spec_accepted_per_pos if stats else []):
                per_pos.add_metric([*values(i), method, str(pos)], float(count))
        yield per_pos


# vLLM's names for the speculation counters: (name, help, EngineStats field).
VLLM_PREFIX = "vllm:"
_VLLM_SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Verification steps that had drafts.", "spec_num_drafts"),
    (
        "spec_decode_num_draft_tokens",
        "Draft tokens proposed and verified.",
        "spec_num_draft_tokens",
    ),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_num_accepted_tokens"),
)

# (name, help, EngineStats field holding a cumulative histogram)
_ENGINE_HISTOGRAMS = (
    ("grammar_compile_time_seconds", "Time to compile a structured-output grammar (engine; cache misses).", "grammar_compile_time"),
    ("grammar_bitmask_time_seconds", "Time per step spent computing grammar token bitmasks.", "grammar_mask_time"),
)  # fmt: skip


def _buckets(hist: StatsHistogram) -> list[tuple[str, float]]:
    """A stats histogram as Prometheus buckets (cumulative counts, ending with +Inf)."""
    out = [(repr(float(b)), float(c)) for b, c in zip(hist.buckets, hist.counts, strict=True)]
    return [*out, ("+Inf", float(hist.count))]


class ServerMetrics:
    """The app's metrics; also the ``RequestStatsSink`` ``AsyncLLM`` reports latencies to.
    ``stats_source`` returns every replica's stats snapshot (one entry without ``-dp``)."""

    def __init__(
        self,
        model_name: str,
        stats_source: Callable[[], Sequence[EngineStats | None]],
        in_flight_source: Callable[[], int] | None = None,
        spec_method: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry
            ).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to the first generated token.")
        self.itl = hist("inter_token_latency_seconds", "Time between generated tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue = hist("request_queue_time_seconds", "Time waiting before first scheduled.")
        self._success = Counter(
            PREFIX + "request_success",
            "Requests finished normally, by finish reason.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)
        self.registry.register(_EngineStatsCollector(model_name, stats_source, spec_method))
        if in_flight_source is not None:
            Gauge(
                PREFIX + "num_requests_in_flight",
                "Engine requests the API process tracks (submitted, not finished or aborted).",
                labels,
                registry=self.registry,
            ).labels(model_name).set_function(lambda: float(in_flight_source()))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(
        self, e2e_seconds: float, queue_seconds: float | None, finish_reason: str | None
    ) -> None:
        self.e2e.observe(e2e_seconds)
        if queue_seconds is not None:
            self.queue.observe(queue_seconds)
        if finish_reason in FINISH_REASONS:
            self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
