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


def _channels_last_strides(w: torch.Tensor) -> torch.Tensor:
    """``w`` with the strides ``nn.Module.to(memory_format=torch.channels_last)`` gives a weight, a
    1×1 one's included (``.contiguous(memory_format=…)`` keeps a 1×1 weight's standard strides)."""
    o, c, kh, kw = w.shape
    out = torch.empty_strided(w.shape, (c * kh * kw, 1, kw * c, c), dtype=w.dtype)
    return out.copy_(w)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3), c=st.integers(1, 20), o=st.integers(1, 20), h=st.integers(5, 11), w=st.integers(5, 11),
    kh=st.sampled_from([1, 3]), kw=st.sampled_from([1, 3]), stride=st.integers(1, 2), pad=st.integers(0, 1),
    bias=st.booleans(), xgrad=st.booleans(), crop=st.booleans(), x_last=st.booleans(), w_last=st.booleans(),
)
def test_same_convolution_as_f_conv2d_in_float64(n, c, o, h, w, kh, kw, stride, pad, bias, xgrad, crop, x_last,
                                                 w_last) -> None:
    """Every kernel choice, on inputs and weights in either memory format (a model moved to
    channels-last memory hands its convolutions channels-last weights), computes F.conv2d's output
    and gradients."""
    gen = torch.Generator().manual_seed(n * 1000 + c * 37 + o)
    base = torch.randn(n, c, h + 2, w + 2, generator=gen, dtype=torch.float64)
    if x_last:
        base = base.contiguous(memory_format=torch.channels_last)
    x = base[..., 1:-1, 2:] if crop else base[..., 1:-1, 1:-1]  # a cropped window is a strided view
    x.requires_grad_(xgrad)
    wt = torch.randn(o, c, kh, kw, generator=gen, dtype=torch.float64)
    if w_last:
        wt = _channels_last_strides(wt)
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


