"""A config the engine cannot run exactly is refused when the model is built, naming the config field; one that is
exact only up to a length (a rope type that changes with the length) caps the served context there, and a longer
``--max-model-len`` is refused naming the field; sliding windows reach their layers and cap nothing. One test per
refusal kind."""
from __future__ import annotations

import pytest
import torch

from family_cases import hf_config, save_random_checkpoint


def _build(cfg, tp=None):
    """The family model of ``cfg`` on the meta device (what build_model does before reading any weight)."""
    from pagedserve.models.registry import MODEL_REGISTRY, architecture_of

    with torch.device("meta"):
        return MODEL_REGISTRY[architecture_of(cfg)](cfg) if tp is None else MODEL_REGISTRY[architecture_of(cfg)](cfg, tp)


def test_unregistered_architecture_refused(tmp_path):
    from transformers import FalconConfig

    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    cfg = FalconConfig(architectures=["FalconForCausalLM"])
    source = ModelSource(str(tmp_path), str(tmp_path), None)  # never read: the refusal comes first
    with pytest.raises(ValueError, match="architecture 'FalconForCausalLM' is not supported"):
        build_model(source, cfg, torch.float32, "cpu")


def test_gemma_activation_and_bidirectional_attention_refused():
    from pagedserve.models.decoder import UnsupportedConfig

    with pytest.raises(UnsupportedConfig, match=r"^hidden_activation='gelu': the MLP runs GeGLU with the tanh GELU"):
        _build(hf_config("gemma2", hidden_activation="gelu"))
    with pytest.raises(UnsupportedConfig, match=r"^use_bidirectional_attention=True: "):
        _build(hf_config("gemma3", use_bidirectional_attention=True))


def test_quantized_gpt_oss_checkpoint_refused():
    from pagedserve.models.decoder import UnsupportedConfig

    cfg = hf_config("gpt-oss")
    cfg.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    with pytest.raises(UnsupportedConfig, match=r"^quantization_config.quant_method='mxfp4': "):
        _build(cfg)


def test_softcap_and_sinks_refused_on_a_backend_without_them():
    """A backend that does not run soft-capping or sinks is refused when the worker is built, naming the config
    field (every backend of the project runs both: torch, cpu and cuda)."""
    from pagedserve.attention.base import check_features
    from pagedserve.attention.torch_ref import TorchAttentionBackend

    class WindowOnly(TorchAttentionBackend):
        name, features = "cuda-like", frozenset({"sliding_window"})

    gemma, oss = _build(hf_config("gemma2")), _build(hf_config("gpt-oss"))
    assert gemma.attention_features() == {"sliding_window": "sliding_window=24",
                                          "softcap": "attn_logit_softcapping=2.0"}
    with pytest.raises(ValueError, match=r"^attn_logit_softcapping=2.0: the 'cuda-like' attention backend does "
                                         r"not run softcap"):
        check_features(WindowOnly(), gemma.attention_features())
    with pytest.raises(ValueError, match=r"^model_type='gpt_oss' \(attention sinks\): the 'cuda-like'"):
        check_features(WindowOnly(), oss.attention_features())
    check_features(TorchAttentionBackend(), oss.attention_features())
    from pagedserve.attention.cuda import CudaAttentionBackend

    assert {"sliding_window", "softcap", "sinks"} <= CudaAttentionBackend.features


def test_activation_refused():
    from pagedserve.models.decoder import UnsupportedConfig

    with pytest.raises(UnsupportedConfig, match=r"^hidden_act='gelu': the MLP runs SwiGLU"):
        _build(hf_config("llama", hidden_act="gelu"))


def test_unknown_rope_type_refused():
    from pagedserve.models.decoder import UnsupportedConfig

    cfg = hf_config("llama")
    cfg.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedConfig, match=r"^rope_parameters.rope_type='proportional' is not supported"):
        _build(cfg)


def test_missing_rope_parameter_refused():
    from pagedserve.models.decoder import UnsupportedConfig

    cfg = hf_config("llama")
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 64}
    with pytest.raises(UnsupportedConfig, match=r"^rope_parameters.high_freq_factor is required"):
        _build(cfg)


def test_odd_partial_rotary_refused():
    from pagedserve.models.decoder import UnsupportedConfig

    with pytest.raises(UnsupportedConfig, match=r"^partial_rotary_factor gives 5 rotary features"):
        _build(hf_config("phi3", partial_rotary_factor=5 / 16))


