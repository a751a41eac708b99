"""Recovery's settings are declared once: :class:`RecoverySettings` makes the ``hf-alibi recover`` flags,
``scripts/run_clm.py``'s ``distill_*`` fields, the DistillationTrainer's arguments, the checks and the keywords
:func:`recover` accepts. The expected names and values below are written out here, not read from the declaration."""

import dataclasses
import inspect

import pytest
import torch
from tiny import random_ids, tiny_gpt2

import hf_alibi
from hf_alibi import cli
from hf_alibi.core.settings import conversion_options
from hf_alibi.recover import DistillationTrainer, RecoverySettings, recover
from hf_alibi.recover.settings import add_setting_flags, check_settings, settings_from_flags

# what hf-alibi recover takes besides the settings: the job's own arguments
JOB_ARGUMENTS = {"help", "src", "out", "train_file", "validation_file", "checkpoint_dir", "overwrite"}
# the settings that are recover()'s keywords but no flag (data sizes, the progress bar; output_dir: --checkpoint-dir)
NO_FLAG = {"eval_fraction", "max_eval_tokens", "eval_factors", "progress", "output_dir"}
DISTILL = {"lm_weight", "temperature", "hidden_layers", "warm_start_steps", "attention_only_steps"}


def _recover_actions():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return commands.choices["recover"]._actions


def _run_clm():
    from test_recover import load_run_clm

    return load_run_clm()


