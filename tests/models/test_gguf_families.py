"""GGUF files of every GGUF architecture the loader maps (models/gguf_arch.py), written from tiny seeded random HF
models the way llama.cpp's converter writes them (tests/gguf_cases.py: F32, F16, Q8_0, Q4_0), loaded the way
``--model x.gguf`` loads them: logits within float32 tolerance and greedy tokens identical against transformers'
own GGUF reader (``from_pretrained(dir, gguf_file=...)``) where it reads the case's config right, else against the
source model holding the stored values; quantized weights (experts and Phi-3's fused projections included) kept as
stored; through the engine for three architectures (batched, chunked prefill, prompts longer than Gemma's windows);
and each kind of refusal at start-up, named."""
from __future__ import annotations

import random

import pytest
import torch

from gguf_cases import CASES, case_model, stored_model, write_gguf


def _load(path, quantization: str = "auto"):
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    src = ModelSource.resolve(str(path))
    cfg = src.load_config()
    return build_model(src, cfg, torch.float32, "cpu", quantization=quantization,
                       linear_kernels="float-activations"), cfg


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(label, our model from the GGUF file, its config, the oracle HF model)."""
    from transformers import AutoModelForCausalLM

    label = request.param
    arch, _, _, qtype, oracle = CASES[label]
    path = tmp_path_factory.mktemp(label) / f"{label}.gguf"
    hf = case_model(label)
    stored = write_gguf(hf, arch, path, qtype)
    # float files: every weight dense (auto would run the LM head int8); quantized ones run as stored
    model, cfg = _load(path, "none" if qtype in ("F32", "F16") else "auto")
    if oracle == "transformers":
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    else:
        ref = stored_model(hf, arch, stored)
    return label, model, cfg, ref


def test_prefill_logits_match_the_oracle(case):
    """A 150-token prefill (128 for longrope, exact up to its original length): logits within float32 tolerance of
    the oracle's, the same argmax everywhere; the config names the family the GGUF table says."""
    from support import prefill_hidden

    from pagedserve.models.gguf_arch import GGUF_ARCHITECTURES, GGUF_MOE_VARIANTS

    label, model, cfg, ref = case
    table = GGUF_MOE_VARIANTS if label.startswith("mixtral") else GGUF_ARCHITECTURES
    assert cfg.architectures == [type(model).__name__] == [table[CASES[label][0]].hf_architecture]
    ids = random.Random(1).choices(range(2, 256), k=min(150, model.max_exact_len or 150))   # longrope: 128
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = model.compute_logits(prefill_hidden(model, ids))
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_quantized_weights_run_as_stored(case):
    """A quantized file's linears (each expert, Phi-3's fused Q/K/V and gate/up cut by rows) and its embedding run
    on their stored blocks; none is dequantized."""
    from pagedserve.models.moe import SparseMoeBlock

    label, model, _, _ = case
    qtype = CASES[label][3]
    if qtype in ("F32", "F16"):
        assert model.quantization == "none"
        return
    assert "dequantized" not in model.quantization and "quantized at load" not in model.quantization
    assert "embedding Q8_0" in model.quantization if qtype == "Q8_0" else f"({qtype} as stored)" in model.quantization
    layers = [m for m in model.modules() if type(m).__name__.startswith("Streaming")]
    assert layers and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    moe = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if moe:
        assert all(type(e.gate_up_proj).__name__.startswith("Streaming") for e in moe[0].experts)


@pytest.mark.parametrize("qtype", ["BF16", "Q5_0"])
def test_types_not_kept_are_dequantized(tmp_path, qtype):
    """A type without a kernel (BF16, Q5_0) is dequantized by gguf under ``--quantization auto`` (the summary says
    so) and computes the stored values' model."""
    from support import prefill_hidden

    hf = case_model("qwen3moe-small-q4")
    stored = write_gguf(hf, "qwen3moe", tmp_path / "m.gguf", qtype)
    model, _ = _load(tmp_path / "m.gguf")
    assert "linear dense float32 (dequantized)" in model.quantization and "as stored" not in model.quantization
    ids = random.Random(1).choices(range(2, 256), k=100)
    with torch.no_grad():   # the final hidden states (the LM head of a float weight runs int8 under auto)
        want = stored_model(hf, "qwen3moe", stored)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(prefill_hidden(model, ids), want[0], atol=5e-5, rtol=1e-5)


