"""Prometheus metrics of one server: engine state, per-request latencies and token counts, gRPC calls.

Names follow vLLM's (``vllm:num_requests_running`` ...) under a ``pagedserve:`` prefix, labelled ``model_name``;
the gRPC server metrics use the names of go-grpc-prometheus / py-grpc-prometheus (``grpc_server_handled_total``
...), so existing dashboards apply. Everything lives in the server's own :class:`CollectorRegistry` (two servers in
one process do not collide) and is served as Prometheus text over HTTP by :meth:`ServerMetrics.start_http`.

Engine gauges and the engine's cumulative counters (prefix cache, preemptions, speculative drafts) are read from
``LLMEngine.stats()`` at scrape time; request metrics are recorded by :mod:`pagedserve.serving.request_metrics`.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

PREFIX = "pagedserve:"
# Bucket upper bounds in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
GRPC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """Reads ``LLMEngine.stats()`` at scrape time (plain attribute reads: safe from the HTTP thread)."""

    def __init__(self, owner: ServerMetrics):
        self.owner = owner

    def describe(self):  # no samples at registration time
        return []

    def collect(self):
        stats_fn, model = self.owner.engine_stats, self.owner.model_name
        if stats_fn is None:
            return
        stats = stats_fn()
        labels = ["model_name"]
        gauges = [("num_requests_running", "Requests in the running batch.", stats["num_requests_running"]),
                  ("num_requests_waiting", "Requests waiting to be scheduled.", stats["num_requests_waiting"]),
                  ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", stats["usage"])]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([model], float(value))
            yield family
        counters = [("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     stats["prefix_cache_queries_tokens"]),
                    ("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                     stats["prefix_cache_hits_tokens"]),
                    ("num_preemptions", "Requests preempted (KV blocks freed, recomputed later).",
                     stats["num_preemptions"]),
                    ("spec_decode_num_draft_tokens", "Speculative draft tokens verified by the target model.",
                     stats.get("spec_decode_num_draft_tokens", 0)),
                    ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
                     stats.get("spec_decode_num_accepted_tokens", 0)),
                    ("kv_blocks_freed_behind_window", "KV blocks given back while their request ran because every "
                     "layer's sliding window had moved past them.", stats.get("kv_blocks_freed_behind_window", 0))]
        for name, doc, value in counters:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([model], float(value))
            yield family
        yield from _deadline_families(stats, model)
        yield from _caller_families(stats.get("caller_tokens", {}), model)
        info = GaugeMetricFamily(PREFIX + "model_info", "The served model (always 1); its labels describe it.",
                                 labels=["model_name", "tensor_parallel_size"])
        info.add_metric([model, str(self.owner.tensor_parallel_size)], 1.0)
        yield info


def _deadline_families(stats: dict, model: str):
    """The deadline policy's counters (core/sched/deadlines.py): refusals by reason, the prefill tokens refused
    requests had spent (0 by design), requests that ended after their deadline."""
    refusals = CounterMetricFamily(PREFIX + "deadline_refusals", "Requests refused before prefill (DEADLINE_EXCEEDED "
                                   "/ HTTP 504): expired, infeasible (cannot finish in time at the measured step "
                                   "time) or queue_time (--max-queue-time-s).", labels=["model_name", "reason"])
    for reason in ("expired", "infeasible", "queue_time"):
        refusals.add_metric([model, reason], float(stats.get(f"deadline_refusals_{reason}", 0)))
    yield refusals
    for name, doc, key in (
            ("deadline_refused_prefill_tokens", "Prefill tokens computed for requests later refused by deadline.",
             "deadline_refused_prefill_tokens"),
            ("deadline_misses", "Requests with a deadline that ended (finished or cancelled) after it.",
             "deadline_misses")):
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([model], float(stats.get(key, 0)))
        yield family


MAX_CALLER_LABELS = 16
"""Callers with a label of their own in the per-caller metrics (the most served); the rest sum into "_other"."""


def _caller_families(callers: dict[str, dict[str, float]], model: str):
    """Per caller (fair shares; :meth:`LLMEngine.caller_stats`), a bounded label set: the
    :data:`MAX_CALLER_LABELS` most served callers by name ("" is "_unnamed"), the others summed as "_other".
    Families: tokens scheduled by kind, queue time (a summary: seconds waited for the first step, _sum and
    _count), deadline refusals."""
    ranked = sorted(callers.items(), key=lambda kv: -(kv[1]["prefill"] + kv[1]["decode"]))
    rows: dict[str, dict[str, float]] = {}
    for i, (caller, row) in enumerate(ranked):
        name = (caller or "_unnamed") if i < MAX_CALLER_LABELS else "_other"
        into = rows.setdefault(name, dict.fromkeys(row, 0))
        for key, value in row.items():
            into[key] += value
    labels = ["model_name", "caller"]
    tokens = CounterMetricFamily(PREFIX + "caller_tokens", "Tokens computed per caller (fair shares), by kind.",
                                 labels=labels + ["kind"])
    queue = SummaryMetricFamily(PREFIX + "caller_queue_time_seconds", "Seconds a caller's requests waited in the "
                                "queue before their first step.", labels=labels)
    refusals = CounterMetricFamily(PREFIX + "caller_deadline_refusals", "A caller's requests refused before "
                                   "prefill by the deadline policy (any reason).", labels=labels)
    for name, row in rows.items():
        tokens.add_metric([model, name, "prefill"], float(row["prefill"]))
        tokens.add_metric([model, name, "decode"], float(row["decode"]))
        queue.add_metric([model, name], count_value=int(row["scheduled"]), sum_value=float(row["queue_time_s"]))
        refusals.add_metric([model, name], float(row["refused"]))
    yield tokens
    yield queue
    yield refusals


class ServerMetrics:
    """The metric objects of one server. Thread-safe (prometheus_client's own locks)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` series (process-wide; Prometheus does not need them)
        self.registry = CollectorRegistry()
        self.model_name = ""
        self.tensor_parallel_size = 1
        self.engine_stats: Callable[[], dict] | None = None
        self._http = None
        r, m = self.registry, ["model_name"]
        self.registry.register(_EngineCollector(self))
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", m, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Completions finished, by finish reason.",
                                       m + ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to its first token.",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Per request: first to last token time over the tokens after the first.",
                              m, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request arrival to its last token.",
                             m, buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Request arrival in the engine to its first scheduling.",
                                    m, buckets=REQUEST_BUCKETS, registry=r)
        g = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_started = Counter("grpc_server_started", "RPCs started on the server.", g, registry=r)
        self.grpc_handled = Counter("grpc_server_handled", "RPCs completed on the server, by status code.",
                                    g + ["grpc_code"], registry=r)
        self.grpc_seconds = Histogram("grpc_server_handling_seconds", "RPC handling time on the server.",
                                      g, buckets=GRPC_BUCKETS, registry=r)
        self.grpc_msg_received = Counter("grpc_server_msg_received", "Messages received, by RPC.", g, registry=r)
        self.grpc_msg_sent = Counter("grpc_server_msg_sent", "Messages sent, by RPC.", g, registry=r)

    def bind_engine(self, stats_fn: Callable[[], dict], model_name: str, tensor_parallel_size: int = 1) -> None:
        """Export the engine's state from now on: ``stats_fn`` is ``LLMEngine.stats``; ``tensor_parallel_size`` is
        the ``pagedserve:model_info`` label."""
        self.model_name = model_name
        self.tensor_parallel_size = tensor_parallel_size
        self.engine_stats = stats_fn

    def start_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on a daemon thread; returns the bound port (``port`` 0 picks a free one).

        Raises OSError when the address cannot be bound.
        """
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