# --------------------------------------------------------------------------------------------
# a kernel that covers its whole input: a matrix product


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4), c=st.integers(1, 24), o=st.integers(1, 24), h=st.integers(1, 4), w=st.integers(1, 4),
    stride=st.integers(1, 3), bias=st.booleans(), xgrad=st.booleans(), view=st.booleans(), dead_ring=st.booleans(),
)
def test_a_kernel_covering_its_input_is_the_same_convolution_in_float64(n, c, o, h, w, stride, bias, xgrad, view,
                                                                        dead_ring) -> None:
    """One output position per sample: the product of the flattened input and kernel equals F.conv2d,
    outputs and every gradient; also when the kernel covers the input only once its taps that read
    padding alone are dropped (a 3×3 kernel, padding 1, on a 1×1 map), and on a strided view."""
    gen = torch.Generator().manual_seed(n * 10007 + c * 101 + o * 13 + h * 3 + w)
    if dead_ring:  # a (2h+1)×(2w+1)... kernel with padding reaching the centre only: crops to covering
        kh, kw, pad = 2 * h + 1, 2 * w + 1, (h, w)
        h = w = 1
    else:
        kh, kw, pad = h, w, (0, 0)
    base = torch.randn(n, c, h + 1, w + 1, generator=gen, dtype=torch.float64)
    x = base[..., 1:, 1:] if view else base[..., :h, :w].contiguous()
    x.requires_grad_(xgrad)
    wt = torch.randn(o, c, kh, kw, generator=gen, dtype=torch.float64)
    bs = torch.randn(o, generator=gen, dtype=torch.float64) if bias else None
    ref, ref_g = _grads(lambda a, b_, c_: F.conv2d(a, b_, c_, stride, pad), x, wt, bs)
    out, out_g = _grads(lambda a, b_, c_: kernels.conv2d(a, b_, c_, stride, pad), x, wt, bs)
    assert out.shape == ref.shape == (n, o, 1, 1)
    assert _rel(out, ref) <= 1e-12
    assert len(out_g) == len(ref_g)
    for a, b_ in zip(out_g, ref_g, strict=True):
        assert _rel(a, b_) <= 1e-12
    if dead_ring:  # the taps that read padding alone get an exactly zero gradient, as in F.conv2d
        grad_w = out_g[1] if xgrad else out_g[0]
        ring = torch.ones_like(grad_w, dtype=torch.bool)
        ring[:, :, kh // 2, kw // 2] = False
        assert torch.all(grad_w[ring] == 0)


def test_a_covering_kernel_runs_as_a_matrix_product_where_documented() -> None:
    mm = kernels.matmul_preferred
    x1 = torch.empty(4, 32, 1, 1)
    assert mm(x1, torch.empty(32, 32, 1, 1))
    assert mm(torch.empty(4, 8, 2, 3), torch.empty(16, 8, 2, 3))      # the kernel covers a 2×3 map
    assert mm(x1, torch.empty(32, 32, 1, 1), dilation=2)               # a 1×1 kernel spans 1 at any dilation
    assert not mm(torch.empty(4, 8, 3, 3), torch.empty(16, 8, 2, 2))   # more than one output position
    assert not mm(x1, torch.empty(32, 32, 3, 3), padding=1)            # uncropped: the conv's padding decides
    assert not mm(torch.empty(4, 8, 3, 3), torch.empty(16, 8, 3, 3), dilation=2)
    assert not mm(x1, torch.empty(32, 16, 1, 1), groups=2)
    assert not mm(x1, torch.empty(32, 32, 1, 1), padding="same")
    assert not mm(x1.double(), torch.empty(32, 32, 1, 1))
    assert not mm(nn.Parameter(x1), torch.empty(32, 32, 1, 1))
    assert not mm(torch.empty(4, 32, 1, 1, device="meta"), torch.empty(32, 32, 1, 1, device="meta"))
    with kernels.native_convs(False):
        assert not mm(x1, torch.empty(32, 32, 1, 1))
    w = torch.randn(32, 32, 3, 3, requires_grad=True)
    out = kernels.conv2d(torch.randn(4, 32, 1, 1), w, None, 1, 1)   # cropped to its centre, then a product
    assert type(out.grad_fn).__name__ == "ViewBackward0"
    assert type(out.grad_fn.next_functions[0][0]).__name__ in ("MmBackward0", "AddmmBackward0")
    with FlopCounterMode(display=False) as counter:  # a dispatch mode sees F.conv2d
        kernels.conv2d(torch.randn(4, 32, 1, 1), w.detach(), None, 1, 1)
    assert counter.get_total_flops() == 2 * 4 * 32 * 32 * 9


# --------------------------------------------------------------------------------------------
# a branch's training-mode BatchNorm


def _bn_step(bn: nn.Module, x: torch.Tensor, run) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    out = run(bn, x)
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape) * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).cos()
    out.backward(g)
    grads = [x.grad] + [p.grad for p in bn.parameters()]
    return out.detach(), grads, {k: v.clone() for k, v in bn.state_dict().items()}


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 5), c=st.integers(1, 12), h=st.integers(1, 6), w=st.integers(1, 6),
    form=st.sampled_from(["stats", "flat"]), affine=st.booleans(), track=st.booleans(),
    momentum=st.sampled_from([0.1, 0.5, None]), steps=st.integers(1, 3), offset=st.floats(-50, 50),
)
def test_batch_norm_forms_equal_the_module_in_float64(n, c, h, w, form, affine, track, momentum, steps, offset) -> None:
    """Either form, any shape it may take (thresholds lifted): outputs, input and parameter
    gradients, running statistics and batch counts as nn.BatchNorm2d's, over a few steps; inputs
    far from zero mean (two-pass statistics)."""
    if n * h * w <= 1:
        return  # the module refuses one value per channel; the form steps aside (tested below)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "BN_STATS_MIN_ELEMENTS", 0)
        mp.setattr(kernels, "BN_STATS_MIN_CHANNELS", 0)
        mp.setattr(kernels, "BN_STATS_MIN_POSITIONS", 1 if form == "stats" else 10**9)
        mp.setattr(kernels, "BN_FLAT_MIN_CHANNELS", 0)
        mp.setattr(kernels, "BN_FLAT_MAX_POSITIONS", 10**9)
        _check_bn_form(n, c, h, w, form, affine, track, momentum, steps, offset)


