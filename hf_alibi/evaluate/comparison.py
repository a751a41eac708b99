"""Several causal LMs on the same tokens: an original and its conversions (or models trained with ``run_clm.py
--alibi``), what each kept and how far each extrapolates. What ``hf-alibi compare`` runs.

For every model, on the same token stream:

- perplexity at each length (:func:`~hf_alibi.evaluate.lengths.evaluate_lengths`: ``nonoverlapping`` by default,
  ``sliding`` too on request) over the first ``max_tokens`` tokens;
- perplexity by position along one stream of ``position_tokens`` (default 2x the longest native length, or the whole
  text where it is shorter: the positions past the native length are the question compare answers), through the KV
  cache in chunks (:mod:`~hf_alibi.evaluate.stream`), so its memory is one chunk's queries against the cache;
- passkey retrieval at ``passkey_lengths`` and ``depths`` (:mod:`~hf_alibi.evaluate.passkey`).

Every input is checked before any model loads (:mod:`~hf_alibi.evaluate.inputs`: a :class:`CompareError` and nothing
written); the models load one at a time. A length past a model's learned positions is not run: its entry says why.
``rope`` adds the baselines a conversion is weighed against: the first model (a rotary original) run with
transformers' ``rope_parameters`` at a factor (``"yarn:2"``: YaRN x2, no training), each one more row.
The results are one JSON-ready dict (``out``: written as compare.json, with the plot compare.png).

Example:
    >>> results = compare(["my-llama", "my-llama-alibi"], lengths=[256, 1024], out="cmp")  # doctest: +SKIP
    >>> print(format_comparison(results))
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..convert.positions import original_length
from ..core.names import is_alibi
from ..hub.checkpoints import CheckpointError, open_source
from . import passkey as pk
from .inputs import (
    DEFAULT_LENGTHS,
    DEFAULT_MAX_TOKENS,
    DEPTHS,
    PLOT_FILE,
    RESULTS_FILE,
    CompareError,
    check_configs,
    check_lengths,
    check_output_folder,
    differing_tokenizers,
    parse_rope,
    rope_label,
    tokenizer_refusal,
)
from .lengths import PROTOCOLS, evaluate_lengths
from .report import format_comparison, plot_comparison
from .stream import by_position, position_bounds, position_nll

EMBEDDED = "the embedded corpus (validation split)"


def read_text(text: str | os.PathLike | None = None, dataset: str | None = None, split: str = "validation") -> str:
    """The text to measure on: the file ``text``, else the ``datasets`` name ``dataset`` (``name`` or
    ``name:config``; a local dataset folder too) joined by blank lines, else the embedded corpus's validation split.

    >>> read_text("notes.txt")[:5]  # doctest: +SKIP
    'Notes'
    """
    if text is not None:
        path = Path(text).expanduser()
        if not path.is_file():
            raise CompareError(f"--text {str(text)!r} is not a file: pass a plain-text file (or --dataset NAME).")
        content = path.read_text(encoding="utf-8", errors="replace")
    elif dataset is not None:
        import datasets

        name, _, config = dataset.partition(":")
        try:
            data = datasets.load_dataset(name, config or None, split=split)
        except Exception as error:  # the Hub's, datasets' and the network's own errors, on one line
            raise CompareError(f"--dataset {dataset!r}: {type(error).__name__}: {error}".replace("\n", " ")) from None
        if "text" not in data.column_names:
            raise CompareError(f"--dataset {dataset!r} has no 'text' column (it has {data.column_names}).")
        content = "\n\n".join(data["text"])
    else:
        from ..train.data import embedded_corpus

        content = "".join(embedded_corpus()["validation"]["text"])
    if not content.strip():
        raise CompareError("the text is empty: pass a text file with some prose (--text FILE).")
    return content


def model_lengths(configs: dict[str, dict], folders: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each model's ``native`` length (an original's :func:`original_length`; a model trained with ``run_clm.py``:
    its eval_results.json's ``train_length``; a conversion: the length of an original of its type among the models)
    and ``limit``, the longest input its learned position table allows (None: none)."""
    from ..core.architectures import find_architecture

    facts = {}
    for name, config in configs.items():
        row = find_architecture(str(config.get("model_type", "")))
        limit = original_length(config) if row is not None and row.strategy == "absolute" else None
        native = original_length(config)
        results = Path(folders.get(name, "")) / "eval_results.json"
        if native is None and results.is_file():
            native = json.loads(results.read_text()).get("train_length")
        facts[name] = {"native": native, "limit": limit, "alibi": is_alibi(config)}
    for name, config in configs.items():
        if facts[name]["native"] is None and is_alibi(config):
            base = (config.get("alibi") or {}).get("base_model_type")
            originals = [facts[n]["native"] for n, c in configs.items() if c.get("model_type") == base]
            facts[name]["native"] = next((n for n in originals if n), None)
    return facts