def _known_keywords() -> set[str]:
    """The keywords recover() accepts, read from its refusal of an unknown one."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_setting'") as refused:
        recover(tiny_gpt2(), random_ids(1, 100).reshape(-1), no_such_setting=1)
    return set(str(refused.value).split("known: ")[1].rstrip(".").split(", "))


def test_flags_distill_fields_trainer_arguments_and_keywords_are_made_from_the_one_declaration():
    fields = {f.name: f for f in dataclasses.fields(RecoverySettings)}
    options = {f.name for f in conversion_options()}
    assert options == {"sinks", "slope_scale", "slopes", "rotary_max_wavelength", "rotary_knee", "rotary_stretch",
                       "rotary_interpolation", "rotary_window", "rotary_window_stretch", "position_mean",
                       "table_max_wavelength"}  # fmt: skip
    assert options <= set(fields), "the conversion options reach recovery as settings"
    # hf-alibi recover: one flag per setting but the few without, in both spellings
    actions = {a.dest: a for a in _recover_actions()}
    assert set(actions) - JOB_ARGUMENTS == set(fields) - NO_FLAG
    for name in set(fields) - NO_FLAG:
        spellings = {"--" + name.replace("_", "-"), "--" + name}
        assert spellings <= set(actions[name].option_strings), name  # --fit-slopes also has --no-fit-slopes
    # run_clm.py: --distill_<name> for the DistillationTrainer's settings, with the declaration's defaults
    run_clm = _run_clm()
    distill = {f.name: f for f in dataclasses.fields(run_clm.ModelArguments) if f.name.startswith("distill_")}
    assert set(distill) - {"distill_from_original"} == {"distill_" + name for name in DISTILL}
    assert {n: distill["distill_" + n].default for n in DISTILL} == {
        "lm_weight": 0.0, "temperature": 1.0, "hidden_layers": "last", "warm_start_steps": 0,
        "attention_only_steps": 0,
    }  # fmt: skip
    assert DISTILL <= set(inspect.signature(DistillationTrainer.__init__).parameters)
    assert set(RecoverySettings().distillation_arguments()) == DISTILL
    # recover(): the settings object and at most 8 named parameters; every setting a keyword, nothing else
    assert len(inspect.signature(recover).parameters) <= 8
    assert _known_keywords() == set(fields)


def test_flag_defaults_are_the_declarations():
    """No default is written twice: the parsed empty command line is RecoverySettings(), max_eval_length 2048."""
    args = cli.build_parser().parse_args(["recover", "src", "out", "--train_file", "f.txt"])
    assert settings_from_flags(args) == RecoverySettings()
    assert (args.max_eval_length, args.max_steps, args.batch_size, args.preset) == (2048, 500, 8, "pretrained")
    assert args.sinks is None and args.fit_slopes is None  # None: the preset's
    spelled = cli.build_parser().parse_args(
        ["recover", "s", "o", "--train_file", "f", "--max-steps", "3", "--lm_weight", "0.5", "--no-fit-slopes"]
    )
    assert (spelled.max_steps, spelled.lm_weight, spelled.fit_slopes) == (3, 0.5, False)


def test_a_new_field_becomes_a_flag(monkeypatch):
    """The flags are read from the declaration when the parser is built: a setting added there is a flag."""
    import argparse

    from hf_alibi.recover import settings as declared

    extra = dataclasses.field(default=7, metadata={"help": "h", "flag": {"type": int}, "check": None,
                                                   "distill": False, "conversion": False})  # fmt: skip
    extra.name, extra.type = "new_setting", "int"
    declared_flags = declared.flag_settings()
    monkeypatch.setattr(declared, "flag_settings", lambda: (*declared_flags, extra))
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    assert parser.parse_args(["--new-setting", "3"]).new_setting == 3
    assert parser.parse_args(["--new_setting", "4"]).new_setting == 4 and parser.parse_args([]).new_setting == 7


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(max_steps=0), "max_steps must be an integer >= 1, got 0 (--max_steps)."),
        (dict(batch_size=2.5), "batch_size must be an integer >= 1, got 2.5 (--batch_size)."),
        (dict(lora_rank=-1), "lora_rank must be an integer >= 0, got -1 (--lora_rank)."),
        (dict(learning_rate=float("inf")), "learning_rate must be a finite number > 0, got inf (--learning_rate)."),
        (dict(lm_weight=1.5), "lm_weight must be between 0 and 1 (the share of the LM loss), got 1.5 (--lm_weight)."),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0, got -0.1 (--weight_decay)."),
        (dict(hidden_layers="first"), "hidden_layers must be one of ('last', 'all'), got 'first'."),
        (dict(preset="fast"), "Unknown preset 'fast'; known: ['long', 'paper', 'pretrained'] (--preset)."),
        (dict(eval_fraction=1.0), "eval_fraction must be between 0 and 1, got 1.0."),
        (dict(eval_factors=(1, 0)), "eval_factors must be integers >= 1 (multiples of length), got (1, 0)."),
    ],
)
def test_each_setting_is_checked_when_the_settings_are_made(bad, message):
    with pytest.raises(ValueError) as refused:
        RecoverySettings(**bad)
    assert str(refused.value) == message
    with pytest.raises(ValueError) as again:  # the same check through recover()'s keywords, before any work
        recover(tiny_gpt2(), random_ids(1, 100).reshape(-1), **bad)
    assert str(again.value) == message


def test_checks_across_settings_and_the_teacher_length():
    settings = RecoverySettings(length=16, max_eval_length=8)  # each field fine on its own
    with pytest.raises(ValueError, match="max_eval_length 8 is shorter than the training length 16"):
        check_settings(32, settings)
    with pytest.raises(ValueError, match="save_steps needs output_dir"):
        check_settings(32, RecoverySettings(save_steps=2))
    assert check_settings(32, RecoverySettings(save_steps=2, output_dir="ckpt")).save_steps == 2
    with pytest.raises(TypeError, match="settings must be a RecoverySettings, got dict"):
        check_settings(32, {"length": 16})


def test_run_clm_checks_its_distill_settings_as_declared():
    run_clm = _run_clm()
    message = r"^distill_temperature must be a finite number > 0, got 0.0 \(--distill_temperature\).$"
    with pytest.raises(ValueError, match=message):
        run_clm.ModelArguments(model_name_or_path="x", alibi=True, distill_from_original=True, distill_temperature=0.0)
    with pytest.raises(ValueError, match=r"^distill_hidden_layers must be one of \('last', 'all'\), got 'first'.$"):
        run_clm.ModelArguments(distill_hidden_layers="first")
    arguments = run_clm.ModelArguments(model_name_or_path="x", alibi=True, distill_from_original=True,
                                       distill_lm_weight=0.25, distill_hidden_layers="all")  # fmt: skip
    assert (arguments.distill_lm_weight, arguments.distill_hidden_layers) == (0.25, "all")


def test_the_settings_object_the_keywords_and_overrides_train_the_same_student():
    """recover(model, texts, tokenizer, settings) and the keyword form of before give the same weights; keywords
    override the object's fields; the conversion options reach the student's settings."""
    teacher, stream = tiny_gpt2(), random_ids(1, 600, seed=8).reshape(-1)
    common = dict(length=16, batch_size=4, learning_rate=3e-3, fit_slopes=False, progress=False)
    by_keywords = recover(teacher, stream, max_steps=2, sinks=2, log=None, **common)
    by_object = recover(teacher, stream, None, RecoverySettings(max_steps=2, sinks=2, **common), log=None)
    overridden = recover(
        teacher, stream, None, RecoverySettings(max_steps=5, sinks=2, **common), max_steps=2, log=None
    )
    expected = by_keywords.student.state_dict()
    for result in (by_object, overridden):
        assert [h["step"] for h in result.history] == [0, 2]
        assert all(torch.equal(expected[k], v) for k, v in result.student.state_dict().items())
    trained = hf_alibi.get_settings(by_object.student.config)
    assert (trained.sinks, trained.slope_scale) == (2, 0.01)  # sinks given, the preset's scale
    assert not torch.equal(expected["transformer.h.0.attn.c_attn.weight"], teacher.transformer.h[0].attn.c_attn.weight)


FIT_AND_SLOPES = (
    "--fit-slopes computes the slopes: drop --slope-scale (slope_scale), or fit none (recover: --no-fit-slopes, "
    "fit_slopes=False)."
)


def test_the_paper_preset_has_one_spelling():
    """'paper' and None name the same conversion: the settings hold None, so nothing downstream asks again."""
    assert RecoverySettings(preset="paper").preset is None
    assert RecoverySettings(preset="paper") == RecoverySettings(preset=None)
    assert RecoverySettings().preset == "pretrained"


def test_fitting_given_slopes_is_refused_in_one_line_before_any_work(gpt2_src, tmp_path, monkeypatch):
    """convert's --fit-slopes and recover's fit_slopes refuse explicit slopes with the same line; recover refuses it
    (and a fit without the preset) with its other settings, before the teacher or the tokenizer loads."""
    from hf_alibi.convert.checkpoint import convert_checkpoint
    from hf_alibi.hub.checkpoints import CheckpointError
    from hf_alibi.recover.checkpoint import AutoTokenizer, recover_checkpoint

    with pytest.raises(ValueError) as refused:
        check_settings(32, fit_slopes=True, slope_scale=0.1)
    assert str(refused.value) == FIT_AND_SLOPES
    with pytest.raises(ValueError, match=r"^fit_slopes needs the pretrained preset .*drop preset='paper'.$"):
        check_settings(32, fit_slopes=True, preset="paper")
    assert check_settings(32, fit_slopes=True).fit_slopes is True  # with the preset: fine

    def refuse(*args, **kwargs):
        raise AssertionError("loaded something before the settings were checked")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    text = tmp_path / "notes.txt"
    text.write_text("w1 w2 w3 " * 200)
    with pytest.raises(CheckpointError) as refused:
        recover_checkpoint(str(gpt2_src), tmp_path / "out", text, fit_slopes=True, slope_scale=0.1)
    assert str(refused.value) == FIT_AND_SLOPES
    with pytest.raises(CheckpointError) as refused:  # convert: the same line
        convert_checkpoint(str(gpt2_src), tmp_path / "out", fit_file=str(text), slope_scale=0.1)
    assert str(refused.value) == FIT_AND_SLOPES
    assert not (tmp_path / "out").exists()


def test_recover_checkpoint_plans_the_conversion_once(gpt2_src, tmp_path, monkeypatch):
    """The plan made from SRC's config.json before anything loads is the one the student is converted with."""
    from hf_alibi.convert import checkpoint as converting
    from hf_alibi.recover import api
    from hf_alibi.recover.checkpoint import recover_checkpoint

    planned = []

    def counting(plan_conversion):
        def plan(*args, **kwargs):
            planned.append(kwargs)
            return plan_conversion(*args, **kwargs)

        return plan

    monkeypatch.setattr(converting, "plan_conversion", counting(converting.plan_conversion))
    monkeypatch.setattr(api, "plan_conversion", counting(api.plan_conversion))
    text = tmp_path / "notes.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(600)))
    out, result = recover_checkpoint(
        str(gpt2_src), tmp_path / "out", text, max_steps=1, batch_size=2, length=16, sinks=2, fit_slopes=False,
        progress=False,
    )  # fmt: skip
    assert len(planned) == 1 and planned[0]["sinks"] == 2
    assert hf_alibi.get_settings(result.student.config).sinks == 2
