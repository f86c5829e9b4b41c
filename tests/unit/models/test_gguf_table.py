"""The README's "GGUF files" table lists exactly the loader's GGUF architectures, each with the family that runs
it, and every one of them has a file case in tests/gguf_cases.py (so test_gguf_families.py checks it)."""
from __future__ import annotations

import re

from .test_families_table import README


def readme_gguf_rows() -> dict[str, str]:
    section = README.read_text().split("## Model families", 1)[1].split("\n## ", 1)[0]
    table = section.split("| GGUF `general.architecture` |", 1)[1]
    return dict(re.findall(r"^\| `(\w+)` \| `(\w+ForCausalLM)` \|", table, flags=re.M))


def test_readme_gguf_table_matches_the_loader():
    from pagedserve.models.gguf_arch import GGUF_ARCHITECTURES
    from pagedserve.models.registry import MODEL_REGISTRY

    rows = readme_gguf_rows()
    assert rows == {name: arch.hf_architecture for name, arch in GGUF_ARCHITECTURES.items()}
    assert set(rows.values()) <= set(MODEL_REGISTRY)


def test_every_gguf_architecture_has_a_file_case():
    from gguf_cases import CASES
    from pagedserve.models.gguf_arch import GGUF_ARCHITECTURES

    assert {arch for arch, *_ in CASES.values()} == set(GGUF_ARCHITECTURES)