def test_mixtral_one_tensor_per_expert(tmp_path):
    """The older converters' Mixtral layout (``blk.N.ffn_gate.E.weight``, one 2-D tensor per expert) reads as the
    stacked one does: experts kept as stored, the stored values' logits."""
    from support import prefill_hidden

    hf = case_model("mixtral-q4")
    stored = write_gguf(hf, "llama", tmp_path / "m.gguf", "Q4_0", legacy_experts=True)
    model, cfg = _load(tmp_path / "m.gguf")
    assert cfg.architectures == ["MixtralForCausalLM"] and "dequantized" not in model.quantization
    ids = random.Random(1).choices(range(2, 256), k=100)
    with torch.no_grad():
        want = stored_model(hf, "llama", stored)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.compute_logits(prefill_hidden(model, ids)), want, atol=5e-5, rtol=1e-5)


ENGINE_CASES = ["gemma2-softcap-q8", "gemma3-linear-q4", "qwen3moe-small-q4", "mixtral-q4"]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("label", ENGINE_CASES)
def test_greedy_through_engine(tmp_path, label, backend):
    """The start-up path of ``--model x.gguf`` (config, executor, weights kept as stored under the default
    ``--quantization auto``), four prompts at once, 64-token steps (chunked prefill), prompts past Gemma's windows
    (24 and 20 tokens): greedy tokens equal to the oracle's."""
    from backend_cases import word_tokenizer
    from family_cases import engine_greedy, hf_greedy
    from pagedserve.attention.cpu import CpuAttentionBackend
    from pagedserve.attention.torch_ref import TorchAttentionBackend
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    arch, _, _, qtype, _ = CASES[label]
    hf = case_model(label)
    stored = write_gguf(hf, arch, tmp_path / "m.gguf", qtype)
    ref = stored_model(hf, arch, stored)
    rng = random.Random(2)
    prompts = [rng.choices(range(2, 256), k=n) for n in (7, 45, 130, 200)]
    config = EngineConfig(model=str(tmp_path / "m.gguf"), device="cpu", dtype="float32", attention_backend=backend,
                          num_kv_blocks=200, max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=True,
                          linear_kernels="float-activations")
    engine, info = build_engine(config, tokenizer=word_tokenizer(256),
                                backend=CpuAttentionBackend() if backend == "cpu" else TorchAttentionBackend())
    assert "as stored" in info.quantization and "dequantized" not in info.quantization
    if arch.startswith("gemma"):
        assert any(info.sliding_windows) and max(info.sliding_windows) < 130
    out = engine_greedy(engine, prompts, 6)
    assert out == {f"r{i}": hf_greedy(ref, ids, 6) for i, ids in enumerate(prompts)}


def test_tensor_parallel_2_equals_1_on_quantized_experts(tmp_path):
    """Two spawned ranks (gloo) on the Qwen3-MoE Q8_0 file, its experts kept as stored and sliced on every rank
    (gate/up rows, down columns on whole Q8_0 blocks), give the logits of one."""
    from tp_cases import run_group

    arch, _, _, qtype, _ = CASES["qwen3moe-q8"]
    path = str(tmp_path / "m.gguf")
    write_gguf(case_model("qwen3moe-q8"), arch, path, qtype)
    ids = random.Random(4).choices(range(2, 256), k=90)
    args = ("checkpoint_prefill_logits", path, ids, "auto", "float-activations")
    one = torch.tensor(run_group(1, *args)[0])
    two = run_group(2, *args)
    assert two[1] is None
    torch.testing.assert_close(torch.tensor(two[0]), one, atol=2e-5, rtol=1e-5)
    assert torch.equal(torch.tensor(two[0]).argmax(-1), one.argmax(-1))


