"""A tiny model that writes what a test scripts, for the reasoning tests: a one-layer Llama whose layers add
nothing (zero output projections), so its next token depends on the current token only (a bigram table in the
embedding and LM head weights). Greedy decoding then follows chains ``trigger -> t1 -> t2 -> ... -> EOS`` set per
token; any token not in a chain is followed by EOS, and where a grammar forbids the scripted token, every allowed
token ties and the lowest id is taken. Random weights cannot be relied on to write ``</think>``; this model
writes it when told, through the whole server path (template, engine, detokenizer, parsers).

The tokenizer is the embedded SmolLM2's with the reasoning tags added as plain (non-special) tokens, as Qwen3's
and DeepSeek's tokenizers have them; harmony's tags are added the same way (text, not special tokens).
"""
from __future__ import annotations

TAGS = ["<think>", "</think>", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"]
HIDDEN = 128
SCALE = 4.0   # logit of the scripted token: SCALE * sqrt(HIDDEN), about 45, against 0 for every other token


def tag_tokenizer(base):
    """``base`` (a transformers tokenizer) with :data:`TAGS` added as plain tokens."""
    base.add_tokens(TAGS)
    return base


def encode(tokenizer, *pieces: str) -> list[int]:
    """The token ids of the pieces, each encoded on its own (a tag piece is its one token)."""
    ids: list[int] = []
    for piece in pieces:
        ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return ids


def successors(chains: list[list[int]]) -> dict[int, int]:
    """Token -> next token over the chains. Raises AssertionError where one token would need two successors."""
    nxt: dict[int, int] = {}
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            assert nxt.setdefault(a, b) == b, f"token {a} followed by both {nxt[a]} and {b}"
    return nxt


def write_scripted_model(path: str, tokenizer, chains: list[list[int]]) -> None:
    """Save a LlamaForCausalLM (and ``tokenizer``) to ``path`` that follows ``chains`` under greedy decoding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    nxt = successors(chains)
    assert len(nxt) < HIDDEN, "one hidden dimension per scripted token, and one for the rest"
    eos = tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        rest = HIDDEN - 1
        emb[:, rest] = 1.0            # an unscripted token: EOS next
        head[eos, rest] = SCALE
        for k, (a, b) in enumerate(sorted(nxt.items())):
            emb[a].zero_()
            emb[a, k] = 1.0
            head[b, k] = SCALE
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
