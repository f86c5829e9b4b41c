"""`pagedserve fleet`'s own parts that need no process: its --help (each default shown once, none as "None") and
its log directory (a temporary default is removed at exit, a given one is kept)."""
from __future__ import annotations

import re

from pagedserve import cli
from pagedserve.fleet.launcher import _drop_logs
from pagedserve.fleet.local import Fleet


def _help() -> str:
    sub = next(a for a in cli.build_parser({})._actions if a.dest == "command")
    return sub.choices["fleet"].format_help()


def test_help_shows_each_default_once_and_no_none():
    text = " ".join(_help().split())  # argparse wraps lines
    assert "(default: None)" not in text
    assert text.count("(default: a new temporary directory") == 1
    assert text.count("(default:") == 7, text  # one per option
    assert re.search(r"--router-port ROUTER_PORT [^-]*\(default: 8080\)", text), text


def test_a_temporary_log_dir_is_removed_at_exit_a_given_one_kept(tmp_path, capsys):
    temporary = Fleet(1)
    assert temporary.temporary_log_dir and temporary.log_dir.is_dir()
    (temporary.log_dir / "replica-0.log").write_text("log")
    _drop_logs(temporary, 0)
    assert not temporary.log_dir.exists() and f"removed {temporary.log_dir}" in capsys.readouterr().out
    given = Fleet(1, log_dir=tmp_path)
    _drop_logs(given, 0)
    assert not given.temporary_log_dir and tmp_path.is_dir()


def test_a_temporary_log_dir_is_kept_when_a_process_failed(capsys):
    fleet = Fleet(1)
    try:
        _drop_logs(fleet, 1)
        assert fleet.log_dir.is_dir() and f"logs kept in {fleet.log_dir}" in capsys.readouterr().err
    finally:
        fleet.remove_temporary_logs()


def test_the_context_manager_removes_a_temporary_log_dir():
    with Fleet(1) as fleet:
        assert fleet.log_dir.is_dir()
    assert not fleet.log_dir.exists()
