"""The pretrained options' one declaration (a field of AlibiSettings made with core.settings.option): each reaches
``patch_model``, ``recover``, both CLIs, ``hf-alibi info`` and config.json from it alone; and the presets read from
it: their bounds from the original length, ``preset="paper"`` the paper's method."""

from __future__ import annotations

import pytest
import torch
from tiny import random_ids, tiny_gpt2

import hf_alibi
from hf_alibi.convert.patch import PRESETS

# ------------------------------------------------------------------ one declaration of the options


def test_every_declared_option_reaches_patch_model_both_clis_info_and_config_json():
    """An option is declared once (a field of AlibiSettings made with core.settings.option); everything else is
    read from the declaration. Each declared option, given a value that is not its default, reaches each place."""
    import dataclasses
    import inspect

    from hf_alibi import cli
    from hf_alibi.core.settings import AlibiSettings, conversion_options, describe_options, slope_list
    from hf_alibi.recover import RecoverySettings

    options = conversion_options()
    assert [f.name for f in options] == [
        "sinks", "slope_scale", "slopes", "rotary_max_wavelength", "rotary_knee", "rotary_stretch",
        "rotary_interpolation", "rotary_window", "rotary_window_stretch", "position_mean", "table_max_wavelength",
    ]  # fmt: skip
    samples = {int: "3", float: "3.5", slope_list: "0.5,0.25,0.125,1"}
    commands = ["convert SRC OUT", "recover SRC OUT --train-file F"]
    for option in options:
        for function in (hf_alibi.patch_model, hf_alibi.convert.patch.settings_for):
            parameter = inspect.signature(function).parameters[option.name]
            assert (parameter.kind, parameter.default) == (inspect.Parameter.KEYWORD_ONLY, None), function
        # recover() takes its settings as one object, the options among its fields, and by keyword
        assert {f.name: f.default for f in dataclasses.fields(RecoverySettings)}[option.name] is None
        assert option.name in inspect.signature(RecoverySettings).parameters
        text = samples[option.metadata["parse"]]
        for command in commands:
            flag = "--" + option.name.replace("_", "-")
            args = cli.build_parser().parse_args([*command.split(), flag, text])
            assert getattr(args, option.name) == option.metadata["parse"](text), (command, flag)
        assert option.name in AlibiSettings("gpt2", 4).to_dict()  # config.json's config.alibi
        assert option.metadata["describe"] is not None and option.metadata["help"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'sink'"):
        hf_alibi.patch_model(tiny_gpt2(), sink=1)  # a misspelled option is no silent no-op
    assert set(PRESETS["pretrained"]) <= {f.name for f in options}
    rotary_row = hf_alibi.get_architecture("llama").to_dict()
    encoder_row = hf_alibi.get_architecture("bert").to_dict()
    given = AlibiSettings("llama", 4, architecture=rotary_row, sinks=3, slope_scale=0.5, rotary_max_wavelength=64)
    assert (
        describe_options(given) == "sinks: 3; slopes: the paper's x 0.5; rotary frequencies: kept up to wavelength 64"
    )
    given = AlibiSettings("bert", 4, "symmetric", encoder_row, slopes=[1, 2, 3, 4], position_mean=8)
    assert describe_options(given) == (
        "sinks: 0; slopes: explicit (--slopes); position table's mean (first 8 rows) kept in the embeddings"
    )


def test_preset_lengths_are_the_original_length_not_the_table_size():
    """RoBERTa's table has max_position_embeddings = 514 rows for 512 positions (positions.original_length): the
    preset's table bound is 1x the original length, 512 (it read max_position_embeddings itself, 514)."""
    from transformers import LlamaConfig, RobertaConfig

    from hf_alibi.convert.patch import settings_for

    roberta = RobertaConfig(max_position_embeddings=514, pad_token_id=1, num_attention_heads=4, hidden_size=32)
    assert settings_for(roberta, preset="pretrained").table_max_wavelength == 512.0
    llama = LlamaConfig(max_position_embeddings=2048, num_attention_heads=4, hidden_size=32)
    assert settings_for(llama, preset="pretrained").rotary_max_wavelength == 1024 * 2048.0


def test_preset_paper_is_the_papers_method_everywhere():
    """recover took preset='paper' and patch_model refused it: one set of names."""
    paper = hf_alibi.patch_model(tiny_gpt2(), preset="paper")
    plain = hf_alibi.patch_model(tiny_gpt2())
    assert hf_alibi.get_settings(paper.config) == hf_alibi.get_settings(plain.config)
    assert hf_alibi.get_settings(paper.config).sinks == 0 and hf_alibi.get_settings(paper.config).slope_scale == 1.0
    ids = random_ids(1, 40)
    with torch.no_grad():
        torch.testing.assert_close(paper(ids).logits, plain(ids).logits, rtol=0, atol=0)
