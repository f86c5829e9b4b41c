"""Every `pagedserve serve` flag is also read from a PAGEDSERVE_ environment variable (the command line wins), and
the server's keepalive and message-size settings reach gRPC under gRPC core's own option names."""
from __future__ import annotations

import pathlib

import grpc
import pytest

from pagedserve import cli
from pagedserve.config import ServerConfig, environment_settings


def _serve_actions():
    parser = cli.build_parser({})
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return [a for a in serve._actions if a.dest != "help"]


def _env_text(action) -> str:
    """An environment value different from the flag's default, for every kind of flag."""
    if action.nargs == 0:
        return "false" if action.default else "true"
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    if action.type is int:
        return str((action.default or 0) + 7)
    if action.type is float:
        return str((action.default or 0.0) + 1.5)
    return "somewhere"


def test_every_flag_is_read_from_its_environment_variable():
    actions = _serve_actions()
    assert len(actions) >= 30
    environ = {f"PAGEDSERVE_{a.dest.upper()}": _env_text(a) for a in actions}
    args = cli.build_parser(environ).parse_args(["serve"])
    for action in actions:
        expected = cli._env_value(action, environ[f"PAGEDSERVE_{action.dest.upper()}"])
        assert getattr(args, action.dest) == expected != action.default, action.dest


def test_command_line_wins_and_values_reach_the_configs():
    environ = {"PAGEDSERVE_PORT": "6000", "PAGEDSERVE_MAX_NUM_SEQS": "8", "PAGEDSERVE_ENABLE_PREFIX_CACHING": "off",
               "PAGEDSERVE_KEEPALIVE_PERMIT_WITHOUT_CALLS": "no", "PAGEDSERVE_METRICS_PORT": "9464",
               "PAGEDSERVE_SHUTDOWN_GRACE": "2.5", "PAGEDSERVE_TARGET": "for-the-client:1"}
    args = cli.build_parser(environ).parse_args(["serve", "--port", "7000"])
    server, engine = cli.configs_from_args(args)
    assert server.port == 7000 and server.metrics_port == 9464 and server.shutdown_grace_s == 2.5
    assert server.keepalive_permit_without_calls is False
    assert engine.max_num_seqs == 8 and engine.enable_prefix_caching is False


@pytest.mark.parametrize("name,value,needle", [
    ("PAGEDSERVE_PORT", "eighty", "PAGEDSERVE_PORT"),
    ("PAGEDSERVE_DTYPE", "float64", "PAGEDSERVE_DTYPE"),
    ("PAGEDSERVE_NO_EMBEDDING_MODEL", "maybe", "PAGEDSERVE_NO_EMBEDDING_MODEL"),
])
def test_bad_environment_value_exits_2_naming_the_variable(name, value, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser({name: value})
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_unknown_variable_is_warned_about(capsys):
    cli.build_parser({"PAGEDSERVE_MAX_NUM_SEQ": "4"})
    assert "PAGEDSERVE_MAX_NUM_SEQ" in capsys.readouterr().err


def test_environment_settings_reads_only_the_prefix():
    assert environment_settings({"PAGEDSERVE_PORT": "1", "PORT": "2", "PAGEDSERVE_": "3"}) == {"port": "1"}


def test_out_of_range_config_is_rejected():
    with pytest.raises(ValueError, match="http2_max_ping_strikes"):
        ServerConfig(http2_max_ping_strikes=-1)
    with pytest.raises(ValueError, match="metrics_port"):
        ServerConfig(port=9000, metrics_port=9000)


def test_grpc_option_names_are_grpc_core_names():
    """Each option key occurs in gRPC core's compiled library (a misspelt key would be ignored silently)."""
    options = dict(ServerConfig().grpc_options())
    assert {"grpc.keepalive_time_ms", "grpc.http2.max_pings_without_data", "grpc.keepalive_permit_without_calls",
            "grpc.http2.min_ping_interval_without_data_ms", "grpc.max_send_message_length",
            "grpc.max_receive_message_length"} <= set(options)
    core = next(pathlib.Path(grpc.__file__).parent.joinpath("_cython").glob("cygrpc*.so")).read_bytes()
    missing = [key for key in options if key.encode() + b"\0" not in core]
    assert not missing, missing
