"""RMSNorm: known answers, invariants, and the reason for the float32 upcast."""

import math

import pytest
import torch

from llama_mini import RMSNorm

EPS = 1e-6


def rms_norm_float64(x, weight, eps=EPS, n_rms=None):
    """The paper's eq. 4 (eq. 8 with n_rms), by hand, in float64."""
    x = x.double()
    x_rms = x[..., :n_rms] if n_rms else x
    return x / torch.sqrt(x_rms.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def random_norm(dim=256, p=1.0, seed=0):
    torch.manual_seed(seed)
    norm = RMSNorm(dim, EPS, p=p)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    return norm


def test_matches_float64_hand_computation_and_torch_rmsnorm():
    norm = random_norm()
    x = torch.randn(4, 7, 256)
    reference = torch.nn.RMSNorm(256, eps=EPS)
    reference.weight.data.copy_(norm.weight)
    assert torch.allclose(norm(x).double(), rms_norm_float64(x, norm.weight), atol=1e-6, rtol=1e-5)
    assert torch.allclose(norm(x), reference(x), atol=1e-6, rtol=1e-5)


def test_output_rms_is_one_with_unit_weight():
    x = torch.randn(32, 512) * 3 + 1
    y = RMSNorm(512, EPS)(x)
    assert torch.allclose(y.pow(2).mean(-1).sqrt(), torch.ones(32), atol=1e-4)


@pytest.mark.parametrize("c", [0.1, 0.5, 7.0, 1e4])
def test_invariant_to_input_scale(c):
    """Exact up to eps, which is negligible once mean(x^2) >> eps."""
    norm, x = random_norm(), torch.randn(8, 256)
    assert torch.allclose(norm(c * x), norm(x), atol=1e-4, rtol=1e-4)


def test_zero_input_gives_zeros_not_nan():
    y = random_norm()(torch.zeros(3, 256))
    assert torch.equal(y, torch.zeros(3, 256))


@pytest.mark.parametrize("magnitude", [1e6, 1e-6])
def test_extreme_magnitudes_stay_finite_and_correct(magnitude):
    norm = random_norm()
    x = torch.randn(4, 256) * magnitude
    y = norm(x)
    assert torch.isfinite(y).all()
    assert torch.allclose(y.double(), rms_norm_float64(x, norm.weight), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_equals_float32_result_cast_once(dtype):
    norm = RMSNorm(4096, EPS)
    x = (torch.randn(64, 4096) * 4).to(dtype)
    expected = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    assert torch.equal(norm.to(dtype)(x), expected)


def test_half_precision_with_weight_rounds_like_meta():
    norm = random_norm(dim=1024).to(torch.bfloat16)
    x = torch.randn(16, 1024, dtype=torch.bfloat16)
    fp32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.equal(norm(x), fp32.to(torch.bfloat16) * norm.weight)


def test_naive_bfloat16_computation_differs_from_cast_once():
    """Why the upcast exists: computing the statistic in bf16 rounds several times over."""
    x = (torch.randn(64, 4096) * 4).to(torch.bfloat16)
    naive = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    cast_once = RMSNorm(4096, EPS).to(torch.bfloat16)(x)
    exact = rms_norm_float64(x, torch.ones(4096))
    assert not torch.equal(naive, cast_once)
    assert (naive.double() - exact).abs().mean() > (cast_once.double() - exact).abs().mean()


def test_float64_input_is_normalised_in_float32_as_metas_code_does():
    norm = random_norm(dim=64).double()
    x = torch.randn(5, 64, dtype=torch.float64)
    statistic = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.equal(norm(x), statistic.double() * norm.weight)


@pytest.mark.parametrize("p", [1.0, 0.25])
def test_gradients_are_a_float64_references_within_float32_rounding(p):
    """The reference's gradients are the true derivatives (gradcheck, in float64); RMSNorm's,
    computed in float32 as Meta's code computes, match them within float32 rounding."""
    norm = random_norm(dim=16, p=p)
    n_rms = norm.n_rms if p < 1 else None
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    weight = norm.weight.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: rms_norm_float64(x, w, n_rms=n_rms), (x, weight))
    dy = torch.randn(3, 16, dtype=torch.float64)
    expected = torch.autograd.grad(rms_norm_float64(x, weight, n_rms=n_rms), (x, weight), dy)
    x32 = x.detach().float().requires_grad_()
    got = torch.autograd.grad(norm(x32), (x32, norm.weight), dy.float())
    for name, g, e in zip(("dx", "dweight"), got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-6, msg=name)


def test_partial_with_p_one_equals_full():
    x = torch.randn(5, 128)
    assert torch.equal(random_norm(128, p=1.0)(x), random_norm(128)(x))


@pytest.mark.parametrize("dim, p", [(256, 0.0625), (100, 0.3)])
def test_partial_uses_first_ceil_np_elements(dim, p):
    norm = random_norm(dim, p=p)
    n_rms = math.ceil(dim * p)
    assert norm.n_rms == n_rms
    x = torch.randn(6, dim)
    assert torch.allclose(norm(x).double(), rms_norm_float64(x, norm.weight, n_rms=n_rms), atol=1e-5)
    x_changed_tail = x.clone()
    x_changed_tail[:, n_rms:] *= 10  # the statistic ignores everything past n_rms
    assert torch.allclose(norm(x_changed_tail)[:, :n_rms], norm(x)[:, :n_rms])