def test_experts_that_do_not_split_refused_under_tensor_parallel():
    from pagedserve.models.decoder import UnsupportedConfig
    from pagedserve.models.layers import TPGroup

    with pytest.raises(UnsupportedConfig, match=r"^tensor_parallel_size 3 does not divide the experts' "
                                                r"intermediate size 32"):
        _build(hf_config("qwen3-moe", num_attention_heads=6, num_key_value_heads=3), TPGroup(rank=0, size=3))


def test_no_rope_layers_length_refused():
    from pagedserve.models.decoder import UnsupportedConfig

    cfg = hf_config("smollm3")
    cfg.no_rope_layers = [1, 0]
    with pytest.raises(UnsupportedConfig, match=r"^no_rope_layers has 2 entries for 3 layers"):
        _build(cfg)


def _engine(model, cfg, **kwargs):
    from backend_cases import word_tokenizer
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    config = EngineConfig(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=64, **kwargs)
    return build_engine(config, model=model, tokenizer=word_tokenizer(256), hf_config=cfg)


@pytest.mark.parametrize("label,extra,field,limit", [
    ("phi3-longrope", {}, "rope_parameters.rope_type='longrope'", 128),
])
def test_exact_only_up_to_a_length_caps_the_context(tmp_path, label, extra, field, limit):
    """The served context stops where the model stops being exact (a prompt past it is refused, never served
    approximately), and a larger --max-model-len is refused naming the field."""
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model
    from pagedserve.sampling_params import SamplingParams

    save_random_checkpoint(hf_config(label, **extra), tmp_path)
    src = ModelSource.resolve(str(tmp_path))
    cfg = src.load_config()
    model = build_model(src, cfg, torch.float32, "cpu")
    assert model.max_exact_len == limit and model.max_exact_len_reason.startswith(field)
    engine, info = _engine(model, cfg)
    assert info.max_model_len == limit
    with pytest.raises(ValueError, match="max_model_len|context|long"):
        engine.add_request("long", list(range(2, 2 + limit + 1)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=f"max_model_len {limit + 16} > {limit}, the most this model runs exactly: "
                                         f"{field}"):
        _engine(model, cfg, max_model_len=limit + 16)
    engine, info = _engine(model, cfg, max_model_len=limit)
    assert info.max_model_len == limit


@pytest.mark.parametrize("label,extra,windows", [
    ("mistral", dict(sliding_window=64), (64, 64, 64)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=96, max_window_layers=1), (None, 96, 96)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=80, max_window_layers=2), (None, None, 80)),
    ("phi3", dict(sliding_window=48), (48, 48, 48)),
    ("smollm3", dict(use_sliding_window=True, sliding_window=32,
                     layer_types=["full_attention", "sliding_attention", "full_attention"]), (None, 32, None)),
])
def test_sliding_windows_reach_each_layer_and_cap_nothing(label, extra, windows):
    """Each layer gets its window (transformers' ``layer_types``, or every layer), and the served context is the
    model's whole ``max_position_embeddings``: the attention backends run the window (tests/models/test_families.py
    checks the output past the window against transformers)."""
    model = _build(hf_config(label, **extra))
    assert tuple(layer.self_attn.sliding_window for layer in model.layers) == windows
    assert model.max_exact_len is None


@pytest.mark.parametrize("extra,field", [
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(sliding_window=-4), "sliding_window=-4"),
    (dict(sliding_window=16, layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     "layer_types="),
    (dict(sliding_window=16, layer_types=["sliding_attention"]), "layer_types="),
])
def test_bad_windows_are_refused_naming_the_field(extra, field):
    from pagedserve.models.config_checks import UnsupportedConfig

    cfg = hf_config("mistral")
    for key, value in extra.items():
        setattr(cfg, key, value)
    with pytest.raises(UnsupportedConfig, match=field):
        _build(cfg)


def test_windows_switched_off_give_full_attention():
    """A window switched off (use_sliding_window false, or no sliding_window) leaves every layer full attention, as
    does a ``sliding_window`` field in a family whose HF class ignores it (Llama, Granite, OLMo 2)."""
    for cfg in (hf_config("qwen2", use_sliding_window=False, sliding_window=32), hf_config("mistral", sliding_window=None),
                hf_config("llama"), hf_config("llama", sliding_window=8), hf_config("granite", sliding_window=8),
                hf_config("olmo2", sliding_window=8)):
        model = _build(cfg)
        assert model.max_exact_len is None and all(layer.self_attn.sliding_window is None for layer in model.layers)
