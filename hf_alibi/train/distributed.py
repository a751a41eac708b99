"""Sharded (FSDP) training of ALiBi models: what a training script needs besides accelerate.

* :func:`fsdp_on_cpu`: accelerate 1.15 turns an FSDP config into FSDP only on GPUs (and other accelerators); on
  CPUs the same launch (the Trainer's ``--fsdp``, or ``accelerate launch`` with an FSDP config and ``--use_cpu``)
  would silently train with DDP over gloo. It makes the Trainer's accelerator an FSDP2 one there, as accelerate does
  on GPUs (its own ``fully_shard`` wrapping and checkpoint code then run on gloo).
* :func:`fsdp_requested_but_not_used`: what is still not FSDP although the launcher asked (a launch that started
  independent single processes): the message says so, and what to launch instead.
* :func:`unsharded_copy`: a plain (unsharded) copy of an FSDP2 model on every rank, for work where the
  ranks run different forwards (the evaluation at many lengths shares its windows between ranks; an
  FSDP2 forward is a collective that every rank must enter with the same shapes).
* :func:`close_process_group`: the end of a distributed run, every rank's process group closed cleanly.
* :func:`deepspeed_on_cpu`: DeepSpeed through the Trainer on CPUs (``DS_ACCELERATOR=cpu``, gloo), which accelerate
  1.15 does not set up by itself: without CUDA it leaves the backend unset and counts one process.
* :func:`unsharded_copy` also gathers a DeepSpeed ZeRO-3 model (its partitions), as FSDP2's shards.

The ALiBi layers need nothing from FSDP: the fixed slopes are no parameters (recomputed per device),
and the learned encoder slopes (``...alibi.slopes_left`` / ``slopes_right``) are ordinary parameters,
sharded, gathered and saved like any other.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch import nn

# the Trainer's fsdp_config for FSDP2 (configs/fsdp/fsdp2.json; tests/training/test_fsdp.py checks they agree): every
# module of the model's _no_split_modules its own unit, whole weights on save (a checkpoint from_pretrained reloads)
FSDP2_CONFIG = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "reshard_after_forward": True,
    "state_dict_type": "FULL_STATE_DICT",
}


def fsdp_requested() -> bool:
    """The launcher asked for FSDP (``accelerate launch`` with ``distributed_type: FSDP`` or ``--use_fsdp``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_requested_but_not_used(distributed_type) -> str | None:
    """Why this process does not run FSDP although the launcher asked for it, or ``None``.

    ``distributed_type`` is accelerate's (``trainer.accelerator.distributed_type`` or
    ``training_args.distributed_state.distributed_type``).
    """
    if not fsdp_requested():
        return None
    name = getattr(distributed_type, "value", str(distributed_type))
    if name == "FSDP":
        return None
    world = os.environ.get("WORLD_SIZE", "?")
    instead = {
        "MULTI_CPU": "DDP over gloo",
        "NO": "each process alone, as if it were the only one",
    }.get(name, name)
    return (
        f"accelerate was launched with FSDP, but these {world} processes would train with {instead} "
        f"(distributed_type {name}): accelerate {_accelerate_version()} turns an FSDP config into FSDP on GPUs "
        "only; on CPUs hf_alibi does it for a launch of several processes over gloo. Launch it on GPUs (without "
        "--use_cpu), or on CPUs with --use_cpu (accelerate launch --config_file configs/accelerate/fsdp2.yaml "
        "--use_cpu ...), or with torchrun --nproc_per_node N and the Trainer's --fsdp."
    )


def fsdp_asked(trainer) -> bool:
    """The run asks for FSDP: the Trainer's ``fsdp`` argument, or the launcher's FSDP config."""
    return trainer.args.fsdp_plugin_args is not None or fsdp_requested()


def fsdp_on_cpu(trainer) -> bool:
    """Where FSDP was asked (:func:`fsdp_asked`) and accelerate left it out because there is no GPU, on several
    processes over gloo: make ``trainer``'s accelerator an FSDP2 one, with the Trainer's plugin (or the launcher's,
    from its environment), as accelerate does on GPUs, and return True. Call it after the Trainer is made and before
    it trains. False (nothing changed) elsewhere: on GPUs, in one process (as on GPUs: no FSDP there), or where the
    run is FSDP already. One-line ``ValueError`` for FSDP1 (``fsdp_version: 1``), which gloo does not run."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if torch.cuda.is_available() or not fsdp_asked(trainer) or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    check_fsdp_on_cpu(trainer.args)  # before the plugin is made: accelerate's FSDP1 plugin fails without a device
    arguments = trainer.args.fsdp_plugin_args
    plugin = FullyShardedDataParallelPlugin(**arguments) if arguments is not None else FullyShardedDataParallelPlugin()
    # what accelerate's AcceleratorState does on GPUs: the state's type (it is shared with PartialState) and plugin
    state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP  # every PartialState shares one state: set there too
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True
    return True


def check_fsdp_on_cpu(training_args) -> None:
    """Before the Trainer is made: one-line ``ValueError`` where the run asks for FSDP1 (the Trainer's ``--fsdp``, or
    the launcher's FSDP config) on a machine without GPUs (accelerate would stop inside the Trainer with a traceback:
    no device for FSDP1)."""
    arguments = training_args.fsdp_plugin_args
    if arguments is not None:  # transformers' default is FSDP2
        version = int(arguments.get("fsdp_version", 2))
    elif fsdp_requested():  # accelerate launch's environment (its plugin's default: FSDP1)
        version = int(os.environ.get("FSDP_VERSION", "1"))
    else:
        return
    if version != 2 and not torch.cuda.is_available():
        raise ValueError(
            f"FSDP on CPUs runs FSDP2 only (torch's fully_shard), got fsdp_version {version}: set fsdp_version 2 "
            "(--fsdp_config '{\"version\": 2}', or fsdp_version: 2 in the accelerate config)."
        )


def fully_shard_layers(model: nn.Module) -> nn.Module:
    """``fully_shard`` on each module named in ``model``'s ``_no_split_modules`` that does not hold the input
    embeddings, then on the root, in place, with its defaults (each layer resharded after its forward, the root not):
    tied embeddings stay in the root's group (accelerate 1.15's own wrapping shards BERT's twice and splits T5's)."""
    from torch.distributed.fsdp import fully_shard

    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in names and all(m is not embeddings for m in module.modules()):
            fully_shard(module)
    return fully_shard(model)


def shard_for_inference(model: nn.Module) -> nn.Module:
    """``model`` sharded in place with FSDP2 over the default process group, for forwards only (a frozen teacher too
    large for one device), by :func:`fully_shard_layers`. Each forward then gathers one unit at a time, on every rank
    together."""
    fully_shard_layers(model)
    # FSDP2 keeps the root's own parameters (the embeddings) gathered after a forward, for the backward that follows;
    # a teacher has none: shard them again after each forward
    model.register_forward_hook(lambda module, args, output: module.reshard())
    return model


def _accelerate_version() -> str:
    try:
        import accelerate

        return accelerate.__version__
    except ImportError:  # pragma: no cover
        return "?"


def is_fsdp2(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of an FSDP2 model, whole, on every rank (a collective: call it on all)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def unsharded_copy(model: nn.Module) -> nn.Module:
    """A plain copy of ``model`` (an FSDP2 model, a ZeRO-3 one, or any model) with the same class, config and
    weights.

    Collective for FSDP2 and ZeRO-3 models: every rank must call it. The copy lives on the device of the
    model's parameters and is in eval mode; the original is unchanged.
    """
    if is_zero3(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):  # every rank: all-gathers the partitions
            state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        base = type(model)  # a plain constructor below: not under zero.Init
    elif is_fsdp2(model):
        state = full_state_dict(model)
        base = next(cls for cls in type(model).__mro__ if not _is_fsdp_class(cls))
    else:
        return model
    device = next(iter(state.values())).device
    copy = base(model.config)  # on the CPU, not meta: non-persistent buffers are not in the state dict
    copy.load_state_dict(state, strict=True)
    return copy.to(device).eval()


def launch_rank() -> int:
    """This process's rank in the launch (torchrun's, accelerate's or DeepSpeed's ``RANK``), 0 alone."""
    return int(os.environ.get("RANK", "0"))


def launch_world() -> int:
    """How many processes the launch started (``WORLD_SIZE``), 1 alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launch(deepspeed_config: str | None = None, fsdp: bool = False) -> None:
    """One-line ``ValueError`` where ``hf-alibi recover`` is launched to shard in a way it was not told: FSDP without
    its ``--fsdp``, or DeepSpeed without its ``--deepspeed CONFIG``. It runs in one process, in several with DDP
    (``torchrun --nproc_per_node N -m hf_alibi recover ...``), with ``--fsdp`` (FSDP2) or with ``--deepspeed``
    (ZeRO-2 / ZeRO-3): the student sharded or partitioned, the teacher whole on every process."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if (fsdp_requested() and not fsdp) or (deepspeed and deepspeed_config is None):
        raise ValueError(
            f"hf-alibi recover was launched with {'DeepSpeed' if deepspeed else 'FSDP'} and no config of it: it runs "
            "in one process, in several with DDP (torchrun --nproc_per_node N -m hf_alibi recover ...), with --fsdp "
            "(FSDP2) or with --deepspeed configs/deepspeed/zero3.json (ZeRO-2 / ZeRO-3). Launch it so."
        )


def is_zero3(model: nn.Module) -> bool:
    """The model's weights are DeepSpeed ZeRO-3 partitions (``deepspeed.zero.Init``, or a ZeRO-3 engine's)."""
    return any(hasattr(parameter, "ds_id") for parameter in model.parameters())


def deepspeed_on_cpu(args: list[str]) -> list[str]:
    """Before ``TrainingArguments`` is made: where ``args`` ask for ``--deepspeed`` and there is no GPU, make
    accelerate's state a DeepSpeed one on gloo (``DS_ACCELERATOR=cpu``; every process of the launch counted) and
    return ``args`` with ``--accelerator_config '{"use_configured_state": true}'`` (the Trainer then takes that state);
    else ``args`` unchanged. One-line ``ValueError`` where the arguments ask for another accelerator config."""
    if "--deepspeed" not in args and not any(a.startswith("--deepspeed=") for a in args):
        return args
    if torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return args
    if any(a == "--accelerator_config" or a.startswith("--accelerator_config=") for a in args):
        raise ValueError(
            '--deepspeed on CPUs sets --accelerator_config itself ({"use_configured_state": true}: accelerate\'s '
            "state is made for DeepSpeed on gloo first): leave --accelerator_config out."
        )
    deepspeed_cpu_state()
    return [*args, "--accelerator_config", '{"use_configured_state": true}']


def check_deepspeed_config(path: str | os.PathLike | dict) -> dict:
    """A DeepSpeed config that hf_alibi can honour, read (a path or a dict), or a one-line ``ValueError`` before
    anything trains: JSON, ``zero_optimization.stage`` 0 to 3, and for ZeRO-3
    ``stage3_gather_16bit_weights_on_model_save`` true, without which the Trainer's save writes no whole weights (only
    DeepSpeed's partitions, to be merged with its ``zero_to_fp32.py``): the converted checkpoint ``from_pretrained``
    reloads would not be written."""
    config = path
    if not isinstance(path, dict):
        try:
            config = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"--deepspeed {str(path)!r} is not a readable JSON DeepSpeed config: {error}.") from None
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"--deepspeed: zero_optimization.stage is {stage!r}; use 0 to 3 (configs/deepspeed/).")
    if stage == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save", False):
        raise ValueError(
            "--deepspeed: a ZeRO-3 config without zero_optimization.stage3_gather_16bit_weights_on_model_save true "
            "saves no whole weights, so no converted checkpoint that from_pretrained reloads: set it true "
            "(configs/deepspeed/zero3.json does)."
        )
    return config


def deepspeed_cpu_state() -> bool:
    """Where there is no GPU, make accelerate's state a DeepSpeed one on gloo (``DS_ACCELERATOR=cpu``) and return True:
    ``TrainingArguments(deepspeed=..., accelerator_config={"use_configured_state": True})`` then takes it. False
    (nothing made) on a GPU machine."""
    if torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return False
    os.environ["DS_ACCELERATOR"] = "cpu"
    if "RANK" not in os.environ:  # one process, no launcher: a group of one (as DeepSpeed's launcher would set it)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from accelerate import PartialState

    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # accelerate reads it as the state is made (as transformers does)
    try:
        PartialState(backend="gloo")
    finally:
        if previous is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
    return True


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _is_fsdp_class(cls: type) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return issubclass(cls, FSDPModule)


def close_process_group(accelerator=None) -> None:
    """End a distributed run cleanly (``accelerator``: the run's, whose trackers end too; None: the bare group, as
    ``hf-alibi recover`` on several processes, whose rank 0 writes OUT while the others wait here). Without this, a
    gloo (CPU) run failed about one time in eight as it exited: a rank aborted ("terminate called without an active
    exception"), or hung in ``~ProcessGroupGloo``, which joins its worker threads under the GIL while a worker,
    dropping its last collective's tensors, waits for the GIL. So every rank waits for the others (no collective in
    flight), gives the workers a moment with the GIL free to drop what they hold, and closes the group. Nothing in one
    process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if accelerator is not None:  # end_training: its trackers, then destroy_process_group
        wait, close = accelerator.wait_for_everyone, accelerator.end_training
    else:
        wait, close = torch.distributed.barrier, torch.distributed.destroy_process_group
    wait()
    time.sleep(0.2)  # the GIL released: gloo's workers finish dropping their last work
    close()
