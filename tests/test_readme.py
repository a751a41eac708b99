"""README's Python snippets run as written (issue 35), in order, in one namespace, in a fresh folder.

Two substitutions, each asserted to be there: the Hub id of the pretrained snippet becomes a tiny Llama saved here
(nothing is downloaded), and ``torch.compile`` runs with the ``aot_eager`` backend, which traces through AOT autograd
as inductor does, without inductor's C++ build (20 to 50 s a tiny model on this CPU; none of it is hf_alibi's).
The numbers the snippets make are then checked: the reloaded checkpoint gives the converted model's logits, and
the compiled pretrained conversion (sinks, slope scale, retained rotary: README's own compile line) the eager ones.
"""

import re

import torch
import transformers
from sharing import REPO_ROOT

HUB_ID = '"HuggingFaceTB/SmolLM2-135M-Instruct"'
COMPILE = "torch.compile(model, fullgraph=True)"


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), flags=re.S)


def test_readme_python_snippets_run_and_give_the_numbers_they_promise(tmp_path, monkeypatch):
    blocks = readme_python_blocks()
    assert len(blocks) == 2
    quickstart, pretrained = blocks
    assert HUB_ID in pretrained and COMPILE in pretrained
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32,
        )
    )  # fmt: skip
    llama.save_pretrained(tmp_path / "tiny-llama")
    pretrained = pretrained.replace(HUB_ID, repr(str(tmp_path / "tiny-llama")))
    pretrained = pretrained.replace(COMPILE, 'torch.compile(model, fullgraph=True, backend="aot_eager")')
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    namespace: dict = {}
    exec(compile(quickstart, "README.md (quickstart)", "exec"), namespace)
    ids = torch.randint(0, 100, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the snippet's model was built in training mode (dropout); from_pretrained gives eval
        torch.testing.assert_close(namespace["reloaded"](ids).logits, namespace["model"].eval()(ids).logits)
    exec(compile(pretrained, "README.md (pretrained)", "exec"), namespace)
    model, compiled = namespace["model"], namespace["compiled"]
    assert hf_alibi_settings(model)["sinks"] == 1
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    torch._dynamo.reset()


def hf_alibi_settings(model) -> dict:
    return model.config.to_dict()["alibi"]
