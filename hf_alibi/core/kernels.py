"""The kernel table: each attention backend hf_alibi knows, and what its ALiBi path renders, written once.

A row is plain data, importing nothing (the command line's parser and the config code read it without torch):
transformers' backend name, the function that renders the bias and its file (``dispatch.py`` imports it by these
names where it registers ``alibi_<name>``), the mask transformers hands it, the bias forms and features it renders,
and the optional package it needs. Every check of a backend's abilities reads this table: what the config accepts
(:func:`check_backend`), what a kernel and a native model's ``set_attn_implementation`` refuse (:func:`refusal`),
what continuous batching runs (:func:`paged_refusal`), and the remote-code test's allowed optional imports.

Adding a kernel is its file, one row here and its line in the copier's block below the table (tests check that the
block and the rows agree), its tests, and its line in docs/attention.md's backend table (checked against the rows).
"""

from __future__ import annotations

from dataclasses import dataclass

# the mask transformers hands a kernel: the merged additive float mask (the bias inside), flex's BlockMask, or the
# 2D padding mask of flash kernels (None when nothing is padded)
MERGED, BLOCK, PADDING = "merged", "block", "padding"
# the bias forms (names.BIAS_KINDS, spelled here so that this module imports nothing; names.py checks they agree)
_ALL_FORMS = ("causal", "symmetric", "nonsymmetric", "learned")


@dataclass(frozen=True)
class Kernel:
    """One attention backend and what its ALiBi path renders.

    ``name``: transformers' ``attn_implementation``. ``function``: the ALiBi function's name, defined in ``module``,
    the kernel's file in this package (``"cudnn"``: ``cudnn.py``), where ``dispatch.py`` imports it (both ``None``:
    the name is known and refused when called). ``mask``: the mask
    transformers makes for it (:data:`MERGED` kernels are handed the bias merged into it). ``forms``: the bias forms
    it renders; ``sinks``, ``rounding`` (a bias rounded per key, ``slopes.KeyRounding``), ``slopes`` (slopes other
    than the paper's: fitted, per-layer), ``packed`` (packed rows, one document each) and ``paged`` (continuous
    batching's paged cache): whether it renders them. ``label``: how a refusal names it. ``packages``: optional
    top-level imports it needs (inside a ``try`` block, which transformers' ``check_imports`` skips). ``install``: what
    to install for it, said where it is missing. ``flag``: transformers' class attribute (``_supports_*``) that lets a
    model class take this backend, ``None`` where every model takes it (eager, a name hf_alibi registers itself).
    """

    name: str
    function: str | None
    module: str | None = None
    mask: str = MERGED
    forms: tuple[str, ...] = _ALL_FORMS
    sinks: bool = True
    rounding: bool = True
    slopes: bool = True
    packed: bool = True
    paged: bool = False
    label: str = ""
    packages: tuple[str, ...] = ()
    install: str = ""
    flag: str | None = None

    def __post_init__(self):
        if (self.function is None) != (self.module is None):
            raise ValueError(f"Kernel {self.name!r}: give its function and its module, or neither (a refused name).")

    @property
    def runs(self) -> bool:
        return self.function is not None


