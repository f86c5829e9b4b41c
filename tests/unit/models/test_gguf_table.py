"""The README's "GGUF files" table lists exactly the loader's GGUF architectures, each with the family that runs
it (and the family its files with experts run as), and every one of them has a file case in tests/gguf_cases.py (so test_gguf_families.py checks it)."""
from __future__ import annotations

import re

from .test_families_table import README


def _table() -> str:
    section = README.read_text().split("## Model families", 1)[1].split("\n## ", 1)[0]
    return section.split("| GGUF `general.architecture` |", 1)[1].split("\n\n", 1)[0]


def readme_gguf_rows() -> dict[str, str]:
    """``general.architecture`` -> the family of its row (the rows of files with experts apart)."""
    return dict(re.findall(r"^\| `(\w+)` \| `(\w+ForCausalLM)` \|", _table(), flags=re.M))


def readme_moe_rows() -> dict[str, str]:
    return dict(re.findall(r"^\| `(\w+)` with `\w+\.expert_count` > 0 \| `(\w+ForCausalLM)` \|", _table(),
                           flags=re.M))


def test_readme_gguf_table_matches_the_loader():
    from pagedserve.models.gguf_arch import GGUF_ARCHITECTURES
    from pagedserve.models.registry import MODEL_REGISTRY

    from pagedserve.models.gguf_arch import GGUF_MOE_VARIANTS

    rows, moe = readme_gguf_rows(), readme_moe_rows()
    assert rows == {name: arch.hf_architecture for name, arch in GGUF_ARCHITECTURES.items()}
    assert moe == {name: arch.hf_architecture for name, arch in GGUF_MOE_VARIANTS.items()}
    assert set(rows.values()) | set(moe.values()) <= set(MODEL_REGISTRY)


def test_every_gguf_architecture_has_a_file_case():
    from family_cases import FAMILIES
    from gguf_cases import CASES
    from pagedserve.models.gguf_arch import GGUF_ARCHITECTURES, GGUF_MOE_VARIANTS

    assert {arch for arch, *_ in CASES.values()} == set(GGUF_ARCHITECTURES)
    runs_as = {(arch, FAMILIES[family][2]) for arch, family, *_ in CASES.values()}
    for table in (GGUF_ARCHITECTURES, GGUF_MOE_VARIANTS):
        assert {(name, spec.hf_architecture) for name, spec in table.items()} <= runs_as
