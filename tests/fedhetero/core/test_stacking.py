"""The stacked BatchNorm (fedhetero.core.local.stacking): each client's statistics over its own real
rows, whether the padding is masked row by row or is whole clients left idle."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedhetero.core.local.stacking import StackedBatchNorm2d


def _clients(c: int, ch: int, seed: int) -> list[nn.BatchNorm2d]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(c):
        bn = nn.BatchNorm2d(ch).double()
        with torch.no_grad():
            bn.weight.copy_(torch.rand(ch, generator=g, dtype=torch.float64) + 0.5)
            bn.bias.copy_(torch.randn(ch, generator=g, dtype=torch.float64))
            bn.running_mean.copy_(torch.randn(ch, generator=g, dtype=torch.float64))
            bn.running_var.copy_(torch.rand(ch, generator=g, dtype=torch.float64) + 0.1)
            bn.num_batches_tracked.fill_(3)
        out.append(bn)
    return out


def _stacked(bns: list[nn.BatchNorm2d]) -> StackedBatchNorm2d:
    s = StackedBatchNorm2d(bns[0], len(bns)).double()
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(s, name).copy_(torch.cat([getattr(b, name) for b in bns]))
    return s.train()


@settings(max_examples=60, deadline=None)
@given(c=st.integers(2, 6), ch=st.integers(1, 4), rows=st.integers(2, 9), hw=st.integers(1, 4),
       idle_bits=st.integers(1, 2**6 - 2), seed=st.integers(0, 10**6))
def test_idle_clients_give_the_masked_numbers(c, ch, rows, hw, idle_bits, seed):
    """Whole clients idle (their rows all padding): the plain statistics with the idle clients'
    running statistics put back give every working client exactly what the masked statistics and
    its own BatchNorm give (output, input gradient, running statistics), and leave every idle
    client's running statistics and batch count as they were."""
    idle = torch.tensor([bool(idle_bits >> i & 1) for i in range(c)])
    if bool(idle.all()) or not bool(idle.any()):
        idle[0] = not bool(idle[1:].any())
    bns = _clients(c, ch, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, c * ch, hw, hw, generator=g, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last)
    upstream = torch.randn(x.shape, generator=g, dtype=torch.float64)

    def run(mode: str) -> tuple[torch.Tensor, torch.Tensor, StackedBatchNorm2d]:
        s = _stacked(bns)
        if mode == "masked":
            s.mask = (~idle).to(torch.float64).expand(rows, c)
        else:
            s.idle = idle
        xi = x.clone().requires_grad_(True)
        y = s(xi)
        (gx,) = torch.autograd.grad((y * upstream).sum(), xi)
        return y.detach(), gx, s

    y_idle, g_idle, s_idle = run("idle")
    y_mask, g_mask, s_mask = run("masked")
    for i in range(c):
        cols = slice(i * ch, (i + 1) * ch)
        before = bns[i]
        if bool(idle[i]):
            for name in ("running_mean", "running_var"):
                assert torch.equal(getattr(s_idle, name)[cols], getattr(before, name)), (i, name)
            assert int(s_idle.num_batches_tracked[i]) == 3
            continue
        own = nn.BatchNorm2d(ch).double()
        own.load_state_dict(before.state_dict())
        xi = x[:, cols].clone().requires_grad_(True)
        y_own = own.train()(xi)
        (g_own,) = torch.autograd.grad((y_own * upstream[:, cols]).sum(), xi)
        scale = float(y_own.abs().max()) + 1.0
        for got in (y_idle, y_mask):
            assert torch.allclose(got[:, cols], y_own, rtol=1e-12, atol=1e-12 * scale)
        for got in (g_idle, g_mask):
            assert torch.allclose(got[:, cols], g_own, rtol=1e-10, atol=1e-10 * (float(g_own.abs().max()) + 1.0))
        for name in ("running_mean", "running_var"):
            ref = getattr(own, name)
            for s in (s_idle, s_mask):
                assert torch.allclose(getattr(s, name)[cols], ref, rtol=1e-12, atol=1e-12), (i, name)
        assert int(s_idle.num_batches_tracked[i]) == int(own.num_batches_tracked) == 4
        assert torch.equal(s_idle.num_batches_tracked, s_mask.num_batches_tracked)
