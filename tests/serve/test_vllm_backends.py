"""vLLM runs a converted model (and its own BLOOM / Falcon-RW) only on an attention backend that applies the slopes
(hf_alibi/serve/vllm/internals.py), checked without vLLM: the config hook's pin on stand-ins of vLLM's config and CUDA
selector with the orders of 0.32 and 0.33 as read (tests/vllm_standin.py), the refusals' lines, the per-layer check
and the version line. The vLLM tier (tests/serve/test_vllm_config.py) checks the recorded orders against the installed
vLLM and the same hook in vLLM's own config; the `gpu` test there runs it on a GPU."""

import pytest
import torch
from vllm_standin import Backend, attention_config, bias_applied, flash_attn_versions, select

from hf_alibi.serve.vllm.internals import (
    APPLIES_SLOPES,
    CUDA_ORDER,
    layer_backends,
    layer_refusal,
    pin_backend,
    platform_name,
    version_warning,
)

ORDERS = [(version, sm) for version in ("0.32", "0.33") for sm in ("sm100", "sm90")]


@pytest.mark.parametrize("version, sm", ORDERS)
def test_with_no_backend_named_every_cuda_order_runs_one_that_applies_the_slopes(version, sm):
    order = CUDA_ORDER[version][sm]
    # the danger, as read: left to vLLM, a B200 runs FLASHINFER (slopes dropped), an H100 FLASH_ATTN planned for FA3
    unpinned = attention_config()
    assert select(unpinned, order) == {"sm100": "FLASHINFER", "sm90": "FLASH_ATTN"}[sm]
    assert not bias_applied(select(unpinned, order), unpinned, sm)
    config = attention_config()
    assert pin_backend(config, "cuda", Backend) == "TRITON_ATTN"
    assert select(config, order) == "TRITON_ATTN" and bias_applied("TRITON_ATTN", config, sm)
    assert select(config, order, kind="sliding_window") == "TRITON_ATTN"  # Mistral's windowed layers too


@pytest.mark.parametrize("sm", ["sm90", "sm100"])
def test_flash_attn_named_runs_fa2_in_the_layer_and_the_batch_plan_alike(sm):
    config = attention_config("FLASH_ATTN")
    assert flash_attn_versions(config, sm) == (2, {"sm90": 3, "sm100": 4}[sm])  # what vLLM would do: mismatched
    assert pin_backend(config, "cuda", Backend) == "FLASH_ATTN"
    assert config.attention_config.flash_attn_version == 2
    assert flash_attn_versions(config, sm) == (2, 2)
    assert bias_applied(select(config, CUDA_ORDER["0.33"][sm]), config, sm)
    with pytest.raises(ValueError) as refused:
        pin_backend(attention_config("FLASH_ATTN", flash_attn_version=3), "cuda", Backend)
    assert str(refused.value) == (
        "hf_alibi: FLASH_ATTN with flash_attn_version=3 has no ALiBi (only FlashAttention 2 applies the slopes): "
        "leave flash_attn_version unset or 2, or run TRITON_ATTN."
    )


def test_a_named_backend_that_drops_the_slopes_is_refused_in_one_line_that_says_what_runs():
    lines = {}
    for name in ("FLASHINFER", "FLEX_ATTENTION", "TURBOQUANT"):
        config = attention_config(name)
        with pytest.raises(ValueError) as refused:
            pin_backend(config, "cuda", Backend)
        lines[name] = str(refused.value)
        assert config.attention_config.backend == Backend[name]  # nothing changed
    assert lines["FLASHINFER"] == (
        "hf_alibi: attention backend FLASHINFER stores the slopes and never applies them, so an ALiBi model would run "
        "without its bias: on cuda run --attention-backend TRITON_ATTN (or FLASH_ATTN), or name none and hf_alibi's "
        "plugin pins TRITON_ATTN."
    )
    assert "FLEX_ATTENTION raises on ALiBi slopes" in lines["FLEX_ATTENTION"]
    assert "TURBOQUANT drops the slopes" in lines["TURBOQUANT"]
    with pytest.raises(ValueError, match=r"^hf_alibi: backend_per_kind\['sliding_window'\] FLASHINFER stores"):
        pin_backend(attention_config(per_kind={"sliding_window": "FLASHINFER"}), "cuda", Backend)
    # a per-kind override that applies the slopes is kept, and the rest pinned
    config = attention_config(per_kind={"sliding_window": "FLASH_ATTN"})
    assert pin_backend(config, "cuda", Backend) == "TRITON_ATTN"
    assert select(config, CUDA_ORDER["0.33"]["sm100"], kind="sliding_window") == "FLASH_ATTN"
    assert config.attention_config.flash_attn_version == 2
    assert all("\n" not in line for line in lines.values())


