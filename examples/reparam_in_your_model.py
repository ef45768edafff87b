"""Use ``reparam`` on a model you did not write: expand, train, merge back to a plain model.

Steps:
1. take an off-the-shelf ResNet-18 (timm if installed, else torchvision);
2. ``reparam.expand`` turns every 3×3 conv (+ its BatchNorm) into a Diverse Branch Block — the
   expanded model computes exactly what the original computes, in train and eval mode;
3. train a few steps on random data (all branches learn);
4. ``reparam.merge`` folds every block and every remaining conv+BN pair into one biased conv;
5. check that the merged model is plain (no blocks, no BatchNorm after a conv) and computes the same
   function as the trained expanded model in eval mode.

Run: ``python examples/reparam_in_your_model.py`` (CPU, well under a minute).
"""

from __future__ import annotations

import time

import torch
from torch import nn
import torch.nn.functional as F

import reparam
from reparam.block import DiverseBranchBlock
from reparam.flops import model_macs


def off_the_shelf_resnet18(num_classes: int = 10) -> tuple[nn.Module, str]:
    """A timm ResNet-18, or torchvision's when timm is not installed.

    :func:`reparam.install_torchvision_fix` makes ``import torchvision`` / ``import timm`` work on
    a CPU build of torch with a torchvision wheel built for CUDA (a no-op where the two match)."""
    reparam.install_torchvision_fix()
    try:
        import timm
    except ImportError:
        import torchvision

        return torchvision.models.resnet18(num_classes=num_classes), "torchvision resnet18"
    return timm.create_model("resnet18", pretrained=False, num_classes=num_classes), "timm resnet18"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, name = off_the_shelf_resnet18()
    shape = (3, 32, 32)

    # 1-2. expand: a lossless change of structure
    expanded = reparam.expand(model)  # deep copy; the default branch set on every 3x3 conv
    n_blocks = sum(isinstance(m, DiverseBranchBlock) for m in expanded.modules())
    x = torch.randn(4, *shape)
    model.eval(), expanded.eval()
    with torch.no_grad():
        assert torch.equal(model(x), expanded(x)), "expansion must be exact"
    print(f"{name}: {n_blocks} convs expanded; forward MACs {model_macs(model, shape) / 1e6:.1f} M "
          f"-> {model_macs(expanded, shape) / 1e6:.1f} M per sample")

    # 3. train a few steps on random data
    expanded.train()
    opt = torch.optim.SGD(expanded.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(8, *shape)
    labels = torch.randint(0, 10, (8,))
    for step in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(expanded(data), labels)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")

    # 4. merge back (needs eval mode: BatchNorm running statistics are what gets folded)
    expanded.eval()
    merged = reparam.merge(expanded)

    # 5. the merged model is plain ...
    assert not any(isinstance(m, DiverseBranchBlock) for m in merged.modules()), "blocks left"
    bns = [p for p, m in merged.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert not bns, f"BatchNorm left after a conv: {bns}"
    convs = [m for m in merged.modules() if isinstance(m, nn.Conv2d)]
    assert all(c.bias is not None for c in convs)
    assert model_macs(merged, shape) == model_macs(model, shape)
    # ... and computes the same function (float32 and float64)
    test = torch.randn(8, *shape)
    with torch.no_grad():
        err32 = rel_err(merged(test), expanded(test))
        expanded64 = expanded.double()
        merged64 = reparam.merge(expanded64)  # merge computes in float64; float64 weights keep it all
        err64 = rel_err(merged64(test.double()), expanded64(test.double()))
    print(f"merged vs trained expanded model: rel. error {err32:.2e} (float32), {err64:.2e} (float64)")
    assert err32 <= 1e-5 and err64 <= 1e-10
    print(f"ok: {len(convs)} plain convs with bias, no BatchNorm, no blocks "
          f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
