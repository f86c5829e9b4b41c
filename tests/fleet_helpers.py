"""Helpers of the fleet e2e tests (imported by module name: tests/e2e has no __init__.py)."""
from __future__ import annotations

import os


def write_tiny_llama(path) -> str:
    """A 2-layer random-weight Llama (hidden 64) with SmolLM2's tokenizer saved in ``path``: a replica that starts
    in seconds. Returns the path as a string."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.models.loader import ModelSource

    tokenizer = ModelSource.resolve(None).load_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


