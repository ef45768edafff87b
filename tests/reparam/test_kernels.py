"""reparam.kernels: the kernel a branch convolution runs is chosen from its shapes alone, computes
the same convolution as F.conv2d (float64, outputs and every gradient), and steps aside for
tracers, dispatch modes and hooks; the anchor keeps the host conv's kernel, so expansion stays
bit-exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import reparam
from reparam import kernels

torch.set_default_dtype(torch.float32)


def _grads(fn, x, w, b):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    w = w.detach().clone().requires_grad_(True)
    b = None if b is None else b.detach().clone().requires_grad_(True)
    out = fn(x, w, b)
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    out.backward(g)
    return out.detach(), [t.grad for t in (x, w, b) if t is not None and t.grad is not None]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3), c=st.integers(1, 20), o=st.integers(1, 20), h=st.integers(5, 11), w=st.integers(5, 11),
    kh=st.sampled_from([1, 3]), kw=st.sampled_from([1, 3]), stride=st.integers(1, 2), pad=st.integers(0, 1),
    bias=st.booleans(), xgrad=st.booleans(), crop=st.booleans(),
)
def test_same_convolution_as_f_conv2d_in_float64(n, c, o, h, w, kh, kw, stride, pad, bias, xgrad, crop) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + c * 37 + o)
    base = torch.randn(n, c, h + 2, w + 2, generator=gen, dtype=torch.float64)
    x = base[..., 1:-1, 2:] if crop else base[..., 1:-1, 1:-1]  # a cropped window is a strided view
    x.requires_grad_(xgrad)
    wt = torch.randn(o, c, kh, kw, generator=gen, dtype=torch.float64)
    bs = torch.randn(o, generator=gen, dtype=torch.float64) if bias else None
    ref, ref_g = _grads(lambda a, b_, c_: F.conv2d(a, b_, c_, stride, pad), x, wt, bs)
    out, out_g = _grads(lambda a, b_, c_: kernels.conv2d(a, b_, c_, stride, pad), x, wt, bs)
    assert out.shape == ref.shape
    assert _rel(out, ref) <= 1e-12
    assert len(out_g) == len(ref_g)
    for a, b_ in zip(out_g, ref_g):
        assert _rel(a, b_) <= 1e-12


def test_the_choice_follows_the_documented_rule() -> None:
    narrow = torch.empty(2, 6, 8, 8)
    one = torch.empty(2, 1, 8, 8)
    wide = torch.empty(2, 32, 8, 8)
    pref = kernels.native_conv_preferred
    assert pref(narrow, torch.empty(16, 6, 1, 1))           # 1×1, 6 input channels
    assert pref(narrow, torch.empty(16, 6, 1, 5))           # 1×K
    assert pref(narrow, torch.empty(16, 6, 5, 1), 2, 1)      # K×1, strided and padded
    assert not pref(narrow, torch.empty(16, 6, 5, 5))       # K×K, more than one input channel
    assert not pref(one, torch.empty(6, 1, 5, 5))           # one input channel, but no input gradient
    assert pref(one.clone().requires_grad_(), torch.empty(6, 1, 5, 5))
    assert not pref(wide, torch.empty(32, 32, 1, 1))        # wide: oneDNN
    assert pref(wide, torch.empty(8, 32, 1, 1))             # narrow output
    assert not pref(narrow, torch.empty(6, 3, 1, 1), groups=2)
    assert not pref(narrow, torch.empty(16, 6, 1, 1), dilation=2)
    assert not pref(narrow, torch.empty(16, 6, 1, 1), padding="same")
    assert not pref(narrow.double(), torch.empty(16, 6, 1, 1))  # dtypes differ: F.conv2d raises as it would
    assert not pref(narrow.to(torch.bfloat16), torch.empty(16, 6, 1, 1, dtype=torch.bfloat16))
    assert not pref(nn.Parameter(narrow), torch.empty(16, 6, 1, 1))  # a tensor subclass
    # other devices keep F.conv2d (the GPU path is unchanged)
    assert not pref(torch.empty(2, 6, 8, 8, device="meta"), torch.empty(16, 6, 1, 1, device="meta"))
    with kernels.native_convs(False):
        assert not kernels.native_convs_enabled()
        assert not pref(narrow, torch.empty(16, 6, 1, 1))
    assert kernels.native_convs_enabled()


def test_the_native_kernel_runs_where_chosen_and_onednn_elsewhere() -> None:
    x = torch.randn(2, 6, 8, 8)
    out = kernels.conv2d(x, torch.randn(16, 6, 1, 1, requires_grad=True))
    assert type(out.grad_fn).__name__ == "SlowConv2DBackward0"
    out = kernels.conv2d(x, torch.randn(16, 6, 3, 3, requires_grad=True))
    assert type(out.grad_fn).__name__ == "ConvolutionBackward0"


def test_tracers_and_dispatch_modes_see_f_conv2d() -> None:
    x = torch.randn(2, 6, 8, 8)
    w = torch.randn(16, 6, 1, 1)
    with FlopCounterMode(display=False) as counter:
        kernels.conv2d(x, w)
    assert counter.get_total_flops() == 2 * 2 * 16 * 6 * 8 * 8  # counted: F.conv2d ran
    traced = torch.jit.trace(lambda a: kernels.conv2d(a, w), (x,))
    assert "aten::_convolution" in str(traced.graph) or "aten::conv2d" in str(traced.graph)
    assert torch.allclose(traced(x), F.conv2d(x, w), rtol=1e-5, atol=1e-6)


def test_run_conv_lets_hooked_modules_run_themselves() -> None:
    conv = nn.Conv2d(6, 16, 1, bias=False)
    x = torch.randn(2, 6, 8, 8)
    seen: list[int] = []
    handle = conv.register_forward_hook(lambda m, a, o: seen.append(o.shape[1]))
    out = kernels.run_conv(conv, x)
    handle.remove()
    assert seen == [16]
    assert torch.allclose(out, conv(x), rtol=0, atol=1e-6)
    assert type(kernels.run_conv(conv, x.requires_grad_()).grad_fn).__name__ == "SlowConv2DBackward0"


class _Net(nn.Module):
    def __init__(self, kernel: tuple[int, int], cin: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, 6, kernel, bias=False)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).relu()


@pytest.mark.parametrize("kernel,cin", [((5, 5), 1), ((1, 5), 6), ((3, 1), 4)])
def test_expansion_stays_bit_exact_where_the_native_kernel_would_be_chosen(kernel, cin) -> None:
    """The anchor runs the host conv's kernel: the zero-γ expansion of a conv whose shape the
    native kernel would take (one input channel with an input gradient; a narrow 1×K or K×1) still
    equals the plain model bit for bit in training mode, outputs and input gradients."""
    torch.manual_seed(0)
    plain = _Net(kernel, cin)
    big = reparam.expand(copy.deepcopy(plain))
    assert any(len(b.branch_names) > 1 for _, b in reparam.iter_blocks(big))
    plain.train(), big.train()
    x1 = torch.randn(4, cin, 12, 12, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = plain(x1), big(x2)
    assert torch.equal(y1, y2)
    y1.sum().backward(), y2.sum().backward()
    assert torch.equal(x1.grad, x2.grad)


def test_expanded_lenet_trains_the_same_function_with_either_kernel_in_float64() -> None:
    """A training step of an expanded LeNet-5 block structure with the kernel choice on and off:
    the same loss, gradients and running statistics to float64 rounding."""
    from models.lenet import LeNet5

    torch.manual_seed(1)
    base = reparam.expand(LeNet5(num_classes=10, in_channels=1).double())
    x = torch.randn(8, 1, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 10, (8,))
    reparam.testing.perturb_(base, torch.Generator().manual_seed(2))
    runs = []
    for enabled in (True, False):
        model = copy.deepcopy(base).train()
        with kernels.native_convs(enabled):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        stats = {n: b.clone() for n, b in model.named_buffers() if "running" in n}
        runs.append((loss.detach(), grads, stats))
    (l1, g1, s1), (l2, g2, s2) = runs
    assert _rel(l1, l2) <= 1e-12
    assert g1.keys() == g2.keys() and len(g1) > 10
    for k in g1:
        assert _rel(g1[k], g2[k]) <= 1e-9, k
    for k in s1:
        assert _rel(s1[k], s2[k]) <= 1e-12, k


# --------------------------------------------------------------------------------------------
# taps that only meet padding


@settings(max_examples=120, deadline=None)
@given(
    h=st.integers(1, 6), w=st.integers(1, 6), kh=st.integers(1, 5), kw=st.integers(1, 5), sh=st.integers(1, 3),
    sw=st.integers(1, 3), ph=st.integers(0, 3), pw=st.integers(0, 3), dil=st.integers(1, 2), groups=st.sampled_from([1, 2]),
    bias=st.booleans(),
)
def test_dropping_dead_taps_is_the_same_convolution_in_float64(h, w, kh, kw, sh, sw, ph, pw, dil, groups, bias) -> None:
    """Small maps, wide padding: whichever taps are dropped, output and every gradient are F.conv2d's
    (the dropped taps' weight gradient exactly zero, as it is there)."""
    if h + 2 * ph < dil * (kh - 1) + 1 or w + 2 * pw < dil * (kw - 1) + 1:
        return  # no output window
    gen = torch.Generator().manual_seed(h * 1000 + w * 100 + kh * 10 + kw)
    x = torch.randn(2, 2 * groups, h, w, generator=gen, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(4, 2, kh, kw, generator=gen, dtype=torch.float64)
    bs = torch.randn(4, generator=gen, dtype=torch.float64) if bias else None
    args = ((sh, sw), (ph, pw), (dil, dil), groups)
    ref, ref_g = _grads(lambda a, b_, c_: F.conv2d(a, b_, c_, *args), x, wt, bs)
    out, out_g = _grads(lambda a, b_, c_: kernels.conv2d(a, b_, c_, *args), x, wt, bs)
    assert out.shape == ref.shape
    assert _rel(out, ref) <= 1e-12
    for a, b_ in zip(out_g, ref_g, strict=True):
        assert _rel(a, b_) <= 1e-12
    cropped, _ = kernels.crop_dead_taps(x, wt, *args[:3])
    if cropped.shape != wt.shape:  # what was dropped read only padding: its gradient is exactly 0 in F.conv2d
        grad_w = ref_g[1]
        kept = torch.zeros_like(grad_w, dtype=torch.bool)
        r = kernels._live_taps(h, kh, sh, ph, dil)
        c = kernels._live_taps(w, kw, sw, pw, dil)
        r0, r1 = (r[0], r[1]) if r is not None else (0, kh - 1)
        c0, c1 = (c[0], c[1]) if c is not None else (0, kw - 1)
        kept[:, :, r0:r1 + 1, c0:c1 + 1] = True
        assert torch.all(grad_w[~kept] == 0)


@pytest.mark.parametrize(
    "size, kernel, stride, padding, expect_kernel, expect_padding",
    [
        ((1, 1), 3, 1, 1, (1, 1), (0, 0)),  # a 3×3 conv on a 1×1 map reads its centre only
        ((2, 2), 3, 2, 1, (2, 2), (0, 0)),  # stride 2 from 2×2 to 1×1: the lower-right 2×2 taps
        ((1, 4), 3, 1, 1, (1, 3), (0, 1)),  # one row: the middle row of the kernel
        ((2, 2), 3, 1, 1, (3, 3), (1, 1)),  # every tap meets the map somewhere: unchanged
        ((1, 1), 7, 1, 3, (1, 1), (0, 0)),
        ((3, 3), 5, 1, 1, (3, 3), (0, 0)),  # one window: its outer ring of taps reads padding alone
        ((3, 3), 3, 1, 1, (3, 3), (1, 1)),
    ],
)
def test_dead_taps_dropped_where_documented(size, kernel, stride, padding, expect_kernel, expect_padding) -> None:
    x = torch.zeros(1, 8, *size)
    w = torch.zeros(8, 8, kernel, kernel)
    cropped, pad = kernels.crop_dead_taps(x, w, stride, padding, 1)
    assert tuple(cropped.shape[2:]) == expect_kernel
    assert tuple(kernels._pair(pad)) == expect_padding


def test_no_dead_tap_dropping_under_a_tracer() -> None:
    """A traced graph must not carry the kernel of one input size: traced on a 1×1 map (where only the
    centre tap is live), it still computes the full 3×3 convolution on a larger map."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, 3, 3, generator=gen, dtype=torch.float64)
    traced = torch.jit.trace(lambda a: kernels.conv2d(a, w, None, 1, 1), (torch.randn(1, 4, 1, 1, dtype=torch.float64),),
                             check_trace=False)
    x = torch.randn(2, 4, 5, 5, generator=gen, dtype=torch.float64)
    assert _rel(traced(x), F.conv2d(x, w, None, 1, 1)) <= 1e-12
