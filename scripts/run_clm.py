#!/usr/bin/env python
"""Train a causal language model with the Trainer; with ``--alibi``, train short and test long.

Shaped like transformers' ``examples/pytorch/language-modeling/run_clm.py`` (dataclass arguments,
one linear ``main()``), plus:

- ``--alibi`` converts the model with ``hf_alibi.patch_model`` before training (from scratch with
  ``--model_type`` / ``--config_overrides``, or converting ``--model_name_or_path``); ``--alibi_heads``
  checks the head count. With ``--alibi``, ``--block_size`` is not capped by the position table.
- ``--distill_from_original`` (with ``--model_name_or_path`` and ``--alibi``): recover the converted model by
  self-distillation from the original (``hf_alibi.recover``): the loss is the KL of the next-token
  distributions to the unconverted checkpoint (``--distill_lm_weight`` mixes in the LM loss), at the
  original length; the agreement (KL, perplexity at 1x, 2x, 4x, 8x) goes to ``distill_agreement.json``.
- ``--train_sequence_length_scaling s``: training batches (B, L) become (B / s, L * s) (composer).
- ``--eval_lengths 256,512,...`` / ``--eval_stride``: perplexity of the validation and test splits at
  every length, non-overlapping and sliding window; ``eval_results.json`` gets the figures, the log
  a table, ``ppl_vs_length.png`` the plot.
- With no ``--dataset_name`` / ``--train_file``, the embedded corpus (the running interpreter's standard
  library source, split by file; no download) and, with no ``--tokenizer_name``, a byte-level BPE
  tokenizer trained on its train split.

Example (see README.md for the main job):
    python scripts/run_clm.py --model_type gpt2 --alibi --config_overrides n_layer=4,n_embd=256,n_head=4 \
        --block_size 128 --max_steps 500 --eval_lengths 128,256,512,1024 --output_dir out/alibi
Several processes on CPUs (DDP, gloo):
    accelerate launch --multi_gpu --num_processes 2 scripts/run_clm.py --use_cpu ...
(with accelerate 1.15, ``accelerate launch --cpu --num_processes 2`` starts one process: its multi-CPU path is mpirun).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import torch
import transformers
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

import hf_alibi
from hf_alibi.convert.positions import original_length
from hf_alibi.core.partitions import whole_shape
from hf_alibi.evaluate import evaluate_lengths, format_table, plot_results
from hf_alibi.export.gguf import OUTTYPES, check_exportable
from hf_alibi.recover import DistillationTrainer, agreement, format_agreement, model_kind
from hf_alibi.recover.settings import distill_settings_of, with_distill_fields
from hf_alibi.train.data import embedded_tokenizer, load_raw_datasets
from hf_alibi.train.distributed import (
    check_deepspeed_config,
    check_fsdp_on_cpu,
    close_process_group,
    deepspeed_on_cpu,
    fsdp_on_cpu,
    fsdp_requested_but_not_used,
    is_fsdp2,
    unsharded_copy,
)
from hf_alibi.train.length_scaling import LengthScalingTrainer, scaled_shape
from hf_alibi.train.resume import SaveConfigCallback, check_resume, checkpoint_alibi_settings  # noqa: F401

logger = logging.getLogger(__name__)


@dataclass
@with_distill_fields  # the DistillationTrainer's settings as --distill_<name>: declared once, in RecoverySettings
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Checkpoint to start from (local)."})
    model_type: str | None = field(default=None, metadata={"help": "Train from scratch: e.g. gpt2, gpt_neox."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "From scratch: config overrides, e.g. n_layer=4,n_embd=256,n_head=4"}
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer name or path. Default: the model's, else one trained here."}
    )
    tokenizer_vocab_size: int = field(default=8192, metadata={"help": "Vocabulary of a tokenizer trained here."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloads and the embedded corpus go."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "Attention backend: sdpa or eager."})
    alibi: bool = field(default=False, metadata={"help": "Convert the model to ALiBi before training."})
    alibi_heads: int | None = field(
        default=None, metadata={"help": "Attention heads for the slopes; must equal the config's (checked)."}
    )
    distill_from_original: bool = field(
        default=False,
        metadata={
            "help": "With --model_name_or_path and --alibi: distil the original checkpoint into the converted one."
        },
    )
    export_gguf: str | None = field(
        default=None,
        metadata={"help": "At the end, write output_dir/model-TYPE.gguf for llama.cpp (TYPE: f32, f16, bf16, q8_0)."},
    )

    def __post_init__(self):
        if self.config_overrides is not None and (self.config_name is not None or self.model_name_or_path is not None):
            raise ValueError("--config_overrides can't be used with --config_name or --model_name_or_path")
        if self.alibi_heads is not None and not self.alibi:
            raise ValueError("--alibi_heads only applies with --alibi.")
        if self.distill_from_original and (not self.alibi or self.model_name_or_path is None):
            raise ValueError(
                "--distill_from_original needs --model_name_or_path (the original, the teacher) and --alibi."
            )
        distill_settings_of(self)  # each --distill_ setting's own check (RecoverySettings), before anything loads
        if self.export_gguf is not None and self.export_gguf not in OUTTYPES:
            raise ValueError(f"--export_gguf takes one of {', '.join(OUTTYPES)}, got {self.export_gguf!r}.")


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset, e.g. wikitext (online)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "e.g. wikitext-103-raw-v1"})
    train_file: str | None = field(default=None, metadata={"help": "Local training text (txt, json, csv)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation text."})
    test_file: str | None = field(default=None, metadata={"help": "Local test text (evaluated at eval_lengths)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the validation blocks."})
    block_size: int | None = field(
        default=None, metadata={"help": "Training length. Not capped by the position table with --alibi."}
    )
    validation_split_percentage: int = field(default=5, metadata={"help": "Validation share if none is given."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenizing."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the tokenized datasets."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks of TXT files."})
    train_sequence_length_scaling: float = field(
        default=1.0, metadata={"help": "Training batches (B, L) become (B / s, L * s); 0.25 trains at L / 4."}
    )
    eval_lengths: str | None = field(
        default=None, metadata={"help": "Comma-separated evaluation lengths, e.g. 256,512,1024,2048."}
    )
    eval_stride: int | None = field(
        default=None, metadata={"help": "Sliding-window step (tokens scored per window). Default: length // 2."}
    )
    max_eval_tokens: int | None = field(
        default=None, metadata={"help": "Evaluate at eval_lengths on the first N tokens of each split."}
    )
    eval_lengths_batch_size: int = field(default=4, metadata={"help": "Windows per forward pass at eval_lengths."})

    def __post_init__(self):
        self.lengths = [int(n) for n in self.eval_lengths.split(",")] if self.eval_lengths else []
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"--eval_lengths must be positive integers, got {self.eval_lengths!r}.")


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:  # --deepspeed on CPUs: accelerate's state made for it first (gloo, every process counted)
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(deepspeed_on_cpu(sys.argv[1:]))

    # Logging
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    datasets.utils.logging.disable_progress_bar()
    if training_args.disable_tqdm:  # the Trainer's bar off, and transformers' own (a save's "Writing model shards")
        transformers.utils.logging.disable_progress_bar()
    logger.info(f"Training/evaluation parameters {training_args}")

    if training_args.deepspeed:  # one that hf_alibi can honour (a whole checkpoint saved), before anything loads
        check_deepspeed_config(training_args.deepspeed)
    set_seed(training_args.seed)
    not_fsdp = fsdp_requested_but_not_used(training_args.distributed_state.distributed_type)
    if not_fsdp and training_args.distributed_state.distributed_type.value == "NO":
        raise ValueError(not_fsdp)  # before the data: independent processes never become FSDP
    check_fsdp_on_cpu(training_args)  # FSDP1 asked on CPUs: one line (accelerate would fail inside the Trainer)

    resume_from_checkpoint = training_args.resume_from_checkpoint
    if training_args.do_train and resume_from_checkpoint is not None:
        if str(resume_from_checkpoint).lower() in ("true", "last"):  # the latest checkpoint-N of output_dir
            resume_from_checkpoint = get_last_checkpoint(training_args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"--resume_from_checkpoint: no checkpoint-N folder in {training_args.output_dir}.")
        check_resume(model_args, resume_from_checkpoint)

    # Data: the Hub, local files, or the embedded corpus
    with training_args.main_process_first(desc="loading the data"):
        raw_datasets = load_raw_datasets(
            data_args.dataset_name, data_args.dataset_config_name, data_args.train_file, data_args.validation_file,
            data_args.test_file, data_args.keep_linebreaks, data_args.validation_split_percentage,
            model_args.cache_dir,
        )  # fmt: skip

    # Tokenizer: given, the model's, or trained here on the training split
    if model_args.tokenizer_name or model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.tokenizer_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir
        )
    else:
        logger.info(
            f"Training a byte-level BPE tokenizer ({model_args.tokenizer_vocab_size} tokens) on the train split."
        )
        with training_args.main_process_first(desc="training the tokenizer"):
            text_column = (
                "text" if "text" in raw_datasets["train"].features else list(raw_datasets["train"].features)[0]
            )
            tokenizer = embedded_tokenizer(
                raw_datasets, model_args.tokenizer_vocab_size, model_args.cache_dir, column=text_column
            )

    # Model: from a checkpoint or from scratch, then ALiBi
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name, cache_dir=model_args.cache_dir)
    elif model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, cache_dir=model_args.cache_dir)
    elif model_args.model_type:
        config = CONFIG_MAPPING[model_args.model_type]()
        if model_args.config_overrides is not None:
            logger.info(f"Overriding config: {model_args.config_overrides}")
            config.update_from_string(model_args.config_overrides)
    else:
        raise ValueError("Pass --model_name_or_path, --config_name or --model_type (e.g. --model_type gpt2).")
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, config=config, attn_implementation=model_args.attn_implementation
        )
    else:
        config.vocab_size = len(tokenizer)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, name, None) is not None:
                setattr(config, name, getattr(tokenizer, name))
        model = AutoModelForCausalLM.from_config(config, attn_implementation=model_args.attn_implementation)
        logger.info(f"Training new model from scratch: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")
    if len(tokenizer) > whole_shape(model.get_input_embeddings().weight)[0]:  # a ZeRO-3 partition's is (0,)
        model.resize_token_embeddings(len(tokenizer))
    if model.loss_type is None:  # a class name naming no loss (GPT2LMHeadModel): transformers warns, then takes this
        model.loss_type = "ForCausalLM"
    teacher = None
    if model_args.distill_from_original:
        if hf_alibi.is_alibi(model):
            raise ValueError(
                "--distill_from_original needs the original checkpoint (the teacher), but "
                f"{model_args.model_name_or_path} is already ALiBi. Pass the checkpoint it was converted from."
            )
        if data_args.train_sequence_length_scaling != 1:
            raise ValueError(
                "--distill_from_original trains at the original length: leave out --train_sequence_length_scaling."
            )
        if training_args.deepspeed:
            raise ValueError(
                "--distill_from_original does not run under --deepspeed yet (its teacher would be a copy of "
                "partitioned weights): distill with DDP or FSDP (docs/training.md)."
            )
        teacher = copy.deepcopy(model)
    if model_args.alibi:
        if hf_alibi.is_alibi(model):
            logger.info("The checkpoint is already an ALiBi model; training it as it is.")
        else:
            hf_alibi.patch_model(model, heads=model_args.alibi_heads)
            logger.info(f"Converted to ALiBi: {model.config.alibi}")
    position_limit = original_length(model.config)
    alibi_model = hf_alibi.is_alibi(model)
    if model_args.export_gguf:
        check_exportable(model)  # before training: a conversion llama.cpp cannot run is refused now

    # Tokenize
    column_names = list(raw_datasets["train"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(
            tokenize_function,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=column_names,
            load_from_cache_file=not data_args.overwrite_cache,
            desc="Running tokenizer on dataset",
        )

    # Block size: only an unpatched model is held to its position table
    block_size = data_args.block_size or 1024
    if teacher is not None and original_length(teacher) and block_size > original_length(teacher):
        logger.warning(
            f"--distill_from_original: block_size {block_size} > the original's {original_length(teacher)}."
        )
        block_size = original_length(teacher)
    if not alibi_model and position_limit is not None and block_size > position_limit:
        logger.warning(f"block_size {block_size} > the model's {position_limit} positions: using {position_limit}.")
        block_size = position_limit
    if data_args.train_sequence_length_scaling != 1:
        batch, length = scaled_shape(
            training_args.per_device_train_batch_size, block_size, data_args.train_sequence_length_scaling
        )
        logger.info(f"train_sequence_length_scaling: training batches ({block_size}) -> ({batch}, {length})")

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = (len(concatenated[list(examples.keys())[0]]) // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(
            group_texts,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
            desc=f"Grouping texts in chunks of {block_size}",
        )

    train_dataset = lm_datasets["train"] if training_args.do_train else None
    if train_dataset is not None and data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    eval_dataset = lm_datasets["validation"] if training_args.do_eval else None
    if eval_dataset is not None and data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    common = dict(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=[SaveConfigCallback()],
    )
    if teacher is not None:
        trainer = DistillationTrainer(
            **common,
            teacher=teacher,
            kind=model_kind(teacher),
            **distill_settings_of(model_args).distillation_arguments(),
        )
    else:
        trainer = LengthScalingTrainer(**common, train_sequence_length_scaling=data_args.train_sequence_length_scaling)
    fsdp_on_cpu(trainer)  # FSDP asked on CPUs (--fsdp, or accelerate's FSDP config with --use_cpu): FSDP2 on gloo
    not_fsdp = fsdp_requested_but_not_used(trainer.accelerator.distributed_type)
    if not_fsdp:
        raise ValueError(not_fsdp)

    # Training
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        trainer.save_model()
        if is_fsdp2(trainer.model):
            sharded_only = "FULL_STATE_DICT" not in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
            gathered = unsharded_copy(trainer.model)  # every rank: all-gathers the shards
            if sharded_only and training_args.should_save:
                # with SHARDED_STATE_DICT the Trainer's save_model writes nothing: save the gathered model
                # (config.json with the ALiBi settings, safetensors, remote code), as with FULL_STATE_DICT
                gathered.save_pretrained(training_args.output_dir)
                tokenizer.save_pretrained(training_args.output_dir)
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    # Evaluation at the training length (upstream's)
    eval_metrics = None
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else math.inf
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        eval_metrics = metrics

    # Agreement with the original (distillation): KL and perplexity at the original length, student at 2x..8x
    if teacher is not None and "validation" in tokenized_datasets and training_args.process_index == 0:
        ids = torch.tensor(list(chain(*tokenized_datasets["validation"]["input_ids"])), dtype=torch.long)
        ids = ids[: (data_args.max_eval_tokens or 8192) + 1]
        student = trainer.accelerator.unwrap_model(trainer.model)
        figures = agreement(student, trainer.teacher, ids, block_size, (1, 2, 4, 8), model_kind(teacher))
        figures.update(length=block_size, steps=trainer.state.global_step, tokens=int(ids.numel()))
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "distill_agreement.json"), "w") as f:
            json.dump(figures, f, indent=2, sort_keys=True)
        print(f"\nAgreement with the original (validation, length {block_size}): {format_agreement(figures)}")

    # The trained model whole, on every rank (with FSDP2 unsharded_copy all-gathers, so every rank calls it): each rank
    # scores its own share of the windows below (a sharded forward would need every rank in step); rank 0 exports it
    if data_args.lengths or model_args.export_gguf:
        model = unsharded_copy(trainer.accelerator.unwrap_model(trainer.model))

    # Evaluation at many lengths: every rank takes a share of the windows, all get the same sums
    if data_args.lengths:
        splits = {}
        for split in ("validation", "test"):
            if split in tokenized_datasets:
                ids = torch.tensor(list(chain(*tokenized_datasets[split]["input_ids"])), dtype=torch.long)
                splits[split] = ids[: data_args.max_eval_tokens] if data_args.max_eval_tokens else ids
        results = evaluate_lengths(
            model, splits, data_args.lengths, data_args.eval_stride, data_args.eval_lengths_batch_size
        )
        results.update(
            alibi=alibi_model,
            model_type=model.config.model_type,
            train_length=int(block_size * data_args.train_sequence_length_scaling),
            block_size=block_size,
            train_sequence_length_scaling=data_args.train_sequence_length_scaling,
            world_size=training_args.world_size,
            trainer_eval=eval_metrics,  # upstream's figures at block_size, which save_metrics put in this file
        )
        if training_args.process_index == 0:
            os.makedirs(training_args.output_dir, exist_ok=True)
            with open(os.path.join(training_args.output_dir, "eval_results.json"), "w") as f:
                json.dump(results, f, indent=2, sort_keys=True)
            name = (
                f"ALiBi {hf_alibi.get_settings(model.config).base_model_type}"
                if alibi_model
                else model.config.model_type
            )
            title = f"{name}, trained at {results['train_length']} tokens"
            png = plot_results(results, os.path.join(training_args.output_dir, "ppl_vs_length.png"), title)
            print(f"\nPerplexity against evaluation length ({title}):\n{format_table(results)}\nplot: {png}")

    # llama.cpp: the trained model and its tokenizer as one GGUF file
    if model_args.export_gguf and training_args.process_index == 0:
        out = os.path.join(training_args.output_dir, f"model-{model_args.export_gguf}.gguf")
        hf_alibi.export_gguf(model, out, outtype=model_args.export_gguf, tokenizer=tokenizer, overwrite=True)
        print(f"\nllama.cpp: {out} (llama-cli -m {out})")

    close_process_group(trainer.accelerator)


if __name__ == "__main__":
    main()
