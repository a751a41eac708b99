"""The kernel table (hf_alibi/core/kernels.py) is the one place a kernel's abilities are written: registration, the
config's accepted names, the refusals (a kernel's, a native model's set_attn_implementation, continuous batching's)
and the docs read it. And the bias as one value (slopes.BiasSpec): the one key under which merged masks are shared."""

import ast
import math

import pytest
import torch
from reference import fairseq_slopes
from torch import nn
from transformers.dynamic_module_utils import get_relative_imports
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_alibi.core import dispatch, kernels, names
from hf_alibi.core.batching import check_continuous_batching
from hf_alibi.core.bias import AlibiBias
from hf_alibi.core.forward import AlibiForward
from hf_alibi.core.kernels import (
    KERNEL_BY_NAME,
    KERNELS,
    PAGED_BACKENDS,
    REFUSED_BACKENDS,
    RUNNING_BACKENDS,
    Kernel,
    check_backend,
    kernel,
    paged_refusal,
    refusal,
)
from hf_alibi.core.slopes import BiasSpec, KeyRounding

H, D = 4, 8


def test_registration_follows_the_rows():
    for row in KERNELS:
        registered = ALL_ATTENTION_FUNCTIONS[f"alibi_{row.name}"]
        if row.runs:
            assert dispatch.FUNCTIONS[row.name].__name__ == row.function
        else:
            with pytest.raises(NotImplementedError, match=f"no ALiBi path for attn_implementation='{row.name}'"):
                registered(None, None, None, None, None)
    assert names.RUNNING_BACKENDS == RUNNING_BACKENDS == tuple(row.name for row in KERNELS if row.runs)
    assert REFUSED_BACKENDS == tuple(row.name for row in KERNELS if not row.runs)
    # continuous batching's bias: on the merged-mask kernels (tests/core/test_batching.py runs each)
    assert PAGED_BACKENDS == ("eager", "sdpa")


def test_the_copiers_lines_name_exactly_the_rows_files_and_functions():
    """kernels.py's block that never runs names each row's file for transformers' remote-code copier (which reads
    relative-import lines off the text): a row without its line would run here and be missing from every saved
    checkpoint; a stale line would copy a file nothing binds. dispatch.py imports what the rows name, nothing else."""
    running = [row for row in KERNELS if row.runs]
    assert set(get_relative_imports(kernels.__file__)) == {row.module for row in running}  # what the copier sees
    blocks = [node for node in ast.parse(open(kernels.__file__).read()).body if isinstance(node, ast.If)]
    assert len(blocks) == 1 and isinstance(blocks[0].test, ast.Constant) and blocks[0].test.value is False
    named = {(node.module, alias.name) for node in blocks[0].body for alias in node.names}
    assert named == {(row.module, row.function) for row in running}
    for row in running:
        function = dispatch.FUNCTIONS[row.name]
        assert (function.__module__, function.__name__) == (f"hf_alibi.core.{row.module}", row.function)
    assert not {row.module for row in running} & set(get_relative_imports(dispatch.__file__))
    with pytest.raises(ValueError, match="give its function and its module, or neither"):
        Kernel("new_kernel", "new_alibi_attention")


def test_the_names_resolve_with_either_prefix_and_others_are_refused_in_one_line():
    assert (
        kernel("alibi_remote_flash_attention_4") is kernel("flash_attention_4") is KERNEL_BY_NAME["flash_attention_4"]
    )
    for row in KERNELS:
        check_backend(f"alibi_{row.name}")
    with pytest.raises(ValueError, match="attn_implementation='vllm': hf_alibi has no ALiBi path") as refused:
        check_backend("vllm")
    assert "\n" not in str(refused.value)


