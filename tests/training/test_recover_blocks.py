"""recover()'s training blocks and agreement inputs carry an encoder's special tokens ([CLS] ... [SEP]).

An encoder always read ``[CLS] text [SEP]``; blocks cut from the middle of a token stream are inputs it never
saw. The references here are token lists and cosines written out by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import VOCAB, tiny_bert, tiny_gpt2

import hf_alibi
import hf_alibi.recover.api as recover_api
from hf_alibi.recover import embedding_cosine, recover, token_stream
from hf_alibi.recover.blocks import framed_blocks, special_frame

CLS, SEP = 1, 2


def make_tokenizer(template: str | None):
    """A word-level tokenizer (w3 .. w96 are ids 3 .. 96) whose post-processor adds ``template``'s tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "[CLS]": CLS, "[SEP]": SEP, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if template is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>", cls_token="[CLS]", sep_token="[SEP]"
    )


@pytest.mark.parametrize(
    "template, expected",
    [("[CLS] $A [SEP]", ((CLS,), (SEP,))), ("$A [SEP]", ((), (SEP,))), ("[CLS] $A", ((CLS,), ())), (None, ((), ()))],
)
def test_special_frame_is_what_the_tokenizer_puts_around_a_text(template, expected):
    tokenizer = make_tokenizer(template)
    assert special_frame(tokenizer) == expected
    assert special_frame(None) == ((), ())


def test_framed_blocks_are_consecutive_pieces_between_the_frame():
    stream = torch.arange(10, 21)  # 11 tokens: 3 whole pieces of 3, two tokens left over
    expected = [[CLS, 10, 11, 12, SEP], [CLS, 13, 14, 15, SEP], [CLS, 16, 17, 18, SEP]]
    assert framed_blocks(stream, 5, ((CLS,), (SEP,))).tolist() == expected
    assert framed_blocks(stream, 4, ((), (SEP,))).tolist() == [[10, 11, 12, SEP], [13, 14, 15, SEP], [16, 17, 18, SEP]]
    assert framed_blocks(stream, 5).tolist() == [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    assert framed_blocks(stream[:2], 5, ((CLS,), (SEP,))).shape == (0, 5)
    with pytest.raises(ValueError, match="length 2 leaves no room for text between the tokenizer's 2 special"):
        framed_blocks(stream, 2, ((CLS,), (SEP,)))


def test_embedding_cosine_frames_every_input():
    teacher = tiny_bert()
    student = hf_alibi.patch_model(copy.deepcopy(teacher))
    stream = torch.arange(3, 3 + 30) % (VOCAB - 3) + 3  # 30 text tokens
    pieces = stream[:28].view(4, 7)  # length 9 = 7 text tokens + [CLS] + [SEP]; factor 2 takes 2 pieces

    def pooled(model, rows):
        framed = [[CLS, *row, SEP] for row in rows]
        with torch.no_grad():
            return model(input_ids=torch.tensor(framed), output_hidden_states=True).hidden_states[-1].mean(1)

    student_emb = pooled(student, [pieces[0].tolist() + pieces[1].tolist(), pieces[2].tolist() + pieces[3].tolist()])
    teacher_emb = pooled(teacher, pieces.tolist()).view(2, 2, -1).mean(1)
    expected = torch.nn.functional.cosine_similarity(student_emb, teacher_emb).mean().item()
    got = embedding_cosine(student, teacher, stream, 9, factor=2, frame=((CLS,), (SEP,)))
    assert got == pytest.approx(expected, abs=1e-6)
    unframed = embedding_cosine(student, teacher, stream, 9, factor=2)
    assert unframed != pytest.approx(expected, abs=1e-4), "the frame must change what the models read"


def _recover_recording(model, monkeypatch, steps: int):
    """recover() on ``model`` with a [CLS] ... [SEP] tokenizer; the result, the blocks it trained on, the stream."""
    seen: list[torch.Tensor] = []

    class Recording(recover_api.DistillationTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append(inputs["input_ids"].detach().clone())
            return super().compute_loss(model, inputs, *args, **kwargs)

    monkeypatch.setattr(recover_api, "DistillationTrainer", Recording)
    tokenizer = make_tokenizer("[CLS] $A [SEP]")
    generator = torch.Generator().manual_seed(3)
    texts = [" ".join(f"w{i}" for i in row.tolist()) for row in torch.randint(3, VOCAB, (60, 20), generator=generator)]
    result = recover(
        model, texts, tokenizer, length=16, max_steps=steps, batch_size=4, eval_texts=texts[-4:], seed=0,
        eval_factors=(1,), progress=False, log=None,
    )  # fmt: skip
    return result, torch.cat(seen), token_stream(texts, tokenizer).tolist()


def test_an_encoder_recovers_on_framed_blocks(monkeypatch):
    result, rows, stream = _recover_recording(tiny_bert(), monkeypatch, steps=3)
    assert rows.shape == (12, 16)
    assert (rows[:, 0] == CLS).all() and (rows[:, -1] == SEP).all()
    # the text between the frames: 14-token pieces of the stream (texts joined by [SEP]), in some order
    pieces = {tuple(stream[i : i + 14]) for i in range(0, len(stream) - 13, 14)}
    assert all(tuple(row[1:-1].tolist()) in pieces for row in rows)
    assert result.info["special_tokens_per_block"] == 2


def test_a_causal_lm_recovers_on_the_stream_as_it_is(monkeypatch):
    result, rows, stream = _recover_recording(tiny_gpt2(), monkeypatch, steps=2)
    blocks = {tuple(stream[i : i + 16]) for i in range(0, len(stream) - 15, 16)}
    assert all(tuple(row.tolist()) in blocks for row in rows)
    assert result.info["special_tokens_per_block"] == 0