def test_embedded_config_equals_transformers_reader(smollm_source):
    """The embedded Llama GGUF's config from its metadata equals what transformers' GGUF reader makes of it."""
    from transformers import AutoConfig

    ours = smollm_source.load_config().to_diff_dict()
    theirs = AutoConfig.from_pretrained(smollm_source.directory, gguf_file=smollm_source.gguf_file).to_diff_dict()
    assert ours.pop("architectures") == ["LlamaForCausalLM"]
    theirs.pop("_model_name_or_path")
    assert ours == theirs


# ---- refusals, one per kind ------------------------------------------------------------------------------------


def _write(tmp_path, label: str, arch: str | None = None, extra=None, tensors=None):
    """Case ``label``'s tiny model as a GGUF file, with ``arch`` as its ``general.architecture`` if given."""
    import gguf

    import gguf_cases

    own_arch, _, _, qtype, _ = CASES[label]
    path = tmp_path / "m.gguf"
    hf = case_model(label)
    if arch is None:
        write_gguf(hf, own_arch, path, qtype, extra=extra, tensors=tensors)
    else:   # another architecture's name over this one's metadata
        w = gguf.GGUFWriter(str(path), arch)
        gguf_cases._metadata(w, hf.config, own_arch)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path


def test_unknown_architecture_refused(tmp_path):
    from pagedserve.models.loader import ModelSource

    src = ModelSource.resolve(str(_write(tmp_path, "llama", arch="mamba")))
    with pytest.raises(ValueError, match=r"^general.architecture='mamba' is not supported \(supported: \["):
        src.load_config()


@pytest.mark.parametrize("label, extra, message", [
    ("llama", lambda w: w.add_logit_scale(2.0), r"^llama.logit_scale=2.0: not read by the engine's GGUF llama support"),
    ("llama", lambda w: w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN),
     r"^llama.rope.scaling.type='yarn': only 'none' and 'linear'"),
    ("qwen2-f16", lambda w: w.add_rope_dimension_count(8), r"^qwen2.rope.dimension_count=8: partial rotary is not "
                                                           r"read for qwen2 \(head size 16\)"),
])
def test_config_field_refused(tmp_path, label, extra, message):
    """A metadata key the engine does not read, or a value it cannot run exactly, named with its value."""
    from pagedserve.models.loader import ModelSource

    with pytest.raises(ValueError, match=message):
        ModelSource.resolve(str(_write(tmp_path, label, extra=extra))).load_config()


def test_unknown_tensor_refused(tmp_path):
    """A tensor the architecture does not map (a fused QKV in a llama file) is refused naming it."""
    import numpy as np

    path = _write(tmp_path, "llama", tensors={"blk.0.attn_qkv.weight": np.zeros((128, 64), dtype=np.float32)})
    with pytest.raises(ValueError, match=r"^GGUF tensor 'blk.0.attn_qkv.weight' is not supported for "
                                         r"LlamaForCausalLM"):
        _load(path)


def test_rope_freqs_other_than_llama3_refused(tmp_path):
    """llama's ``rope_freqs.weight`` is read as a llama3 rope (tested in the ``llama3-rope`` case); divisors that
    are no llama3 curve are refused naming the tensor."""
    import numpy as np

    from pagedserve.models.loader import ModelSource

    path = _write(tmp_path, "llama", tensors={"rope_freqs.weight": np.array([1, 1, 3, 1, 2, 2, 5, 8], np.float32)})
    with pytest.raises(ValueError, match=r"^rope_freqs.weight: the factors are not a llama3 rope curve"):
        ModelSource.resolve(str(path)).load_config()


def test_tensor_type_neither_kept_nor_readable_refused(tmp_path):
    """A tensor type gguf cannot dequantize (Q8_1) is refused at start-up naming the tensor and the type."""
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((64, 128 // block * size), dtype=np.uint8)
    path = _write(tmp_path, "llama", tensors={"blk.0.ffn_down.weight": (raw, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(ValueError, match=r"^GGUF tensor 'blk.0.ffn_down.weight' has type Q8_1, which the engine "
                                         r"can neither keep"):
        _load(path)