def test_a_refusal_names_what_renders_the_feature_instead():
    flash = KERNEL_BY_NAME["flash_attention_2"]
    assert refusal(flash, "causal") is None and refusal(flash, "symmetric") is None
    sinks = refusal(flash, "causal", sinks=2)
    # every running kernel whose row renders sinks is offered, and no other
    assert sinks.endswith("use model.set_attn_implementation('sdpa') (or 'eager', 'flex_attention') for this model.")
    assert "flash_attention_4" not in sinks
    assert "bfloat16" in refusal(KERNEL_BY_NAME["flash_attention_4"], "causal", rounding=KeyRounding("bfloat16"))
    # fitted or per-layer slopes: only cuDNN's row applies the paper's alone; every other running kernel is offered
    fitted = refusal(KERNEL_BY_NAME["cudnn"], "causal", paper_slopes=False)
    assert fitted.endswith("(or 'eager', 'flex_attention', 'flash_attention_2', 'flash_attention_4') for this model.")
    assert all(refusal(k, "causal", paper_slopes=False) is None for k in KERNELS if k.name != "cudnn")
    assert all(
        refusal(KERNEL_BY_NAME[n], k) is None for n in ("eager", "sdpa", "flex_attention") for k in names.BIAS_KINDS
    )


def test_continuous_batching_runs_the_paged_rows_and_refuses_the_rest():
    class Model:
        class config:  # noqa: N801  (a config-like namespace)
            is_encoder_decoder = False
            _attn_implementation = "alibi_flex_attention"
            _attn_implementation_internal = "alibi_flex_attention"

    with pytest.raises(ValueError, match="for attn_implementation 'eager' and 'sdpa', not 'flex_attention'"):
        check_continuous_batching(Model)
    assert paged_refusal("alibi_sdpa") is None and paged_refusal("eager") is None


# ---------------------------------------------------------------------------------------------------------------
# the bias as one value


class Layer(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.alibi = AlibiBias("causal", H, path="bias", **options)
        self.is_causal = True
        self.eval()


def reference(q, k, v, sinks):
    """softmax(q k^T / sqrt(D) - m (i - j)) v in float64, causal, the first ``sinks`` keys without bias."""
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    m = torch.tensor(fairseq_slopes(H), dtype=torch.float64)[:, None, None]
    bias = (-m * (i - j)).masked_fill((j < sinks).expand(n, n), 0.0).masked_fill(j > i, -math.inf)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) / math.sqrt(D) + bias
    return torch.einsum("bhqk,bhkd->bqhd", torch.softmax(scores, -1), v.double())


def test_layers_that_differ_in_sinks_do_not_share_a_merged_mask():
    """The merged mask of a forward is shared under the bias's one key (its BiasSpec and path): a layer with sinks
    after one without must build its own (the key once left sinks out: it got the other layer's mask)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, 40, D, generator=g) for _ in range(3))
    forward = AlibiForward(starts=torch.zeros(1, dtype=torch.long), end=40)
    plain, with_sinks = Layer(), Layer(sinks=3)
    for layer, sinks in ((plain, 0), (with_sinks, 3), (plain, 0)):
        out, _ = ALL_ATTENTION_FUNCTIONS["alibi_sdpa"](layer, q, k, v, None, scaling=D**-0.5, alibi_forward=forward)
        torch.testing.assert_close(out.double(), reference(q, k, v, sinks), rtol=0, atol=1e-5)
    assert forward.builds == 2


def test_the_spec_is_the_key_and_follows_every_change():
    layer = AlibiBias("causal", H)
    assert layer.sharing == (BiasSpec("causal", tuple(fairseq_slopes(H))), "auto")
    layer.rounding = KeyRounding("bfloat16")
    assert layer.sharing[0].rounding == KeyRounding("bfloat16")  # no stale key after a change
    layer.rounding = None
    layer.sinks = 2
    assert layer.sharing[0] == BiasSpec("causal", tuple(fairseq_slopes(H)), sinks=2)
    assert hash(layer.spec) == hash(BiasSpec("causal", tuple(fairseq_slopes(H)), 2))
    with pytest.raises(ValueError, match="rounded per key .* is causal and has no sinks"):
        BiasSpec("causal", (0.5,), sinks=1, rounding=KeyRounding("bfloat16"))
    with pytest.raises(ValueError, match="Unknown ALiBi bias kind 'diagonal'"):
        BiasSpec("diagonal", (0.5,))


def test_native_models_take_their_backends_from_the_table(monkeypatch):
    """A model trained with ALiBi runs on, offers and flags (transformers' ``_supports_*``) exactly the backends whose
    row renders its bias: Falcon-RW rounds each key's bias, which no flash kernel's row renders, so neither
    flash_attention_2 nor flash_attention_4 is offered to it, BLOOM and MPT get every running backend. Changing a row
    changes what a native model offers: nothing else writes a kernel's ability down."""
    from dataclasses import replace

    from transformers import FalconConfig, FalconForCausalLM

    from hf_alibi import native
    from patches.native import ROWS

    rows = {row.model_type: row for row in ROWS}
    running = [k.name for k in KERNELS if k.runs]
    assert native.rendering_backends(rows["bloom"]) == tuple(running)
    assert native.rendering_backends(rows["mpt"]) == tuple(running)
    assert native.rendering_backends(rows["falcon"]) == ("eager", "sdpa", "flex_attention")
    falcon = FalconForCausalLM(FalconConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=32,
                                            alibi=True, parallel_attn=False, bias=True, new_decoder_architecture=False,
                                            multi_query=False))  # fmt: skip
    import hf_alibi

    hf_alibi.patch_model(falcon)
    said = native.what_runs(falcon)
    assert "'flex_attention'" in said and "flash_attention" not in said
    assert type(falcon)._supports_flash_attn is False and type(falcon)._supports_sdpa is True
    with pytest.raises(ValueError, match="cannot round each key's bias"):
        falcon.set_attn_implementation("flash_attention_4")
    # a table in which FlashAttention-4 rounds per key: Falcon is offered it, with nothing else changed
    rounding_fa4 = tuple(replace(k, rounding=True) if k.name == "flash_attention_4" else k for k in KERNELS)
    monkeypatch.setattr(native.model, "KERNELS", rounding_fa4)
    assert "flash_attention_4" in native.rendering_backends(rows["falcon"])
    assert "'flash_attention_4'" in native.what_runs(falcon)


