"""The README's table of supported architectures lists exactly the registry's names, and every one of them has a
checkpoint case in tests/family_cases.py (so test_families.py checks it against transformers)."""
from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def readme_architectures() -> list[str]:
    text = README.read_text()
    section = text.split("## Model families", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+ForCausalLM)` \|", section, flags=re.M)


def test_readme_table_matches_registry():
    from pagedserve.models.registry import MODEL_REGISTRY

    listed = readme_architectures()
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(MODEL_REGISTRY)


def test_every_registered_architecture_has_an_oracle_case():
    from family_cases import FAMILIES
    from pagedserve.models.registry import MODEL_REGISTRY

    assert {arch for _, _, arch in FAMILIES.values()} == set(MODEL_REGISTRY)
