"""Detection of chat templates that never render ``tools`` (the start-up warning under --enable-auto-tool-choice)."""
from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from pagedserve.serving.factory import warn_if_template_ignores_tools
from pagedserve.serving.prompts import template_renders_tools

PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
WITH_TOOLS = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}" + PLAIN)
# "tools" only as text, or as a loop variable of its own: neither reads the request's tools
TEXT_ONLY = "You have no tools. " + PLAIN
LOCAL = "{% set tools = [] %}{% for t in tools %}{{ t }}{% endfor %}" + PLAIN


@pytest.mark.parametrize("template,expected", [
    (PLAIN, False), (WITH_TOOLS, True), (TEXT_ONLY, False), (LOCAL, False), (None, False), ("", False),
    ({"default": PLAIN, "tool_use": WITH_TOOLS}, True), ({"default": PLAIN}, False),
    ("{% if tools %}unclosed", True),  # does not parse: read as text
    # loop controls parse (HF's renderer has them), so "tools" as text is not taken for the variable
    ("{% for t in tools %}{{ t }}{% break %}{% endfor %}", True),
    ("{% for m in messages %}{% break %}{% endfor %} no tools", False),
])
def test_template_renders_tools(template, expected):
    assert template_renders_tools(template) is expected


def test_warning_names_the_chat_template_flag():
    with capture_logs() as logs:
        assert warn_if_template_ignores_tools(PLAIN)
        assert not warn_if_template_ignores_tools(WITH_TOOLS)
    assert len(logs) == 1 and logs[0]["log_level"] == "warning"
    assert logs[0]["event"] == "chat_template_ignores_tools" and "--chat-template" in logs[0]["hint"]