def test_each_platform_pins_its_own_backend_and_an_unknown_platform_is_refused():
    pinned = {}
    for platform in ("cuda", "rocm", "xpu", "cpu"):
        config = attention_config()
        pinned[platform] = pin_backend(config, platform, Backend)
        assert config.attention_config.backend == Backend[pinned[platform]]
    assert pinned == {"cuda": "TRITON_ATTN", "rocm": "TRITON_ATTN", "xpu": "TRITON_ATTN", "cpu": "CPU_ATTN"}
    assert pin_backend(attention_config("ROCM_ATTN"), "rocm", Backend) == "ROCM_ATTN"
    with pytest.raises(ValueError, match="ROCM_AITER_FA skips the slopes on some of its paths"):
        pin_backend(attention_config("ROCM_AITER_FA"), "rocm", Backend)
    with pytest.raises(ValueError, match="^hf_alibi: vLLM's tpu platform has no attention backend known to apply"):
        pin_backend(attention_config(), "tpu", Backend)
    assert set(APPLIES_SLOPES) == set(pinned)


def test_platform_name_reads_vllms_predicates():
    def platform(kind, device_type="x"):
        predicates = {f"is_{n}": (lambda n=n: n == kind) for n in ("cuda", "rocm", "xpu", "cpu")}
        methods = {k: staticmethod(v) for k, v in predicates.items()}
        return type("Platform", (), {**methods, "device_type": device_type})

    assert [platform_name(platform(k)) for k in ("cuda", "rocm", "xpu", "cpu")] == ["cuda", "rocm", "xpu", "cpu"]
    assert platform_name(platform(None, "tpu")) == "tpu"


class _Impl:
    def __init__(self, slopes):
        self.alibi_slopes = torch.tensor(slopes)  # FlashInfer keeps them too: no proof of anything


class _StandInAttention(torch.nn.Module):
    def __init__(self, backend: str):
        super().__init__()
        self.attn_backend = type(backend, (), {"get_name": staticmethod(lambda: backend)})
        self.impl = _Impl([0.5, 0.25])


def _model(*backends: str) -> torch.nn.Module:
    layers = torch.nn.ModuleList()
    for backend in backends:
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.attn = _StandInAttention(backend)
        layers.append(layer)
    return torch.nn.ModuleDict({"layers": layers})


def test_each_built_layer_is_checked_by_the_backend_it_runs_not_by_its_stored_slopes():
    good = _model("TRITON_ATTN", "TRITON_ATTN")
    assert layer_backends(good, _StandInAttention) == {
        "layers.0.self_attn.attn": "TRITON_ATTN",
        "layers.1.self_attn.attn": "TRITON_ATTN",
    }
    assert layer_refusal(layer_backends(good, _StandInAttention), "cuda") is None
    mixed = _model("TRITON_ATTN", "FLASHINFER")
    assert all(m.impl.alibi_slopes is not None for m in mixed.modules() if isinstance(m, _StandInAttention))
    assert layer_refusal(layer_backends(mixed, _StandInAttention), "cuda") == (
        "hf_alibi: layer layers.1.self_attn.attn was built on attention backend FLASHINFER, which stores the "
        "slopes and never applies them on cuda: refused before any request; run --attention-backend TRITON_ATTN or "
        "FLASH_ATTN."
    )
    assert layer_refusal({"a": "TRITON_ATTN"}, "cpu") is not None  # the CPU runs CPU_ATTN only


def test_the_version_line_is_said_outside_the_versions_read_only():
    assert [version_warning(v) for v in ("0.32.0", "0.32.3", "0.33.0", "0.33.1rc1")] == [None] * 4
    for version in ("0.31.2", "0.34.0", "1.0.0", "dev"):
        line = version_warning(version)
        assert line.startswith(f"hf_alibi: vLLM {version} is outside the versions hf_alibi read") and "\n" not in line


def test_every_vllm_name_the_plugin_imports_is_in_the_internals_table():
    import ast
    from pathlib import Path

    from hf_alibi.serve.vllm.internals import IMPORTED

    root = Path(__file__).resolve().parents[2]
    imported = set()
    folders = [root / "hf_alibi" / "serve" / "vllm", root / "hf_alibi_boot" / "vllm"]
    assert all((folder / "__init__.py").is_file() for folder in folders)
    for path in [path for folder in folders for path in folder.glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                imported |= {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {(alias.name, "__version__") for alias in node.names if alias.name == "vllm"}
    assert imported == {(module, name) for module, names in IMPORTED.items() for name in names}
