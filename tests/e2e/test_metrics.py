"""Prometheus metrics over HTTP: after a known run the counters equal the tokens served, each latency histogram
holds one sample per request, gRPC calls are counted per method and status code; `pagedserve-client bench` writes
its report and plot, and the server's histograms count its requests."""
from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve_client import cli as client_cli
from support import wait_until

pytestmark = pytest.mark.e2e

HISTOGRAMS = ["time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"]


@pytest.fixture(scope="module")
def scrape(server):
    """scrape() -> {(sample name, sorted label items): value} from the server's /metrics over HTTP."""
    port = server.app.metrics.start_http("127.0.0.1", 0)

    def get() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    yield get
    server.app.metrics.stop_http()


def value(samples: dict, name: str, **labels) -> float:
    """One sample's value, 0 when absent; labels must match exactly."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_counters_and_histograms_after_a_known_run(server, client, scrape):
    model = server.app.services.generation_name
    shared = "The quick brown fox jumps over the lazy dog. " * 6   # several full KV blocks, sent twice
    runs = [dict(prompt=shared + "One", max_tokens=7), dict(prompt=shared + "Two", max_tokens=3),
            dict(prompt="Count to ten:", max_tokens=5, n=2)]
    before = scrape()
    received, messages, usages = 0, 0, []
    for run in runs:
        for response in client.generate(**run, temperature=0.0, ignore_eos=True):
            messages += 1
            received += len(response.token_ids)
            if response.HasField("usage"):
                usages.append(response.usage)
    with pytest.raises(grpc.RpcError) as err:  # one refused call: counted under its status code
        list(client.generate("hi", max_tokens=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The server counts a call as handled after it has sent the status, so the client can see the error first.
    rpc = {"grpc_service": "pagedserve.v1.InferenceService", "grpc_method": "Generate", "grpc_type": "server_stream"}

    def refused() -> float:
        return delta(before, scrape(), "grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **rpc)

    wait_until(lambda: refused() == 1, 10, lambda: f"{refused()} refused calls handled, want 1")
    after = scrape()

    m = {"model_name": model}
    completion_tokens = sum(u.completion_tokens for u in usages)
    assert received == completion_tokens == 7 + 3 + 2 * 5
    assert delta(before, after, "pagedserve:generation_tokens_total", **m) == completion_tokens
    assert delta(before, after, "pagedserve:prompt_tokens_total", **m) == sum(u.prompt_tokens for u in usages)
    assert delta(before, after, "pagedserve:request_success_total", finished_reason="length", **m) == 4
    for name in HISTOGRAMS:
        assert delta(before, after, f"pagedserve:{name}_count", **m) == len(runs), name
        assert delta(before, after, f"pagedserve:{name}_sum", **m) >= 0.0, name
    # The second prompt's shared blocks come from the prefix cache.
    assert delta(before, after, "pagedserve:prefix_cache_hits_total", **m) >= 16
    assert delta(before, after, "pagedserve:prefix_cache_queries_total", **m) >= \
        delta(before, after, "pagedserve:prefix_cache_hits_total", **m)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(after, f"pagedserve:{gauge}", **m) == 0.0, gauge
    assert value(after, "pagedserve:num_preemptions_total", **m) == server.engine.stats()["num_preemptions"]

    assert delta(before, after, "grpc_server_started_total", **rpc) == len(runs) + 1
    assert delta(before, after, "grpc_server_handled_total", grpc_code="OK", **rpc) == len(runs)
    assert delta(before, after, "grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **rpc) == 1
    assert delta(before, after, "grpc_server_msg_sent_total", **rpc) == messages
    assert delta(before, after, "grpc_server_msg_received_total", **rpc) == len(runs) + 1
    assert delta(before, after, "grpc_server_handling_seconds_count", **rpc) == len(runs) + 1


def test_client_cancel_counts_an_abort(server, client, scrape):
    model = server.app.services.generation_name
    before = scrape()
    stream = client.generate("Tell me a long story.", max_tokens=200, ignore_eos=True, temperature=0.0)
    next(iter(stream))
    stream.close()
    server.run(_until_idle(server))
    after = scrape()
    assert delta(before, after, "pagedserve:request_success_total", finished_reason="abort", model_name=model) == 1
    assert delta(before, after, "pagedserve:e2e_request_latency_seconds_count", model_name=model) == 0
    rpc = {"grpc_service": "pagedserve.v1.InferenceService", "grpc_method": "Generate", "grpc_type": "server_stream"}
    assert delta(before, after, "grpc_server_handled_total", grpc_code="CANCELLED", **rpc) == 1


async def _until_idle(server, timeout_s: float = 30.0) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while server.app.calls.num_in_flight or server.app.services.generation.num_live_requests:
        assert loop.time() < deadline, "the cancelled call did not finish"
        await asyncio.sleep(0.02)


def test_bench_writes_report_and_plot(server, scrape, tmp_path, capsys):
    model = server.app.services.generation_name
    before = scrape()
    code = client_cli.main(["--target", server.target, "--timeout", "120", "bench", "--num-requests", "4",
                            "--concurrency", "2", "--max-tokens", "4", "--prompt", "Hello", "--prompt", "Bonjour",
                            "--out-dir", str(tmp_path), "--no-progress"])
    assert code == 0, capsys.readouterr()
    after = scrape()
    report = json.loads((tmp_path / "bench_report.json").read_text())
    assert report["summary"]["ok"] == 4 and report["summary"]["completion_tokens"] == 16
    assert all(r["completion_tokens"] == 4 and 0 < r["ttft_s"] <= r["e2e_s"] for r in report["requests"])
    png = (tmp_path / "bench_latency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "report:" in capsys.readouterr().out
    assert delta(before, after, "pagedserve:time_to_first_token_seconds_count", model_name=model) == 4
    assert delta(before, after, "pagedserve:generation_tokens_total", model_name=model) == 16
