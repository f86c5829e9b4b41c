"""bench/serve_compare.py and bench/serve_report.py without servers: the flags, the workload matrix, the per-cell
seeds, reading `vllm bench serve` result JSONs and the table (issue 33)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))
import serve_compare  # noqa: E402
import serve_report  # noqa: E402

RESULT = {"completed": 8, "total_output_tokens": 512, "output_throughput": 25.31, "total_token_throughput": 126.5,
          "median_ttft_ms": 784.2, "p99_ttft_ms": 903.0, "median_tpot_ms": 28.41, "p99_tpot_ms": 31.0,
          "duration": 20.2, "mean_ttft_ms": 790.0}


def test_defaults_are_the_issue_matrix():
    args = serve_compare.parse_args([])
    assert args.systems == ["pagedserve", "llamacpp", "vllm"]
    assert args.concurrency == [1, 4, 16, 32] and args.input_lens == [256, 1024] and args.output_len == 64
    specs = serve_compare.workloads(args)
    assert [s[0] for s in specs] == ["random-256", "random-1024", "prefix-512+64"]
    assert specs[2][1:] == (64, ["--random-prefix-len", "512"])


def test_short_run_flags():
    args = serve_compare.parse_args(["--systems", "pagedserve,llamacpp", "--concurrency", "1,4", "--input-lens",
                                     "256", "--no-prefix", "--num-prompts-factor", "1", "--min-prompts", "4"])
    assert args.systems == ["pagedserve", "llamacpp"] and args.concurrency == [1, 4]
    assert [s[0] for s in serve_compare.workloads(args)] == ["random-256"]


@pytest.mark.parametrize("argv, field", [(["--systems", "pagedserve,sglang"], "--systems"),
                                         (["--concurrency", "0,4"], "--concurrency"),
                                         (["--input-lens", "abc"], "--input-lens"),
                                         (["--output-len", "0"], "--output-len")])
def test_bad_flags_name_the_flag(argv, field, capsys):
    with pytest.raises(SystemExit):
        serve_compare.parse_args(argv)
    assert field in capsys.readouterr().err


def test_cell_seeds_are_stable_and_distinct():
    cells = [(w, c) for w in ("random-256", "random-1024", "prefix-512+64") for c in (1, 4, 16, 32)]
    seeds = [serve_compare.cell_seed(w, c) for w, c in cells]
    assert len(set(seeds)) == len(seeds)
    assert seeds == [serve_compare.cell_seed(w, c) for w, c in cells]
    assert all(0 <= s < 2 ** 31 for s in seeds)


def test_row_from_result_reads_vllm_keys():
    row = serve_report.row_from_result(RESULT, "random-256", 1, "pagedserve", 8)
    assert (row.completed, row.output_tokens, row.output_tok_s, row.total_tok_s) == (8, 512, 25.31, 126.5)
    assert (row.ttft_p50_ms, row.ttft_p99_ms, row.tpot_p50_ms, row.tpot_p99_ms) == (784.2, 903.0, 28.41, 31.0)


def test_row_from_result_names_missing_key():
    broken = {k: v for k, v in RESULT.items() if k != "p99_tpot_ms"}
    with pytest.raises(ValueError, match="p99_tpot_ms"):
        serve_report.row_from_result(broken, "random-256", 1, "vllm", 8)


def test_markdown_and_json(tmp_path):
    rows = [serve_report.row_from_result(RESULT, "random-256", 1, "pagedserve", 8),
            serve_report.row_from_result({**RESULT, "total_output_tokens": 448, "completed": 7}, "random-256", 1,
                                         "llamacpp", 8),
            serve_report.failed_row("random-256", 1, "vllm", 8, "vllm not ready after 900 s:\n  tail")]
    header = {"cpu_model": "AMD EPYC 7B13", "cpu_count": 2, "git_commit": "abc123", "output_len": 64}
    md_path, json_path = serve_report.write_report(str(tmp_path / "t"), header, rows)
    md = Path(md_path).read_text()
    assert "AMD EPYC 7B13" in md and "abc123" in md
    assert "| random-256 | 1 | pagedserve | 8/8 | 25.3 | 126.5 | 784 | 903 | 28.4 | 31.0 |" in md
    assert "| random-256 | 1 | llamacpp | 7/8 |" in md
    assert "| random-256 | 1 | vllm | failed | - | - | - | - | - | - |" in md
    assert "- random-256 c=1 vllm: vllm not ready after 900 s: tail" in md
    assert "- random-256 c=1 llamacpp: 448" not in md  # 7 completed x 64 = 448: not short
    data = json.loads(Path(json_path).read_text())
    assert data["header"]["git_commit"] == "abc123" and len(data["rows"]) == 3
    assert data["rows"][0]["tpot_p50_ms"] == 28.41 and data["rows"][2]["error"].startswith("vllm not ready")


def test_short_output_is_flagged():
    row = serve_report.row_from_result({**RESULT, "total_output_tokens": 500}, "random-256", 1, "llamacpp", 8)
    md = serve_report.markdown({"output_len": 64}, [row])
    assert "- random-256 c=1 llamacpp: 500" in md


def test_machine_header_has_commit_and_cpu():
    header = serve_report.machine_header(str(BENCH.parent))
    assert header["git_commit"] != "unknown" and header["cpu_model"]


def test_server_that_cannot_start_gives_failed_rows(tmp_path):
    """llamacpp with an empty anchors dir: the serve script exits at once; every cell is a failed row with the
    reason, and no benchmark runs."""
    args = serve_compare.parse_args(["--systems", "llamacpp", "--concurrency", "1,4", "--input-lens", "256",
                                     "--anchors-dir", str(tmp_path / "none"), "--ready-timeout", "60"])
    rows = serve_compare.run_system("llamacpp", args, str(tmp_path), serve_compare.free_port())
    assert [(r.workload, r.concurrency) for r in rows] == [("random-256", 1), ("random-256", 4),
                                                           ("prefix-512+64", 1), ("prefix-512+64", 4)]
    assert all(r.output_tok_s is None and "llama-server not found" in r.error for r in rows)
    assert [r.num_prompts for r in rows] == [8, 12, 8, 12]
