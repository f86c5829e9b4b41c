"""Every config field is exactly one `pagedserve serve` flag and one PAGEDSERVE_ environment variable (the command
line wins), with the dataclass default; and the server's keepalive and message-size settings reach gRPC under gRPC
core's own option names."""
from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import grpc
import pytest

from pagedserve import cli
from pagedserve.config import EngineConfig, ServerConfig
from pagedserve.envs import pagedserve_settings
from pagedserve.config_flags import env_value, field_docs, flag_specs

SPECS = flag_specs(ServerConfig, EngineConfig)


def _serve_parser(environ=None):
    parser = cli.build_parser(environ or {})
    return parser, parser._subparsers._group_actions[0].choices["serve"]


def _env_text(spec) -> str:
    """An environment value different from the field's default, for every kind of field."""
    if spec.base_type is bool:
        return "false" if spec.default else "true"
    if spec.choices:
        return next(c for c in spec.choices if c != spec.default)
    if spec.base_type is int:
        return str((spec.default or 0) + 7)
    if spec.base_type is float:
        return str(round((spec.default or 0.0) + 0.05, 3) if spec.name.endswith("utilization") else
                   (spec.default or 0.0) + 1.5)
    return "somewhere"


def test_every_config_field_has_exactly_one_flag_and_one_variable():
    fields = [f.name for cls in (ServerConfig, EngineConfig) for f in dataclasses.fields(cls)]
    _, serve = _serve_parser()
    actions = [a for a in serve._actions if a.dest != "help"]
    assert sorted(a.dest for a in actions) == sorted(fields)  # no flag without a field, no field without a flag
    for action in actions:
        long_flags = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        assert long_flags == ["--" + action.dest.replace("_", "-")], action.option_strings
    assert len({s.env_var for s in SPECS}) == len(fields)


def test_every_field_is_read_from_its_environment_variable():
    environ = {s.env_var: _env_text(s) for s in SPECS}
    args = cli.build_parser(environ).parse_args(["serve"])
    for spec in SPECS:
        expected = env_value(spec, environ[spec.env_var])
        assert getattr(args, spec.name) == expected != spec.default, spec.name


def test_help_shows_the_dataclass_defaults_and_documentation():
    out = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=120, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"}).stdout
    text = re.sub(r"\s+", " ", out)
    for cls in (ServerConfig, EngineConfig):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            assert flag in text, flag
            assert f"[env PAGEDSERVE_{f.name.upper()}]" in text, f.name
            assert re.sub(r"\s+", " ", docs[f.name]).split(" ")[0] in text, f.name
            match = re.search(re.escape(f"[env PAGEDSERVE_{f.name.upper()}]") + r" \(default: ([^)]*)\)", text)
            assert match is not None, f.name
            assert match.group(1) == str(f.default), (f.name, match.group(1), f.default)


def test_command_line_wins_and_values_reach_the_configs():
    environ = {"PAGEDSERVE_PORT": "6000", "PAGEDSERVE_MAX_NUM_SEQS": "8", "PAGEDSERVE_ENABLE_PREFIX_CACHING": "off",
               "PAGEDSERVE_KEEPALIVE_PERMIT_WITHOUT_CALLS": "no", "PAGEDSERVE_METRICS_PORT": "9464",
               "PAGEDSERVE_SHUTDOWN_GRACE_S": "2.5", "PAGEDSERVE_TARGET": "for-the-client:1",
               "PAGEDSERVE_EMBEDDING_MODEL": "none", "PAGEDSERVE_SEED": "7"}
    args = cli.build_parser(environ).parse_args(["serve", "--port", "7000", "--kv-cache-memory-bytes", "1048576"])
    server, engine = cli.configs_from_args(args)
    assert server.port == 7000 and server.metrics_port == 9464 and server.shutdown_grace_s == 2.5
    assert server.keepalive_permit_without_calls is False and server.embedding_model == ""
    assert engine.max_num_seqs == 8 and engine.enable_prefix_caching is False and engine.seed == 7
    assert engine.kv_cache_memory_bytes == 1 << 20


@pytest.mark.parametrize("name,value", [
    ("PAGEDSERVE_PORT", "eighty"), ("PAGEDSERVE_DTYPE", "float64"), ("PAGEDSERVE_GENERATION_MODEL", "maybe"),
])
def test_bad_environment_value_exits_2_naming_the_variable(name, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser({name: value})
    assert exit_info.value.code == 2
    assert name in capsys.readouterr().err


def test_unknown_variable_is_warned_about(capsys):
    cli.build_parser({"PAGEDSERVE_MAX_NUM_SEQ": "4"})
    assert "PAGEDSERVE_MAX_NUM_SEQ" in capsys.readouterr().err


def test_undocumented_field_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Partial:
        """Attributes:
            documented: yes.
        """

        documented: int = 1
        forgotten: int = 2

    with pytest.raises(ValueError, match="forgotten"):
        flag_specs(Partial)


def test_environment_settings_reads_only_the_prefix():
    assert pagedserve_settings({"PAGEDSERVE_PORT": "1", "PORT": "2", "PAGEDSERVE_": "3"}) == {"port": "1"}


def test_out_of_range_config_is_rejected():
    with pytest.raises(ValueError, match="http2_max_ping_strikes"):
        ServerConfig(http2_max_ping_strikes=-1)
    with pytest.raises(ValueError, match="metrics_port"):
        ServerConfig(port=9000, metrics_port=9000)
    with pytest.raises(ValueError, match="http_port"):
        ServerConfig(port=9000, http_port=9000)
    with pytest.raises(ValueError, match="seed"):
        EngineConfig(seed=-1)


def test_grpc_option_names_are_grpc_core_names():
    """Each option key occurs in gRPC core's compiled library (a misspelt key would be ignored silently)."""
    options = dict(ServerConfig().grpc_options())
    assert {"grpc.keepalive_time_ms", "grpc.http2.max_pings_without_data", "grpc.keepalive_permit_without_calls",
            "grpc.http2.min_ping_interval_without_data_ms", "grpc.max_send_message_length",
            "grpc.max_receive_message_length"} <= set(options)
    core = next(pathlib.Path(grpc.__file__).parent.joinpath("_cython").glob("cygrpc*.so")).read_bytes()
    missing = [key for key in options if key.encode() + b"\0" not in core]
    assert not missing, missing
