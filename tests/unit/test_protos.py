"""The committed stubs match protos/ (drift test), and the proto carries every name API.md fixes."""
from __future__ import annotations

import importlib.util
import re

import pytest

from pagedserve_client.v1 import inference_pb2 as pb
from support import REPO_ROOT

ROOT = REPO_ROOT
STUB_DIR = ROOT / "client" / "pagedserve_client" / "v1"
API_MD = ROOT.parent / "shared" / "API.md"  # the design docs sit beside the checkout; optional cross-check
FILE = pb.DESCRIPTOR
SERVICE = FILE.services_by_name["InferenceService"]

# name: (input, output, client streaming, server streaming), from API.md's RPC table.
RPCS = {
    "Generate": ("GenerateRequest", "GenerateResponse", False, True),
    "Embed": ("EmbedRequest", "EmbedResponse", False, False),
    "EmbedStream": ("EmbedRequest", "EmbedResponse", True, True),
    "Tokenize": ("TokenizeRequest", "TokenizeResponse", False, False),
    "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False, False),
    "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False, False),
    "Abort": ("AbortRequest", "AbortResponse", False, False),
    "Rerank": ("RerankRequest", "RerankResponse", False, False),
    "Score": ("ScoreRequest", "ScoreResponse", False, False),
}
SAMPLING_SCALARS = ["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "include_stop_str_in_output",
                    "ignore_eos", "n", "logprobs", "prompt_logprobs", "skip_special_tokens",
                    "truncate_prompt_tokens"]
