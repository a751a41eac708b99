"""One rank of the FSDP2 check (run with ``torchrun --nproc_per_node 2 tests/fsdp_worker.py OUT CASE...``).

The model is sharded by accelerate's own FSDP2 code (``fsdp2_prepare_model``: ``fully_shard`` on every
module named in the model's ``_no_split_modules``, then the embeddings / tail and the root), on the gloo
backend, so this runs on CPUs, where accelerate 1.15 itself never selects FSDP (see
``hf_alibi.train.distributed``). Each CASE is ``name[:variant[:flag...]]`` from ``tests/arch_cases.py``; flags:
``untied`` (word embeddings not tied to the output layer), ``own-wrap`` (see :func:`shard`).

Per case, every rank also trains an unsharded reference in plain torch: the same initial weights, the
mean of the ranks' losses per step (what FSDP's gradient averaging computes), the same AdamW. Then:

* the sharded model's full weights must equal the reference's;
* checkpoints with ``SHARDED_STATE_DICT`` (torch.distributed.checkpoint) and ``FULL_STATE_DICT``
  (accelerate's ``save_fsdp_model``) load back into a freshly built, sharded ALiBi model with the same
  weights (``load_fsdp_model``);
* rank 0 saves the gathered model with ``save_pretrained`` (what the Trainer does with the full state
  dict) and the reference's logits, for the test to reload in a fresh process.

Rank 0 writes ``OUT/report.json``; the test checks it (tests/training/test_fsdp.py).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from arch_cases import CASES  # noqa: E402

import hf_alibi  # noqa: E402
from hf_alibi.train.distributed import full_state_dict, fully_shard_layers, unsharded_copy  # noqa: E402

STEPS = 3
LR = 1e-2


def fake_accelerator(plugin, rank: int, world: int) -> SimpleNamespace:
    """What accelerate's FSDP2 helpers read from an ``Accelerator``: its FSDP plugin, device and ranks."""
    return SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        mixed_precision="no",
        device=torch.device("cpu"),
        torch_device_mesh=None,
        parallelism_config=None,
        is_fsdp2=True,
        is_main_process=rank == 0,
        process_index=rank,
        num_processes=world,
        wait_for_everyone=dist.barrier,
    )


def make_plugin(state_dict_type: str):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",  # the model's _no_split_modules
        reshard_after_forward=True,
        state_dict_type=state_dict_type,
        cpu_ram_efficient_loading=False,
    )


def shard(model, plugin, accelerator, own_wrap: bool = False):
    """accelerate's FSDP2 wrapping, or (``own_wrap``) ``fully_shard`` on each ``_no_split_modules`` module
    that does not hold the input embeddings, then the root. accelerate 1.15's fails for BERT (it shards
    ``BertEmbeddings``, then its word embeddings a second time) and T5 (``shared`` is tied into two groups),
    ALiBi or not; the second form keeps tied embeddings in the root's group."""
    if not own_wrap:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, model)
    return fully_shard_layers(model)  # the library's: layers resharded after forward (the default), then the root


def loss_of(case, model, inputs: dict) -> torch.Tensor:
    labels = inputs.get("decoder_input_ids", inputs["input_ids"])
    return model(**inputs, labels=labels).loss


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:5]
    return max((a[k].detach().cpu().double() - b[k].detach().cpu().double()).abs().max().item() for k in a)


def run_case(spec: str, out: Path, rank: int, world: int) -> dict:
    name, variant, *flags = spec.split(":") + [""]
    variant = variant or None
    case = next(c for c in CASES if c.name == name)
    options = {"tie_word_embeddings": False} if "untied" in flags else {}
    own_wrap = "own-wrap" in flags

    def build(seed: int):
        return hf_alibi.patch_model(case.make(seed=seed, **options), encoder_variant=variant)

    reference = build(0).train()
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    model = copy.deepcopy(reference)

    plugin = make_plugin("SHARDED_STATE_DICT")
    accelerator = fake_accelerator(plugin, rank, world)
    model = shard(model, plugin, accelerator, own_wrap)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    wrapped = sorted({type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)})
    learned = {n: p for n, p in model.named_parameters() if n.endswith(("alibi.slopes_left", "alibi.slopes_right"))}
    learned_local = {n: list(p.to_local().shape) for n, p in learned.items() if isinstance(p, DTensor)}

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batches = [case.inputs(2, 24, seed=100 + 10 * step + r) for r in range(world)]
        loss = loss_of(case, model, batches[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_loss = sum(loss_of(case, reference, b) for b in batches) / world
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        losses.append((loss.item(), reference_loss.item()))

    trained = full_state_dict(model)
    result = {
        "wrapped": wrapped,
        "learned_local_shapes": learned_local,
        "losses": losses,
        "diff_vs_reference": max_diff(trained, reference.state_dict()),
        "moved_from_initial": max_diff(trained, initial),
        "learned_moved": {
            n: (trained[n] - initial[n]).abs().max().item()
            for n in trained
            if n.endswith(("slopes_left", "slopes_right"))
        },
    }

    # checkpoints in both formats, loaded into a freshly built, differently initialised sharded model
    from accelerate.utils.fsdp_utils import load_fsdp_model, save_fsdp_model

    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        plugin = make_plugin(kind)
        accelerator = fake_accelerator(plugin, rank, world)
        folder = out / name / kind.lower()
        save_fsdp_model(plugin, accelerator, model, str(folder))
        dist.barrier()
        fresh = shard(build(1), plugin, accelerator, own_wrap)
        before = max_diff(full_state_dict(fresh), trained)
        load_fsdp_model(plugin, accelerator, fresh, str(folder))
        result[f"{kind}_reload_diff"] = max_diff(full_state_dict(fresh), trained)
        result[f"{kind}_before_reload_diff"] = before
        result[f"{kind}_files"] = sorted(p.name for p in folder.iterdir())

    # the unsharded copy the evaluation uses, on every rank: same weights, same logits as the reference
    plain = unsharded_copy(model)
    probe = case.inputs(2, 40, seed=7)  # longer than the original 16 positions
    reference.eval()
    with torch.no_grad():
        result["unsharded_copy_logits_diff"] = (plain(**probe).logits - reference(**probe).logits).abs().max().item()
        result["unsharded_copy_class"] = type(plain).__name__
        if rank == 0:  # the Trainer's FULL_STATE_DICT save: the gathered weights through save_pretrained
            plain.save_pretrained(out / name / "pretrained")
            torch.save({"inputs": probe, "logits": reference(**probe).logits}, out / name / "expected.pt")
    dist.barrier()
    return result


def main() -> None:
    out = Path(sys.argv[1])
    from accelerate import PartialState

    PartialState(cpu=True)  # accelerate's state (its helpers log through it): gloo on the CPU, as for DDP
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    report = {"world_size": world, "backend": dist.get_backend(), "cases": {}}
    for spec in sys.argv[2:]:
        report["cases"][spec] = run_case(spec, out, rank, world)
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        (out / "report.json").write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    # as hf_alibi.train.distributed.close_process_group (run_clm's end): the GIL free a moment, so gloo's workers drop
    # their last work before the group closes; without it a rank aborted at exit now and then ("terminate called
    # without an active exception": three FSDP tests errored in one default-tier run here)
    time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
