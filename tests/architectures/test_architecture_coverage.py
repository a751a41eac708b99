"""Which transformers architectures hf_alibi covers, checked against transformers itself.

No silent claims of "all": ``python tests/architectures/test_architecture_coverage.py`` prints every model
type whose modeling file builds a ``rotary_emb`` on its model and has no row, so the uncovered set is known
(the tests do not print it into every CI log).
"""

import importlib
import pkgutil
import re
from pathlib import Path

import transformers
from arch_cases import CASES, NATIVE_CASES
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import hf_alibi
import hf_alibi.patches

MODELS = Path(transformers.__file__).parent / "models"


def rotary_model_types() -> dict[str, Path]:
    """model_type -> modeling file, for every type whose modeling file assigns ``self.rotary_emb``."""
    found = {}
    for model_type in CONFIG_MAPPING_NAMES:
        module = transformers.models.auto.configuration_auto.model_type_to_module_name(model_type)
        path = MODELS / module / f"modeling_{module}.py"
        if path.is_file() and re.search(r"^\s+self\.rotary_emb = ", path.read_text(), re.MULTILINE):
            found[model_type] = path
    return found


def test_every_rotary_row_is_a_rotary_model_of_transformers():
    rotary = rotary_model_types()
    rows = {t: row for t, row in hf_alibi.ARCHITECTURES.items() if row.strategy == "rotary"}
    assert len(rows) >= 15
    assert set(rows) <= set(rotary), sorted(set(rows) - set(rotary))


def test_patches_the_registry_and_the_test_cases_list_the_same_architectures():
    modules = {info.name: importlib.import_module(f"hf_alibi.patches.{info.name}")
               for info in pkgutil.iter_modules(hf_alibi.patches.__path__)}  # fmt: skip
    assert sorted(modules) == ["absolute", "native", "relative", "rotary"]
    rows = [row for name, module in modules.items() if name != "native" for row in module.ROWS]
    types = sorted(row.model_type for row in rows)
    assert len(types) == len(set(types)), types  # no type in two rows
    assert types == hf_alibi.supported_model_types() == sorted({case.model_type for case in CASES})
    for name, module in modules.items():  # one file per strategy
        assert {row.strategy for row in module.ROWS} == {name}
    for row in rows:
        assert hf_alibi.get_architecture(row.model_type) is row
    # the models trained with ALiBi: run as they are (hf_alibi.native), their own table of cases
    native = sorted(row.model_type for row in modules["native"].ROWS)
    assert native == hf_alibi.native_model_types() == sorted({case.model_type for case in NATIVE_CASES})
    assert not set(native) & set(types)
    for row in modules["native"].ROWS:
        assert hf_alibi.get_native_architecture(row.model_type) is row


if __name__ == "__main__":
    rotary = rotary_model_types()
    uncovered = sorted(set(rotary) - set(hf_alibi.supported_model_types()))
    print(
        f"hf_alibi covers {len(set(rotary) & set(hf_alibi.supported_model_types()))} of the {len(rotary)} "
        f"transformers model types with a rotary_emb; not covered ({len(uncovered)}): {', '.join(uncovered)}"
    )