SAMPLING_REPEATED = ["stop", "stop_token_ids", "logit_bias"]
SAMPLING_MESSAGES = {"structured_output": "pagedserve.v1.StructuredOutput"}
# message: fields API.md names (beyond the ones checked on their own below).
FIELDS = {
    "GenerateRequest": ["request_id", "prompt", "prompt_token_ids", "messages", "priority", "cache_salt",
                        "sampling"],
    "GenerateResponse": ["request_id", "index", "text", "token_ids", "logprobs", "finish_reason",
                         "matched_stop_str", "matched_stop_token_id", "usage", "prompt_logprobs"],
    "TokenLogprob": ["token_id", "logprob", "rank", "top_logprobs"],
    "Usage": ["prompt_tokens", "completion_tokens", "cached_prompt_tokens"],
    "ChatMessage": ["role", "content"],
    "EmbedRequest": ["inputs", "normalize", "truncate", "dimensions", "request_id"],
    "EmbedResponse": ["embeddings", "usage", "request_id"],
    "Embedding": ["values"],
    "EmbedUsage": ["prompt_tokens"],
    "AbortRequest": ["request_ids"],
    "GenerationModelInfo": ["name", "architecture", "dtype", "max_model_len", "vocab_size", "block_size",
                            "num_kv_blocks"],
    "EmbeddingModelInfo": ["embedding_dimension"],
    "RerankRequest": ["query", "texts", "top_n", "return_text", "truncate"],
    "RerankResponse": ["results", "usage"],
    "RerankResult": ["index", "score", "text"],
    "ScoreRequest": ["text_1", "text_2", "truncate"],
    "ScoreResponse": ["scores", "usage"],
}


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_equal_freshly_generated_ones(tmp_path):
    written = _load_gen_protos().generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in written}
    committed = {p.name: p.read_bytes() for p in STUB_DIR.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")}
    assert sorted(fresh) == sorted(committed), "run `python scripts/gen_protos.py`"
    drifted = [name for name in fresh if fresh[name] != committed[name]]
    assert not drifted, f"stubs drifted from protos/ ({drifted}): run `python scripts/gen_protos.py`"


def test_stubs_import_relatively():
    grpc_stub = (STUB_DIR / "inference_pb2_grpc.py").read_text()
    assert "from . import inference_pb2" in grpc_stub
    assert not re.search(r"^from pagedserve\.", grpc_stub, flags=re.M)


def test_service_rpcs():
    assert FILE.package == "pagedserve.v1"
    assert sorted(m.name for m in SERVICE.methods) == sorted(RPCS)
    for name, (req, resp, client_streaming, server_streaming) in RPCS.items():
        method = SERVICE.methods_by_name[name]
        assert (method.input_type.name, method.output_type.name) == (req, resp), name
        assert (method.client_streaming, method.server_streaming) == (client_streaming, server_streaming), name


def test_generate_request_input_is_a_oneof():
    oneof = pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert sorted(f.name for f in oneof.fields) == ["messages", "prompt", "prompt_token_ids"]
    request = pb.GenerateRequest(prompt="a")
    request.prompt_token_ids.ids.append(1)
    assert request.WhichOneof("input") == "prompt_token_ids" and not request.HasField("prompt")
    tokenize = pb.TokenizeRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert sorted(f.name for f in tokenize.fields) == ["messages", "text"]


def test_sampling_params_fields_and_presence():
    fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    assert sorted(fields) == sorted(SAMPLING_SCALARS + SAMPLING_REPEATED + list(SAMPLING_MESSAGES))
    for name, full_name in SAMPLING_MESSAGES.items():
        assert fields[name].message_type.full_name == full_name
    for name in SAMPLING_SCALARS:
        assert fields[name].has_presence, f"SamplingParams.{name} needs presence (`optional`)"
    assert pb.SamplingParams(temperature=0.0).HasField("temperature")
    assert not pb.SamplingParams().HasField("temperature")
    for name in SAMPLING_REPEATED:
        assert fields[name].is_repeated, name
    assert fields["logit_bias"].message_type.GetOptions().map_entry


def test_structured_output_is_a_oneof_with_api_md_names():
    kinds = pb.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"].fields
    assert [f.name for f in kinds] == ["json_schema", "json_object", "regex", "choice", "grammar"]
    assert [f.name for f in pb.StructuredOutput.Choice.DESCRIPTOR.fields] == ["choices"]
    assert pb.StructuredOutput.Choice.DESCRIPTOR.fields_by_name["choices"].is_repeated


def test_presence_where_a_zero_is_meaningful():
    for message, names in {"EmbedRequest": ["normalize", "truncate", "dimensions"],
                           "TokenizeRequest": ["add_special_tokens", "add_generation_prompt"],
                           "DetokenizeRequest": ["skip_special_tokens"],
                           "RerankRequest": ["top_n"], "RerankResult": ["text"]}.items():
        fields = getattr(pb, message).DESCRIPTOR.fields_by_name
        for name in names:
            assert fields[name].has_presence, f"{message}.{name}"
    matched = pb.GenerateResponse.DESCRIPTOR.oneofs_by_name["matched_stop"]
    assert sorted(f.name for f in matched.fields) == ["matched_stop_str", "matched_stop_token_id"]


def test_finish_reason_values():
    assert dict(pb.FinishReason.items()) == {"FINISH_REASON_UNSPECIFIED": 0, "FINISH_REASON_STOP": 1,
                                             "FINISH_REASON_LENGTH": 2, "FINISH_REASON_ABORT": 3,
                                             "FINISH_REASON_TOOL_CALLS": 4}
    field = pb.GenerateResponse.DESCRIPTOR.fields_by_name["finish_reason"]
    assert field.enum_type.name == "FinishReason"


@pytest.mark.parametrize("message", sorted(FIELDS))
def test_named_fields_exist(message):
    fields = getattr(pb, message).DESCRIPTOR.fields_by_name
    missing = [name for name in FIELDS[message] if name not in fields]
    assert not missing, f"{message} lacks {missing}"


def test_model_info_response_parts():
    fields = pb.GetModelInfoResponse.DESCRIPTOR.fields_by_name
    assert fields["generation"].message_type.name == "GenerationModelInfo"
    assert fields["embedding"].message_type.name == "EmbeddingModelInfo"
    assert fields["generation"].has_presence and fields["embedding"].has_presence
    assert fields["rerank"].message_type.name == "RerankModelInfo" and fields["rerank"].has_presence


@pytest.mark.skipif(not API_MD.exists(), reason="API.md is not beside this checkout")
def test_api_md_tables_match_the_descriptor():
    text = API_MD.read_text()
    rpcs = re.findall(r"^\| `(\w+)\((stream )?(\w+)\) returns \((stream )?(\w+)\)` \|", text, flags=re.M)
    # API.md is the contract's floor: each RPC it names is served as it says; RPCs added since
    # (Rerank, Score) are checked above against the descriptor and documented in the README.
    assert len(rpcs) >= 7 and {r[0] for r in rpcs} <= set(RPCS)
    for name, client_stream, req, server_stream, resp in rpcs:
        assert RPCS[name] == (req, resp, bool(client_stream), bool(server_stream)), name
    section = text[text.index("| SamplingParams field"):]
    section = section[:section.index("\n\n")]
    names = {n for row in section.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert names == set(SAMPLING_SCALARS + SAMPLING_REPEATED)