def _check_bn_form(n, c, h, w, form, affine, track, momentum, steps, offset) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + c * 50 + h * 7 + w)
    ref = nn.BatchNorm2d(c, momentum=momentum, affine=affine, track_running_stats=track).double().train()
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5, generator=gen)
            ref.bias.normal_(0, 1, generator=gen)
    new = copy.deepcopy(ref)
    if h * w == 1 and form == "flat":
        assert kernels.batch_norm_form(new, torch.empty(n, c, h, w, dtype=torch.float64)) is None  # 1×1 maps: the module
        return
    for _ in range(steps):
        x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) * 3 + offset
        assert kernels.batch_norm_form(new, x) == form
        o_ref, g_ref, s_ref = _bn_step(ref, x, lambda m, a: m(a))
        o_new, g_new, s_new = _bn_step(new, x, kernels.batch_norm)
        assert _rel(o_new, o_ref) <= 1e-12
        for a, b_ in zip(g_new, g_ref, strict=True):
            assert _rel(a, b_) <= 1e-10  # relative to the largest gradient entry
        assert s_new.keys() == s_ref.keys()
        for k in s_ref:
            if s_ref[k].is_floating_point():
                assert _rel(s_new[k], s_ref[k]) <= 1e-12, k
            else:
                assert torch.equal(s_new[k], s_ref[k]), k
        for p in (*ref.parameters(), *new.parameters()):
            p.grad = None


def test_batch_norm_form_follows_the_documented_rule() -> None:
    bn = nn.BatchNorm2d(256).train()
    form = kernels.batch_norm_form
    assert form(nn.BatchNorm2d(64).train(), torch.empty(64, 64, 8, 8)) == "stats"      # 2^18 elements, 64 positions
    assert form(nn.BatchNorm2d(64).train(), torch.empty(32, 64, 8, 8)) is None         # half the elements
    assert form(nn.BatchNorm2d(6).train(), torch.empty(32, 6, 24, 24)) is None         # LeNet-5's first conv, batch 32
    assert form(nn.BatchNorm2d(6).train(), torch.empty(92, 6, 28, 28)) is None         # ... and any batch: narrow
    assert form(nn.BatchNorm2d(16).train(), torch.empty(64, 16, 16, 16)) == "stats"
    assert form(nn.BatchNorm2d(512).train(), torch.empty(64, 512, 4, 4)) == "stats"
    assert form(bn, torch.empty(64, 256, 2, 2)) == "flat"
    assert form(bn, torch.empty(64, 256, 2, 1)) == "flat"
    assert form(bn, torch.empty(64, 256, 1, 1)) is None                                # 1×1 maps: the module's kernel
    assert form(nn.BatchNorm2d(64).train(), torch.empty(64, 64, 2, 2)) is None         # too few channels
    assert form(bn, torch.empty(64, 256, 3, 3)) is None                                # between the two
    x = torch.empty(64, 256, 2, 2)
    assert form(copy.deepcopy(bn).eval(), x) is None
    assert form(bn, x.double()) is None                                                # the module's dtype differs
    assert form(bn, x.transpose(2, 3)) is None                                         # not contiguous
    assert form(bn, x.to(memory_format=torch.channels_last)) is None
    assert form(bn, nn.Parameter(x)) is None
    assert form(nn.SyncBatchNorm(256).train(), x) is None                              # a subclass runs itself
    hooked = copy.deepcopy(bn)
    hooked.register_forward_hook(lambda *a: None)
    assert form(hooked, x) is None
    with FlopCounterMode(display=False):
        assert form(bn, x) is None
    with kernels.batch_norms(False):
        assert form(bn, x) is None
    assert form(bn, x) == "flat"
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        kernels.batch_norm(nn.BatchNorm2d(3).train(), torch.randn(1, 3, 1, 1))


def test_batch_norm_runs_its_form_and_the_module_elsewhere() -> None:
    bn = nn.BatchNorm2d(256).train()
    y = kernels.batch_norm(bn, torch.randn(64, 256, 2, 2, requires_grad=True))
    assert type(y.grad_fn).__name__ == "_FlatBatchNormBackward"
    assert int(bn.num_batches_tracked) == 1
    y = kernels.batch_norm(nn.BatchNorm2d(64).train(), torch.randn(64, 64, 8, 8, requires_grad=True))
    assert type(y.grad_fn).__name__ == "_StatsBatchNormBackward"
    y = kernels.batch_norm(nn.BatchNorm2d(6).train(), torch.randn(92, 6, 28, 28, requires_grad=True))
    assert type(y.grad_fn).__name__ == "NativeBatchNormBackward0"


