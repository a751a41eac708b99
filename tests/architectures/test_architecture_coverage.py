"""Which transformers architectures hf_alibi covers, checked against transformers itself.

No silent claims of "all": every model type whose modeling file builds a ``rotary_emb`` on its model
and has no row is printed, so the uncovered set is known.
"""

import re
from pathlib import Path

import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import hf_alibi

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


def test_uncovered_rotary_models_are_listed(capsys):
    rotary = rotary_model_types()
    uncovered = sorted(set(rotary) - set(hf_alibi.supported_model_types()))
    with capsys.disabled():
        print(
            f"\nhf_alibi covers {len(set(rotary) & set(hf_alibi.supported_model_types()))} of the {len(rotary)} "
            f"transformers model types with a rotary_emb; not covered ({len(uncovered)}): {', '.join(uncovered)}"
        )
    assert all(t in CONFIG_MAPPING_NAMES for t in uncovered)
