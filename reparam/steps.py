"""How far one gradient step moves a block's merged kernel, and how to make it move as the anchor's.

A block's merged kernel is the sum of its branches' kernels, each a function of that branch's
parameters only (in eval mode). One SGD step on every parameter therefore moves the merged kernel by
the sum of what each branch's own step would move it: a block of ``B`` branches of similar scale
steps about ``B`` times as far as its anchor alone, and a nested block multiplies again. Dividing
the loss gradient of each parameter by the branch counts of the blocks that hold it makes the
block's step the *mean* of its branches' steps (:func:`branch_step_scales`).
"""

from __future__ import annotations

from torch import nn

from ._tree import iter_blocks

__all__ = ["branch_step_scales"]


def branch_step_scales(model: nn.Module) -> dict[str, float]:
    """For each trainable parameter inside a block of ``model``, by name: ``1 / Π B``, the product
    over the blocks that hold it (the block itself and any blocks it is nested in) of their branch
    counts (anchor included). Parameters outside blocks, and inside blocks of one branch only, are
    left out (their scale is 1).

    Multiplying each listed parameter's gradient by its scale before an SGD step moves every
    block's merged kernel by the mean of its branches' own steps instead of their sum (exactly so
    for a step from the loss gradient in eval mode, where each branch kernel depends on its own
    parameters only); a block of the anchor alone steps as before."""
    out: dict[str, float] = {}
    for path, block in iter_blocks(model, nested=True):
        n = len(block.branch_names)
        if n > 1:  # a nested block's parameters are divided again by its own count
            for name, p in block.named_parameters(prefix=path):
                if p.requires_grad:
                    out[name] = out.get(name, 1.0) / n
    return out
