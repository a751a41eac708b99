import math

import pytest
import torch
from reference import explicit_bias, fairseq_slopes
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from hf_alibi import alibi_bias, get_slopes, get_slopes_list

PAPER_TABLE = {
    8: [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625],
    12: [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
         0.70710678, 0.35355339, 0.17677670, 0.08838835],
    6: [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125],
    16: [2 ** (-0.5 * k) for k in range(1, 17)],
}  # fmt: skip


@pytest.mark.parametrize("n", range(1, 65))
def test_slopes_match_fairseq(n):
    assert get_slopes_list(n) == pytest.approx(fairseq_slopes(n), rel=1e-12)
    assert get_slopes(n).dtype == torch.float32


@pytest.mark.parametrize("n", sorted(PAPER_TABLE))
def test_slopes_match_paper_table(n):
    assert get_slopes_list(n) == pytest.approx(PAPER_TABLE[n], abs=1e-8)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_slopes_reject_bad_head_counts(bad):
    with pytest.raises(ValueError, match="positive integer"):
        get_slopes_list(bad)


@pytest.mark.parametrize("kind", ["causal", "symmetric", "nonsymmetric"])
@pytest.mark.parametrize("q_len,kv_len", [(5, 5), (1, 6), (3, 7)])
def test_bias_matches_explicit_loops(kind, q_len, kv_len):
    n = 6
    got = alibi_bias(kind, q_len, kv_len, get_slopes(n))[0].double()
    want = explicit_bias(kind, fairseq_slopes(n), q_len, kv_len)
    masked = torch.isinf(want)
    assert torch.equal(got <= torch.finfo(torch.float32).min / 2, masked)
    torch.testing.assert_close(got[~masked], want[~masked], rtol=0, atol=1e-5)


def test_learned_bias_matches_explicit_loops():
    left, right = [-0.1, -0.7, -0.3], [-0.2, -0.05, -0.9]
    got = alibi_bias("learned", 4, 4, torch.tensor(left), slopes_right=torch.tensor(right))[0].double()
    torch.testing.assert_close(got, explicit_bias("learned", left, 4, 4, right=right), rtol=0, atol=1e-6)


@pytest.mark.parametrize("n_heads", [4, 6, 12])
def test_causal_bias_equals_bloom_up_to_a_row_constant(n_heads):
    length = 9
    bloom = build_alibi_tensor(torch.ones(1, length), n_heads, torch.float32).view(n_heads, 1, length)
    bloom = bloom.expand(n_heads, length, length).double()
    ours = alibi_bias("causal", length, length, get_slopes(n_heads))[0].double()
    allowed = torch.ones(length, length).tril().bool()
    for h in range(n_heads):
        for i in range(length):
            a = ours[h, i][allowed[i]]
            b = bloom[h, i][allowed[i]]
            torch.testing.assert_close(a - a.max(), b - b.max(), rtol=0, atol=1e-5)


def test_bias_sizes_follow_inputs_and_stay_float32():
    slopes = get_slopes(4)
    for length in (1, 7, 300):
        bias = alibi_bias("symmetric", length, length, slopes)
        assert bias.shape == (1, 4, length, length) and bias.dtype == torch.float32
        assert math.isclose(bias[0, 0, 0, -1].item(), -0.25 * (length - 1), rel_tol=1e-6)