@pytest.mark.parametrize("shape", [(64, 64, 8, 8), (64, 256, 2, 2)])
def test_batch_norm_forms_in_float32_relative_to_the_output_scale(shape) -> None:
    """Float32 at the shapes that take each form (a large mean included): within float32 rounding of
    the module, relative to the scale of each result."""
    gen = torch.Generator().manual_seed(3)
    ref = nn.BatchNorm2d(shape[1]).train()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=gen)
    new = copy.deepcopy(ref)
    x = torch.randn(*shape, generator=gen) * 2 + 20
    o_ref, g_ref, s_ref = _bn_step(ref, x, lambda m, a: m(a))
    o_new, g_new, s_new = _bn_step(new, x, kernels.batch_norm)
    assert kernels.batch_norm_form(new, x) is not None
    assert _rel(o_new, o_ref) <= 1e-5
    for a, b_ in zip(g_new, g_ref, strict=True):
        assert _rel(a, b_) <= 1e-4
    assert _rel(s_new["running_mean"], s_ref["running_mean"]) <= 1e-6
    assert _rel(s_new["running_var"], s_ref["running_var"]) <= 1e-4


@pytest.mark.parametrize("shape", [(64, 64, 8, 8), (64, 256, 2, 2)], ids=["stats", "flat"])
def test_batch_norm_forms_are_twice_differentiable_in_float64(shape) -> None:
    """A backward that is itself differentiated (``create_graph``: Hessian-vector products) gets
    the module's second derivatives: the stats form through PyTorch's own (twice differentiable)
    backward, the flat form by recomputing PyTorch's BatchNorm on the saved input (its written-out
    backward treats the statistics as constants: without that, this test fails)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(shape[1]).double().train()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    x0 = torch.randn(*shape, dtype=torch.float64)
    assert kernels.batch_norm_form(bn, x0) == ("stats" if shape[2] == 8 else "flat")

    def hvp(run):
        b = copy.deepcopy(bn)
        x = x0.clone().requires_grad_()
        out = run(b, x)
        loss = (out ** 3).mean() + out.sin().mean()
        ps = [x, *b.parameters()]
        grads = torch.autograd.grad(loss, ps, create_graph=True)
        return grads, torch.autograd.grad(sum((g * g.detach().sign()).sum() for g in grads), ps)

    (g_new, h_new), (g_ref, h_ref) = hvp(kernels.batch_norm), hvp(lambda m, a: m(a))
    for a, b_ in zip((*g_new, *h_new), (*g_ref, *h_ref), strict=True):
        assert _rel(a, b_) <= 1e-12


def test_branch_modules_run_their_batchnorms_through_the_kernel_choice_and_the_anchor_its_own() -> None:
    """The per-branch forward (fused off) runs each branch's BatchNorm through kernels.batch_norm, as
    it runs its convs through kernels.conv2d; the anchor keeps its module's kernel."""
    from reparam import DiverseBranchBlock
    from reparam.fused import fused_training

    blk = DiverseBranchBlock.from_conv(nn.Conv2d(128, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128)).train()
    x = torch.randn(16, 128, 2, 2)
    with fused_training(False):
        outs = {name: blk.branches[name](x) for name in blk.branch_names}
    kinds = {name: type(out.grad_fn).__name__ for name, out in outs.items()}
    assert kinds["kxk"] == "NativeBatchNormBackward0"                 # the anchor: its module
    for name in ("1x1", "1x1_kxk", "1x1_avg", "identity"):
        assert kinds[name] == "_FlatBatchNormBackward", name         # 2×2 maps, 128 channels: the flat form
    with fused_training(False), kernels.batch_norms(False):
        assert type(blk.branches["1x1"](x).grad_fn).__name__ == "NativeBatchNormBackward0"