@pytest.mark.parametrize("heads, bias_max", [(12, 8), (6, 8), (8, 8), (8, 6), (12, 6)])
def test_a_native_models_listing_and_its_refusals_agree_with_the_table(heads, bias_max):
    """What a patched MPT lists (``native.rendering_backends`` of its row and bias, and ``what_runs``' message) and
    what its ``set_attn_implementation`` refuses are one answer, derived here from the kernel table and MPT's slopes
    written out (``2^(-h * bias_max / n2)``, odd positions first): a row that applies the paper's slopes only
    (cuDNN's) is listed and taken exactly where those equal fairseq's (bias_max 8: any head count, 12 heads to the
    last bit), and refused otherwise; every other running row is listed."""
    from transformers import MptConfig, MptForCausalLM

    import hf_alibi
    from hf_alibi import native
    from hf_alibi.native.model import model_bias

    n2 = 2 ** math.ceil(math.log2(heads))
    mpt = [2.0 ** (-h * bias_max / n2) for h in range(1, n2 + 1)]
    mpt = (mpt[1::2] + mpt[::2])[:heads] if n2 != heads else mpt
    paper = all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(mpt, fairseq_slopes(heads)))
    assert paper == (bias_max == 8)
    model = MptForCausalLM(MptConfig(d_model=8 * heads, n_heads=heads, n_layers=1, vocab_size=32, max_seq_len=16,
                                     attn_config={"alibi_bias_max": bias_max}))  # fmt: skip
    hf_alibi.patch_model(model)
    expected = tuple(k.name for k in KERNELS if k.runs and (k.slopes or paper))
    listed = native.rendering_backends(model._native_row, model_bias(model))
    assert listed == expected and ("cudnn" in listed) == paper
    said = native.what_runs(model)
    assert all(f"'{name}'" in said for name in listed)
    for k in KERNELS:
        if k.runs and k.name not in listed:
            assert f"'{k.name}'" not in said
            with pytest.raises(ValueError, match="paper's slopes only"):
                model.set_attn_implementation(k.name)
    for name in ("eager", "sdpa", *(["cudnn"] if paper else [])):  # listed, so taken (cudnn runs on a GPU only)
        model.set_attn_implementation(name)
        assert model.config._attn_implementation.endswith(name)
