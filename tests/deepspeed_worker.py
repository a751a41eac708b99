"""One rank of the ZeRO-3 conversion check (``torchrun --nproc_per_node 2 tests/deepspeed_worker.py OUT SRC CASE...``).

DeepSpeed runs on the CPU (``DS_ACCELERATOR=cpu``, gloo). A ZeRO-3 config is made current as the Trainer makes it
(transformers' ``HfDeepSpeedConfig``), so ``from_pretrained`` builds every model under ``deepspeed.zero.Init``: each
weight is a partition (shape ``(0,)``, ``ds_shape`` the whole one). Per CASE (``SRC/CASE`` holds the original,
saved by the test) and per conversion of :data:`CONVERSIONS`, every rank loads it partitioned and converts it (a
fitted case: ``fit_slopes`` on the partitioned original first); rank 0 gathers the converted weights and saves them
with the conversion's settings to ``OUT/CASE/NAME.pt``. The test (tests/training/test_deepspeed.py) compares them with
the same conversion in one process, exactly.

Also, per CASE: a saved conversion (``SRC/CASE-alibi``, the pretrained preset, written by the test) loaded under
``zero.Init`` (the ALiBi class rebuilds its position path from shapes) gathers to the saved weights
(``OUT/CASE/reloaded.pt``); and rank 0 writes what ``patch_model`` says of an FSDP2-sharded model
(``OUT/refusals.json``: DTensors are refused, nothing changed).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import transformers  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

import hf_alibi  # noqa: E402
from hf_alibi.convert.planning import applies  # noqa: E402
from hf_alibi.core.settings import conversion_options  # noqa: E402

# name -> patch_model keywords; "fit" fits the slopes on the partitioned original first
CONVERSIONS = {
    "paper": {},
    "pretrained": {"preset": "pretrained"},
    "options": {"sinks": 2, "slope_scale": 0.5, "position_mean": 4, "table_max_wavelength": 8.0,
                "rotary_max_wavelength": 8.0, "rotary_knee": 8.0, "rotary_stretch": 3.0, "rotary_interpolation": 1.5},
    "fit": {"preset": "pretrained", "fit": True},
}  # fmt: skip
ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
FIT_IDS = torch.arange(3, 17)  # 14 tokens: inside every tiny config's 16 positions and vocabulary


def applicable(config, keywords: dict) -> dict:
    """The keywords that apply to this model (the options of other rows left out, as the CLI's do)."""
    if config.model_type in hf_alibi.native_model_types():
        return {}  # trained with ALiBi: it takes no options
    fields = {f.name: f for f in conversion_options()}
    row = hf_alibi.get_architecture(config.model_type)
    return {k: v for k, v in keywords.items() if k not in fields or applies(fields[k], row, config)}


def conversions(src: Path) -> dict[str, dict]:
    """The conversions a model takes: one for a model trained with ALiBi, no fit for an encoder-decoder."""
    config = json.loads((src / "config.json").read_text())
    if config["model_type"] in hf_alibi.native_model_types():
        return {"paper": {}}
    return {k: v for k, v in CONVERSIONS.items() if not (v.get("fit") and config.get("is_encoder_decoder"))}


def gathered_state(model) -> dict[str, torch.Tensor]:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def convert(src: Path, name: str, keywords: dict):
    model_class = getattr(transformers, json.loads((src / "config.json").read_text())["architectures"][0])
    model = model_class.from_pretrained(src)
    weight = next(model.parameters())
    assert weight.numel() == 0 and hasattr(weight, "ds_shape"), "not partitioned: the check would prove nothing"
    keywords = applicable(model.config, dict(keywords))
    if keywords.pop("fit", False):
        keywords["slopes"] = hf_alibi.fit_slopes(model, FIT_IDS[None], sinks=1)
    hf_alibi.patch_model(model, **keywords)
    return model


def refusals(src: Path) -> dict:
    """What patch_model says of an FSDP2-sharded model, and whether its weights stayed."""
    from torch.distributed.fsdp import fully_shard

    model_class = getattr(transformers, json.loads((src / "config.json").read_text())["architectures"][0])
    model = model_class.from_pretrained(src)  # partitioned by zero.Init: made whole for this check
    state = gathered_state(model)
    plain = model_class(model.config)
    plain.load_state_dict(state, strict=False)
    fully_shard(plain)
    before = {k: v.full_tensor().clone() for k, v in plain.state_dict().items()}
    try:
        hf_alibi.patch_model(plain, preset="pretrained")
        message = None
    except ValueError as error:
        message = str(error)
    after = {k: v.full_tensor() for k, v in plain.state_dict().items()}
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return {"message": message, "unchanged": unchanged, "type": type(plain).__name__}


def main() -> None:
    out, src, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    keep = HfDeepSpeedConfig(ZERO3)  # noqa: F841  (transformers holds it weakly: ZeRO-3 is current while it lives)
    for case in cases:
        (out / case).mkdir(parents=True, exist_ok=True)
        for name, keywords in conversions(src / case).items():
            model = convert(src / case, name, keywords)
            state = gathered_state(model)
            if rank == 0:
                torch.save({"state": state, "alibi": model.config.alibi}, out / case / f"{name}.pt")
        saved = src / f"{case}-alibi"
        if saved.is_dir():  # the Auto class the test wrote beside it: the ALiBi class, after import hf_alibi
            auto = getattr(transformers, (saved / "auto_class.txt").read_text().strip())
            reloaded = auto.from_pretrained(saved)
            state = gathered_state(reloaded)
            if rank == 0:
                torch.save({"state": state, "class": type(reloaded).__name__}, out / case / "reloaded.pt")
    report = refusals(src / cases[0])
    if rank == 0:
        (out / "refusals.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