def _load_tokenizers(sources: dict[str, Any]):
    """The tokenizer every model shares (the first model's that has one), after checking that each model's own is the
    same; a folder without tokenizer files is held to it by its vocabulary size (:func:`check_configs`)."""
    from transformers import AutoTokenizer

    tokenizers = {}
    for name, source in sources.items():
        if source.has_tokenizer() is False:
            continue  # transformers would make an empty one from the config alone
        try:
            tokenizers[name] = AutoTokenizer.from_pretrained(name)
        except Exception as error:
            raise CompareError(
                f"MODEL {name!r}: transformers cannot read its tokenizer ({type(error).__name__}: {error})".replace(
                    "\n", " "
                )
            ) from None
    if not tokenizers:
        raise CompareError(
            "no MODEL has a tokenizer: save the original's tokenizer in its folder (tokenizer.save_pretrained)."
        )
    names = list(tokenizers)
    differ = differing_tokenizers({name: t.get_vocab() for name, t in tokenizers.items()})
    if differ:
        raise tokenizer_refusal(names[0], differ)
    return tokenizers[names[0]]


def default_device() -> str:
    """``cuda`` when there is one, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_causal(name: str, config: dict) -> None:
    if config.get("architectures"):
        return  # check_configs read them
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = str(config.get("model_type", "")).removeprefix("alibi_")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CompareError(
            f"MODEL {name!r} (model_type {model_type!r}) is not a causal LM: compare measures next-token perplexity; "
            "pass causal LM folders or Hub ids."
        )


def compare(
    models: Sequence[str],
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    protocols: Sequence[str] = ("nonoverlapping",),
    stride: int | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    position_tokens: int | None = None,
    chunk: int = 1024,
    passkey_lengths: Sequence[int] | None = None,
    depths: Sequence[float] = DEPTHS,
    text: str | os.PathLike | None = None,
    dataset: str | None = None,
    split: str = "validation",
    device: str | None = None,
    dtype: torch.dtype | None = None,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    batch_tokens: int = 4096,
    rope: Sequence[str] = (),
) -> dict[str, Any]:
    """Measure ``models`` (folders or Hub ids; the first is the baseline of the ratios) on the same tokens; see the
    module docstring. ``max_tokens`` bounds the windows' span; the stream is ``position_tokens`` long (default 2x the
    longest native length, or the text's length where that is shorter). ``rope``: ``"TYPE:FACTOR"`` baselines, the
    first model with transformers' rope_parameters of that type and factor (``"yarn:2"``). ``position_tokens`` 0 and
    ``passkey_lengths=()`` leave those out; ``passkey_lengths`` None: the longest of ``lengths``. ``device``:
    ``cuda`` when there is one (bf16 there), else ``cpu`` (fp32). ``out``:
    a folder that receives compare.json and compare.png. Returns the JSON's dict.

    >>> results = compare(["gpt2-tiny", "gpt2-tiny-alibi"], lengths=[64, 128], out="cmp")  # doctest: +SKIP
    >>> results["models"][1]["perplexity"]["nonoverlapping"]["128"]["perplexity"]
    """
    models, lengths = [os.fspath(m) for m in models], sorted({int(n) for n in lengths})
    if not models:
        raise CompareError("compare needs at least one MODEL (the first is the baseline of the ratios).")
    unknown = set(protocols) - set(PROTOCOLS)
    if unknown or not protocols:
        raise CompareError(f"--protocols {sorted(unknown) or '(none)'}: choose from {', '.join(PROTOCOLS)}.")
    passkey_lengths = [max(lengths)] if passkey_lengths is None and lengths else list(passkey_lengths or [])
    try:
        sources = {name: open_source(name, "MODEL") for name in models}
    except CheckpointError as error:
        raise CompareError(str(error)) from None
    configs = {name: source.config for name, source in sources.items()}
    check_configs(configs)
    ropes = [parse_rope(spec) for spec in rope]
    if ropes:
        _check_rope_baseline(models[0], configs[models[0]])
    for name, config in configs.items():
        _check_causal(name, config)
    if out is not None:
        out = check_output_folder(out, overwrite)
    tokenizer = _load_tokenizers(sources)
    facts = model_lengths(configs, {n: s.name for n, s in sources.items() if s.local})
    natives = [f["native"] for f in facts.values() if f["native"]]
    longest_native = max(natives) if natives else max(lengths, default=1024)
    tokenizer.model_max_length = int(1e30)  # one long stream: no warning that it is longer than the model's inputs
    content = read_text(text, dataset, split)
    ids = torch.tensor(tokenizer(content)["input_ids"])
    source = str(text) if text is not None else (dataset or EMBEDDED)
    wanted = 2 * longest_native if position_tokens is None else int(position_tokens)
    # the default stream reads as far as the text goes; one asked for by length must fit (check_lengths says so)
    stream = min(wanted, ids.numel() - 1) if position_tokens is None else wanted

    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    check_lengths(
        ids.numel(), lengths, max_tokens, stream, passkey_lengths, pk.prompt_tokens(encode) if passkey_lengths else 0,
        source,
    )  # fmt: skip
    device = device or default_device()
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise CompareError(f"--device {device}: torch sees no CUDA device here; pass --device cpu (or leave it out).")
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    span = ids[: min(max_tokens, ids.numel() - 1) + 1]
    bounds = position_bounds(longest_native, stream) if stream else []
    results: dict[str, Any] = {
        "text": {"source": source, "tokens": int(ids.numel()), "evaluated": int(span.numel())},
        "lengths": lengths,
        "protocols": list(protocols),
        "stride": stride,
        "max_tokens": max_tokens,
        "position": {"tokens": stream, "wanted": wanted, "chunk": chunk, "bounds": bounds, "native": longest_native},
        "passkey": {"lengths": passkey_lengths, "depths": list(depths)},
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "models": [],
    }
    # (name, label, rope): each model as it is, then the first one with each --rope baseline
    runs = [(name, _label(name, models), None) for name in models]
    runs[1:1] = [(models[0], f"{runs[0][1]} {rope_label(*r)}", r) for r in ropes]
    for i, (name, label, baseline) in enumerate(runs):
        print(f"compare: model {i + 1}/{len(runs)}: {label}", file=sys.stderr, flush=True)
        model = _load(name, device, dtype, baseline, facts[name]["native"])
        row = measure_model(
            model, span, ids[: stream + 1] if stream else None, facts[name], lengths, protocols, stride, batch_tokens,
            chunk, bounds, passkey_lengths, depths, encode, tokenizer.decode,
        )  # fmt: skip
        extra = {} if baseline is None else {"rope": {"rope_type": baseline[0], "factor": baseline[1]}}
        results["models"].append({"name": name, "label": label, **facts[name], **extra, **row})
        del model
        gc.collect()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
        plot_comparison(results, out / PLOT_FILE)
    return results


def _check_rope_baseline(name: str, config: dict) -> None:
    if is_alibi(config) or rope_theta(config) is None or not original_length(config):
        raise CompareError(
            f"--rope runs the first MODEL with other rope_parameters, but {name!r} is not a rotary original with a "
            "stated length (rope_theta, max_position_embeddings): put the original rotary model first."
        )


def rope_theta(config) -> float | None:
    """A rotary config's base (``rope_parameters["rope_theta"]``, or ``rope_theta`` of older configs), else None."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    theta = (get("rope_parameters") or {}).get("rope_theta", get("rope_theta"))
    return None if theta is None else float(theta)


