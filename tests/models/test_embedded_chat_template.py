"""The embedded SmolLM2's chat template does not render ``tools`` (the README says so; with
--enable-auto-tool-choice the server warns at start-up)."""
from __future__ import annotations

from pagedserve.serving.prompts import template_renders_tools


def test_embedded_smollm2_template_does_not_render_tools(smollm_source):
    template = smollm_source.load_tokenizer().chat_template
    assert template and not template_renders_tools(template)
