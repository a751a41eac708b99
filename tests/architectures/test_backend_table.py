"""The backend table in docs/attention.md says, per backend, which model types transformers allows it for: it
must match the ``_supports_*`` flags of every registered architecture's classes, and a converted model set to
a backend its class refuses must fail clearly and stay usable."""

import inspect
import re

import pytest
import torch
import transformers
from arch_cases import CASES
from packaging import version
from sharing import REPO_ROOT, output_tensor
from transformers import PreTrainedModel

import hf_alibi
from hf_alibi.convert.registry import alibi_classes
from hf_alibi.core.kernels import KERNELS, RUNNING_BACKENDS

# transformers' flag per backend of the kernel table that runs (its row's ``flag``; None: every model takes it)
FLAGS = {kernel.name: kernel.flag for kernel in KERNELS if kernel.runs}


def transformers_flag(backend: str) -> str | None:
    """The ``_supports_*`` flag transformers itself checks before a model takes ``backend``, read from its source:
    ``PreTrainedModel.get_correct_attn_implementation`` sends a ``flash_attention_<n>`` name to
    ``_flash_attn_can_dispatch``, a flex one to ``_flex_attn_can_dispatch``, an sdpa one to ``_sdpa_can_dispatch``,
    and checks no flag for eager or a name registered by a library (transformers 5.19 and 5.24)."""
    source = inspect.getsource(PreTrainedModel.get_correct_attn_implementation)
    if re.fullmatch(r"flash_attention_\d", backend):
        check = "_flash_attn_can_dispatch"
    elif "flex_attention" in backend:
        check = "_flex_attn_can_dispatch"
    elif "sdpa" in backend:
        check = "_sdpa_can_dispatch"
    else:
        return None
    assert check in source, f"transformers no longer sends {backend} to {check}"
    flags = set(re.findall(r"self\.(_supports_\w+)", inspect.getsource(getattr(PreTrainedModel, check))))
    assert len(flags) == 1, (backend, flags)
    return flags.pop()


def test_the_kernel_tables_flags_are_the_ones_transformers_checks():
    for kernel in KERNELS:
        assert kernel.flag == transformers_flag(kernel.name), kernel.name


def documented_table() -> dict[str, tuple[set[str], set[str]]]:
    """backend -> (model types listed as allowed, model types listed after 'not'), from docs/attention.md."""
    text = (REPO_ROOT / "docs" / "attention.md").read_text()
    start = text.index("| `attn_implementation` | how the bias is applied |")
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    table: dict[str, tuple[set[str], set[str]]] = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        backend = re.match(r"`([a-z_0-9]+)`", cells[0]).group(1)
        allowed, _, refused = cells[-1].partition(";")
        refused_types = {t.strip() for t in refused.replace("not", "").split(",")} - {""}
        if allowed.strip() == "every supported type":
            allowed_types = set(hf_alibi.supported_model_types()) - refused_types
        else:
            allowed_types = {t.strip() for t in allowed.split(",")}
        entry = (allowed_types, refused_types)
        assert table.setdefault(backend, entry) == entry, f"the rows of {backend} disagree"
        table[backend] = entry
    return table


def allowed_by_flags(model_type: str, backend: str) -> bool:
    classes = list(alibi_classes(model_type).values())
    flag = FLAGS[backend]
    values = {True if flag is None else bool(getattr(cls, flag)) for cls in classes}
    assert len(values) == 1, f"{model_type}: its classes disagree on {flag}"
    return values.pop()


def test_documented_backend_table_matches_transformers_flags():
    table = documented_table()
    assert sorted(table) == sorted(FLAGS) == sorted(RUNNING_BACKENDS)
    types = set(hf_alibi.supported_model_types())
    for backend, (allowed, refused) in table.items():
        assert allowed | refused == types and not allowed & refused, (backend, allowed, refused)
        expected = {t for t in types if allowed_by_flags(t, backend)}
        assert allowed == expected, f"docs/attention.md: {backend} for {sorted(allowed)}, flags: {sorted(expected)}"


@pytest.mark.parametrize("case", [c for c in CASES if c.name == c.model_type], ids=lambda c: c.name)
def test_documented_table_matches_what_plain_transformers_does(case):
    """Not the flags: the unpatched model itself, asked for each backend the docs list it under (the table is
    transformers 5.24's; docs/attention.md names what 5.19 accepts beside it)."""
    allowed_or_refused = {backend: case.model_type in allowed for backend, (allowed, _) in documented_table().items()}
    if version.parse(transformers.__version__) < version.parse("5.24") and case.model_type == "gemma2":
        allowed_or_refused["sdpa"] = True  # 5.19's Gemma 2 takes sdpa (and drops its soft-cap there)
    for backend in FLAGS:
        model = case.make()
        if allowed_or_refused[backend]:
            if backend.startswith("flash_attention"):
                continue  # accepted or not, it needs the flash-attn package and CUDA to be set
            model.set_attn_implementation(backend)
            assert model.config._attn_implementation == backend
        else:
            with pytest.raises(ValueError, match="does not support"):
                model.set_attn_implementation(backend)


REFUSED = [
    (case, backend)
    for case in CASES
    for backend in FLAGS
    if not allowed_by_flags(case.model_type, backend) and case.name == case.model_type
]


@pytest.mark.parametrize("case, backend", REFUSED, ids=[f"{c.name}-{b}" for c, b in REFUSED])
def test_a_refused_backend_is_a_clear_error_and_the_model_stays_as_it_was(case, backend):
    model = hf_alibi.patch_model(case.make(), encoder_variant=None if not case.bidirectional else "symmetric")
    inputs = case.inputs(2, 24)
    backend_before = model.config._attn_implementation
    assert backend_before.startswith("alibi_")
    with torch.no_grad():
        before = output_tensor(model(**inputs))
    with pytest.raises(ValueError, match="does not support"):
        model.set_attn_implementation(backend)
    assert model.config._attn_implementation == backend_before
    with torch.no_grad():
        assert torch.equal(output_tensor(model(**inputs)), before)