KERNELS: tuple[Kernel, ...] = (
    Kernel("eager", "eager_attention_forward", "dense", paged=True, label="the eager kernel"),
    Kernel("sdpa", "sdpa_attention_forward", "dense", paged=True, label="the sdpa kernel", flag="_supports_sdpa"),
    Kernel(
        "flex_attention", "flex_alibi_attention", "flex", mask=BLOCK, label="FlexAttention", flag="_supports_flex_attn"
    ),
    Kernel(
        "flash_attention_2",
        "flash_alibi_attention",
        "flash",
        mask=PADDING,
        forms=("causal", "symmetric"),
        sinks=False,
        rounding=False,
        label="flash-attn's ALiBi",
        packages=("flash_attn",),
        install="pip install flash-attn",
        flag="_supports_flash_attn",
    ),  # fmt: skip
    Kernel("flash_attention_3", None, mask=PADDING, label="flash-attn 3", flag="_supports_flash_attn"),
    Kernel(
        "flash_attention_4",
        "fa4_alibi_attention",
        "fa4",
        mask=PADDING,
        forms=("causal", "symmetric"),
        sinks=False,
        rounding=False,
        label="FlashAttention-4's ALiBi score_mod",
        packages=("flash_attn", "cutlass"),
        install="pip install flash-attn-4==4.0.0b36, or pip install -e '.[fa4]' in a checkout of hf_alibi",
        flag="_supports_flash_attn",
    ),  # fmt: skip
    Kernel(
        "cudnn",
        "cudnn_alibi_attention",
        "cudnn",
        mask=PADDING,
        forms=("causal",),
        sinks=False,
        rounding=False,
        slopes=False,
        packed=False,
        label="cuDNN's fused ALiBi",
        packages=("cudnn",),
        install="pip install nvidia-cudnn-frontend, or pip install -e '.[cuda]' in a checkout of hf_alibi",
    ),  # fmt: skip
)
# Never runs: the lines transformers' remote-code copier reads. save_pretrained (custom_object_save) and a Hub load
# with trust_remote_code (get_cached_module_file) copy only the files named by relative-import lines, found by a regex
# on the text, executed or not; dispatch.py imports each row's function by its row's names (importlib). Not a real
# import: this module stays torch-free (the command line reads it), and kernel files import it (a cycle). One line a
# kernel file, naming its rows' functions (tests/core/test_kernel_table.py checks that the lines and the rows agree).
if False:
    from .cudnn import cudnn_alibi_attention  # noqa: F401
    from .dense import eager_attention_forward, sdpa_attention_forward  # noqa: F401
    from .fa4 import fa4_alibi_attention  # noqa: F401
    from .flash import flash_alibi_attention  # noqa: F401
    from .flex import flex_alibi_attention  # noqa: F401

KERNEL_BY_NAME = {kernel.name: kernel for kernel in KERNELS}
# transformers' backends with an ALiBi path (dispatch.py registers ``alibi_<name>`` for each), and those known by
# name but refused when called; any other name is refused when set (:func:`check_backend`)
RUNNING_BACKENDS = tuple(kernel.name for kernel in KERNELS if kernel.runs)
REFUSED_BACKENDS = tuple(kernel.name for kernel in KERNELS if not kernel.runs)
PAGED_BACKENDS = tuple(kernel.name for kernel in KERNELS if kernel.paged)
# transformers' flag on a model class -> the backends it lets the class take (eager needs none)
SUPPORT_FLAGS = {
    flag: tuple(kernel.name for kernel in KERNELS if kernel.flag == flag)
    for flag in dict.fromkeys(kernel.flag for kernel in KERNELS if kernel.flag)
}
WHAT_RUNS = (
    f"a converted model runs with attn_implementation {', '.join(repr(b) for b in RUNNING_BACKENDS)} in "
    "transformers (generate, Trainer, pipelines, sentence-transformers, TRL), in vLLM through hf_alibi's plugin "
    "(`hf-alibi serve MODEL --engine vllm`), or in llama.cpp and what is built on it after `hf-alibi export-gguf`"
)


def kernel(name: str | None) -> Kernel | None:
    """The row of a backend name (``"sdpa"``, ``"alibi_sdpa"``, ``"alibi_remote_sdpa"``), else ``None``.

    >>> kernel("alibi_flash_attention_2").mask
    'padding'
    """
    if name is None:
        return None
    return KERNEL_BY_NAME.get(name.removeprefix("alibi_remote_").removeprefix("alibi_"))


def _instead(feature: str) -> str:
    # what to use where a kernel lacks ``feature``: sdpa first, then every other running kernel that renders it
    others = [k.name for k in KERNELS if k.runs and k.name != "sdpa" and getattr(k, feature)]
    alternatives = f" (or {', '.join(repr(name) for name in others)})" if others else ""
    return f"use model.set_attn_implementation('sdpa'){alternatives} for this model"