def rope_overrides(config, kind: str, factor: float, native: int) -> dict[str, Any]:
    """``from_pretrained`` keywords that run a rotary original with transformers' rope type ``kind`` at ``factor``
    from its ``native`` length (YaRN: its by-parts interpolation and temperature, no training).

    >>> rope_overrides({"rope_theta": 1e5}, "yarn", 2.0, 8192)["max_position_embeddings"]
    16384
    """
    parameters = {"rope_type": kind, "factor": factor, "rope_theta": rope_theta(config)}
    if kind == "yarn":
        parameters["original_max_position_embeddings"] = native
    return {"rope_parameters": parameters, "max_position_embeddings": int(native * factor)}


def _load(name: str, device, dtype, rope: tuple[str, float] | None = None, native: int | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {} if rope is None else rope_overrides(AutoConfig.from_pretrained(name), *rope, native)
    # hf_alibi/__init__.py (run before this module) registered the ALiBi types: converted folders load as they are
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa", **extra)
    return model.to(device).eval()


def measure_model(
    model,
    span: torch.Tensor,
    stream: torch.Tensor | None,
    facts: dict[str, Any],
    lengths: Sequence[int],
    protocols: Sequence[str],
    stride: int | None,
    batch_tokens: int,
    chunk: int,
    bounds: Sequence[int],
    passkey_lengths: Sequence[int],
    depths: Sequence[float],
    encode,
    decode,
) -> dict[str, Any]:
    """One model's figures: ``perplexity`` (protocol -> length -> figures, or ``error``), ``by_position`` (range ->
    perplexity, None past its learned positions), ``passkey`` (length -> hits and of, or ``error``)."""
    limit = facts["limit"]
    row: dict[str, Any] = {"perplexity": {p: {} for p in protocols}}
    for length in lengths:  # one call per length: batches of about batch_tokens tokens
        batch = max(1, batch_tokens // length)
        figures = evaluate_lengths(model, {"text": span}, [length], stride, batch, protocols)["splits"]["text"]
        for p in protocols:
            row["perplexity"][p].update(figures[p])
    if stream is not None:
        nll = position_nll(model, stream, chunk, limit=limit)
        row["by_position"] = by_position(nll, bounds)
        if limit is not None and limit < stream.numel() - 1:
            row["by_position_error"] = f"the stream stops at the model's {limit} learned positions"
    row["passkey"] = {}
    for length in passkey_lengths:
        if limit is not None and length + pk.NEW_TOKENS > limit:
            row["passkey"][str(length)] = {"error": f"cannot run: {length} tokens > the model's {limit} positions"}
            continue
        hits, of = pk.passkey_hits(model, encode, decode, length, depths)
        row["passkey"][str(length)] = {"hits": hits, "of": of}
    return row


def _label(name: str, models: Sequence[str]) -> str:
    """A short column name: the folder's or repo's last part, the full name where two would read the same."""
    short = Path(name.rstrip("/")).name or name
    same = [m for m in models if (Path(m.rstrip("/")).name or m) == short]
    return short if len(same) == 1 else name


__all__ = [
    "compare", "default_device", "format_comparison", "measure_model", "model_lengths", "read_text", "rope_overrides",
    "rope_theta",
]  # fmt: skip
