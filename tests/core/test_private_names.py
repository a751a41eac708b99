"""transformers' private names (``_``-prefixed attributes, methods, module names) appear in hf_alibi only in its
compat modules, where each is written down with the versions it was read in: a release that moves one breaks one
file. The names are found two ways: a list of those hf_alibi is known to use, and every ``_`` name hf_alibi reads or
overrides that transformers' own source defines (read from the installed transformers, not from hf_alibi)."""

import ast
import re
from pathlib import Path

import torch
import transformers

PACKAGE = Path(__file__).resolve().parents[2] / "hf_alibi"
# the modules where transformers' private names are allowed, each with the versions it read them in: the core's
# (copied into every checkpoint's remote code), the server's and saving's (which a loaded model never runs)
COMPAT = {PACKAGE / "core" / "compat.py", PACKAGE / "serve" / "compat.py", PACKAGE / "hub" / "compat.py"}
# transformers' documented hooks for a model class (what a model class sets to tell transformers what it supports),
# not private state (CONTRIBUTING, "What the structure keeps on purpose")
CLASS_HOOKS = {"_supports_sdpa", "_supports_flash_attn", "_supports_flex_attn", "_supports_attention_backend"}
CLASS_HOOKS |= {"_init_weights"}
CLASS_HOOKS |= {"_no_split_modules"}  # the modules a model class says are not to be split (device maps, FSDP units)
# the private transformers names hf_alibi reads or writes (all through its compat modules)
KNOWN = {
    "_attn_implementation",
    "_attn_implementation_internal",
    "_can_set_attn_implementation_cached_value",
    "_cached_continuous_batching_manager",
    "_create_batch_processor",
    "_set_gradient_checkpointing",
    "_name_or_path",
    "_output_attentions",
    "_CAN_RECORD_REGISTRY",
    "_can_record_outputs",
    "_global_mapping",
    "_model_mapping",
    "_upad_input",
    "_unpad_input",
    "_pad_input",
    "_cb_manager",
}
PRIVATE = re.compile(r"_[A-Za-z]\w*")


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def _used_names(tree: ast.AST) -> set[str]:
    """The ``_`` names a module reads, writes, imports or overrides (not dunders): attributes, names imported,
    methods defined in classes, and strings that are one name (``getattr(x, "_name")``, a class dict's keys)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rpartition(".")[2])
        elif isinstance(node, ast.ClassDef):
            names |= {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return {name for name in names if PRIVATE.fullmatch(name) and not name.startswith("__")}


def _own_names(trees: dict[Path, ast.AST]) -> set[str]:
    """What hf_alibi defines itself at module level (its private helpers: ``_plan``, ``_key``, ...)."""
    own = set()
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                own |= {t.id for t in targets if isinstance(t, ast.Name)}
    return own


def _transformers_names() -> set[str]:
    """Every ``_`` name transformers' source defines or reads as an attribute (def, class, assignment, ``.name``)."""
    root = Path(transformers.__file__).parent
    found = set()
    pattern = re.compile(r"(?:def |class |\.)(_[A-Za-z]\w*)|^\s*(_[A-Za-z]\w*)\s*[:=]", re.M)
    for path in root.rglob("*.py"):
        for match in pattern.finditer(path.read_text(errors="ignore")):
            found.add(match.group(1) or match.group(2))
    return {name for name in found if not name.startswith("__")}


def _outside_compat(names: set[str]) -> dict[str, list[str]]:
    """name -> the modules outside the compat modules that hold it as a whole word (docstrings and comments too)."""
    where: dict[str, list[str]] = {}
    for path, text in _sources().items():
        if path in COMPAT:
            continue
        for name in names:
            if re.search(rf"(?<![\w.]){re.escape(name)}\b|\.{re.escape(name)}\b", text):
                where.setdefault(name, []).append(str(path.relative_to(PACKAGE.parent)))
    return where


def test_the_known_private_transformers_names_appear_only_in_the_compat_modules():
    assert _outside_compat(KNOWN) == {}
    # each of them is real: transformers' source still defines or reads it
    assert KNOWN <= _transformers_names()


def test_no_other_private_transformers_name_is_used_outside_the_compat_modules():
    trees = {path: ast.parse(text) for path, text in _sources().items()}
    used: dict[str, set[str]] = {}
    for path, tree in trees.items():
        if path not in COMPAT:
            for name in _used_names(tree):
                used.setdefault(name, set()).add(str(path.relative_to(PACKAGE.parent)))
    torch_names = set(dir(torch.nn.Module)) | set(vars(torch.nn.Module()))  # torch's, not transformers'
    candidates = set(used) - _own_names(trees) - torch_names - CLASS_HOOKS
    private = candidates & _transformers_names()
    assert {name: sorted(used[name]) for name in private} == {}


def test_the_scan_finds_a_private_name_outside_compat(tmp_path):
    """The scan itself: a module that reads ``config._attn_implementation`` is caught by both tests' readers."""
    tree = ast.parse("def f(config):\n    return config._attn_implementation\n")
    assert "_attn_implementation" in _used_names(tree) & _transformers_names()
    assert "_can_set_attn_implementation_cached_value" in _used_names(
        ast.parse('T = type("T", (), {"_can_set_attn_implementation_cached_value": True})')
    )