def refusal(row: Kernel, kind: str, sinks: int = 0, rounding=None, paper_slopes: bool = True) -> str | None:
    """Why ``row``'s kernel cannot render a layer's bias (its form ``kind``, ``sinks``, its ``rounding``, whether its
    slopes are the paper's), one line that says what to use instead; ``None`` when it can. Asked by the kernel before
    any work and, for the models trained with ALiBi, by ``set_attn_implementation`` before the model is switched
    (``hf_alibi/native/model.py``).

    >>> refusal(KERNEL_BY_NAME["flash_attention_2"], "causal", sinks=4)
    "flash-attn's ALiBi cannot exempt the first 4 keys (sinks): use model.set_attn_implementation('sdpa') (or 'eager', 'flex_attention') for this model."
    """  # noqa: E501
    if kind not in row.forms:
        only = " and ".join(row.forms)
        return f"{row.label} has no {kind!r} form (only {only}): use model.set_attn_implementation('sdpa')."
    if sinks and not row.sinks:
        return f"{row.label} cannot exempt the first {sinks} keys (sinks): {_instead('sinks')}."
    if rounding is not None and not row.rounding:
        dtype = getattr(rounding, "dtype", rounding)
        return (
            f"{row.label} cannot round each key's bias to {dtype} as this model's own code does (Falcon): "
            f"{_instead('rounding')}."
        )
    if not paper_slopes and not row.slopes:
        return f"{row.label} applies the paper's slopes only, not fitted or per-layer ones: {_instead('slopes')}."
    return None


def window_refusal(
    alibi, kv_len: int, what: str, instead: str = "model.set_attn_implementation('sdpa') (or 'eager')"
) -> str | None:
    """Why ``what`` (a kernel, continuous batching) cannot run this call of a layer with a rotary window
    (``window.py``): its keys reach past the window. One line that says what to do (``instead``), else ``None``."""
    window = getattr(alibi, "window", None)
    if window is None or kv_len <= window.size:
        return None
    return (
        f"{what} cannot carry the rotary window past {window.size} tokens ({kv_len} keys here): use {instead}, or "
        "convert without rotary_window."
    )


def kernel_refusal(name: str | None, alibi, kv_len: int | None = None) -> str | None:
    """:func:`refusal` for backend ``name`` (``None`` for a name the table does not know) and a layer's ``AlibiBias``
    (its ``kind``, ``sinks``, ``rounding``, and whether its slopes are the paper's); with ``kv_len``, a call whose
    keys reach past the layer's rotary window is refused too (only eager and sdpa carry it: ``window.py``)."""
    row = kernel(name)
    if row is None:
        return None
    reason = refusal(row, alibi.kind, alibi.sinks, alibi.rounding, alibi.spec.paper_slopes)
    return reason if reason is not None or kv_len is None else window_refusal(alibi, kv_len, row.label)


def paged_refusal(name: str | None) -> str | None:
    """Why continuous batching cannot run with backend ``name``, one line, else ``None``."""
    row = kernel(name)
    if row is not None and row.paged:
        return None
    runs = " and ".join(repr(k.name) for k in KERNELS if k.paged)
    shown = name.removeprefix("alibi_remote_").removeprefix("alibi_") if name else name
    return (
        f"Continuous batching has an ALiBi path for attn_implementation {runs}, not {shown!r}: "
        "call model.set_attn_implementation('sdpa') first."
    )


def check_backend(name: str | None, what_runs: str = WHAT_RUNS) -> None:
    """One-line ``ValueError`` for an attention implementation with no ALiBi path (another engine's function, a
    hub kernel, a future backend): it would run the model without its position bias. ``what_runs`` ends the message
    (default: what a converted model runs with; a model trained with ALiBi says its own, ``hf_alibi.native``).

    >>> check_backend("vllm")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ValueError: ...
    """
    if name is None or kernel(name) is not None:
        return
    shown = name.removeprefix("alibi_remote_").removeprefix("alibi_")
    raise ValueError(
        f"This ALiBi model cannot run with attn_implementation={shown!r}: hf_alibi has no ALiBi path for "
        f"it, and without one it would run without its position bias. Instead, {what_runs}."
    )
