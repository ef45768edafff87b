"""``fedhetero bench reparam``: cost of the re-parameterization library on a ResNet-18 (CPU).

Everything is measured side by side in one run, with warm-up calls and interleaved repeats; each
time is the best of its repeats (as ``timeit`` reports: on a shared machine other processes only
ever add time, so the minimum is the stable estimate of a cost; every sample is kept in the JSON
output).

No row times a vacuous case. Right after expansion a model is at a point that training leaves at
once: new branches' last BatchNorms have ``γ = β = 0``, identity-based 1×1 convs have a zero
residual (which lets the merge skip the matrix product of the ``1x1_kxk`` branch) and BatchNorms
hold their initial statistics. Before anything is timed, :func:`reparam.testing.perturb_` moves
every parameter and BatchNorm statistic of the expanded model as training would.

Rows:

* whole-model merge of the perturbed expanded model: ``reparam.merge(model, inplace=True)`` (the
  library default: arithmetic in the model's dtype, float32 here, as upstream's) next to
  :func:`upstream_switch_to_deploy`, a re-implementation of
  the deploy conversion of the upstream Diverse Branch Block code (its ``dbb_transforms`` and
  ``DiverseBranchBlock.get_equivalent_kernel_bias`` / ``switch_to_deploy``, float32, block by
  block, autograd on, as upstream runs it), timed on copies of the same model; the ratio of the two
  is the target row (≤ 0.5). Beside them: the same merge with float64 arithmetic
  (``compute_dtype=torch.float64``: correctly rounded float32 weights), the float64 matrix products
  of its ``1x1_kxk`` compositions alone (:func:`float64_products`, the least time of any float64
  merge here; over upstream's time it is the least ratio float64 arithmetic can reach on the
  machine) and ``reparam.merge(model)`` with its deep copy; every merged model is checked against
  the expanded one;
* inference time (eval mode, ``no_grad``) of the merged, the expanded and the plain original model;
* training-step time (forward, backward, SGD step) of the expanded and the plain model, next to
  their forward-MAC ratio, and the overhead per MAC = step-time ratio ÷ MAC ratio. Measured twice:
  first with the C allocator as the process found it, then after :func:`fedhetero.core.run.allocator.tune_malloc`
  (the ``fedhetero`` trainer runs this way), where the expanded model is also timed with the
  per-branch forward (:func:`reparam.fused.fused_training`, :func:`reparam.kernels.native_convs` and
  :func:`reparam.kernels.batch_norms` off: every branch module with ``F.conv2d`` and its own
  BatchNorm, as upstream DBB trains). The target row is the tuned one.

Other work on the machine can move the time ratio the target is judged on, and the best of a few
repeats does not undo a burst that lasts: when the target pass's training samples spread (median
more than :data:`BUSY_SPREAD` above the best) or the plain model's best step moves by more than
:data:`BUSY_PASS_DRIFT` between the two allocator passes, the result's ``busy`` lists the signs and
the table prints "unsure" for the overhead target instead of judging it.

:func:`run_benchmark` returns the numbers as a dict (its ``progress`` callback receives a line per
step and per timed repeat) and :func:`print_table` prints them, with :data:`UPSTREAM` (what
"upstream" is) under the table; ``fedhetero bench reparam`` runs both, says up front how long it
takes and reports progress on stderr (its options are declared in :mod:`fedhetero.cli.bench`).
"""

from __future__ import annotations

import copy
import time
from functools import partial
from typing import Any, Callable, Literal, Protocol, Sequence, cast

import numpy as np
import torch
import torch.nn.functional as F
from rich.table import Table
from torch import nn

import reparam
from fedhetero.core.run import allocator
from fedhetero.core.common.console import make_console
from fedhetero.models import build_model
from reparam import AvgBranch, ConvBNBranch, IdentityBasedConv1x1, IdentityBranch, OneByOneKxKBranch, flops, fused, kernels
from reparam._compat import import_torchvision
from reparam.block import DiverseBranchBlock
from reparam.testing import perturb_, rel_err

__all__ = [
    "run_benchmark", "print_table", "upstream_switch_to_deploy", "float64_products", "busy_signs", "MODELS", "QUOTED_UPSTREAM", "TARGETS",
    "UPSTREAM", "DEFAULT_DURATION", "duration_note",
]

#: what "upstream" means in the table and the output
UPSTREAM = (
    "upstream: the public reference implementation of the Diverse Branch Block (DBB, Ding et al., "
    "CVPR 2021; github.com/DingXiaoH/DiverseBranchBlock). Its deploy conversion "
    "(switch_to_deploy) is re-implemented here and timed live on copies of the same model "
    "(\"measured\"); the other upstream figures are quoted for that code (\"quoted\"), not "
    "measured by this benchmark."
)
#: how long ``fedhetero bench reparam`` takes with its default settings on a 2-core CPU
DEFAULT_DURATION = "2–5 minutes"

#: figures of the upstream implementation quoted for comparison (not measured by this benchmark;
#: the merge time of upstream is measured live, see :func:`upstream_switch_to_deploy`)
QUOTED_UPSTREAM: dict[str, float] = {
    "macs_ratio": 2.27,
    "step_ratio": 3.89,
    "overhead_per_mac": 1.71,
    "merged_over_plain": 0.97,
}
#: targets of this library (merge: our time over upstream's on the same perturbed model)
TARGETS: dict[str, float] = {"merge_over_upstream": 0.5, "merged_over_plain": 1.02, "overhead_per_mac": 1.15}

MODELS = ("resnet18", "tv-resnet18")

#: a training row whose median sample is this much above its best was timed on a busy machine
#: (measured on an idle one: at most 3 %; during a burst of other work: 21–26 %)
BUSY_SPREAD = 0.15
#: the plain model's best step may not move by more than this between the two allocator passes
#: (idle: under 6 %; a burst of other work doubled it once)
BUSY_PASS_DRIFT = 0.25


def busy_signs(target: dict[str, list[float]], as_found: dict[str, list[float]] | None) -> list[str]:
    """Why the training-step samples (ms) look disturbed, one line per sign; empty when they do not.

    ``target``: the samples of the pass the target row uses, by model (``plain``, ``expanded``);
    ``as_found``: the allocator-as-found pass when the target is the tuned one. Other work on the
    machine adds time to some repeats (their median rises above their best) or to a whole pass
    (the plain model's best moves between passes), and either can move the time ratio the target
    is judged on; the best of a few repeats does not protect against a burst that lasts."""
    signs = []
    for name in ("plain", "expanded"):
        samples = sorted(target.get(name, []))
        if len(samples) >= 2:
            spread = samples[(len(samples) - 1) // 2] / samples[0] - 1
            if spread > BUSY_SPREAD:
                signs.append(f"{name} training steps: median {spread:.0%} above the best (idle: under {BUSY_SPREAD:.0%})")
    if as_found is not None and as_found.get("plain") and target.get("plain"):
        drift = min(target["plain"]) / min(as_found["plain"]) - 1
        if abs(drift) > BUSY_PASS_DRIFT:
            signs.append(f"the plain model's best step moved {drift:+.0%} between the two allocator passes")
    return signs

_PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]


class _NormLike(Protocol):
    """What the upstream conversion reads of a norm: a ``BatchNorm2d`` or a
    :class:`~reparam.layers.FrozenIdentityBN` (an anchor norm)."""

    weight: torch.Tensor
    bias: torch.Tensor
    running_mean: torch.Tensor
    running_var: torch.Tensor
    eps: float


def _norm(module: nn.Module) -> _NormLike:
    """``module`` seen as the BatchNorm-like norm every branch of the library ends with."""
    return cast(_NormLike, module)


def _conv(module: nn.Module) -> nn.Conv2d:
    """``module`` seen as the conv it is (a branch's conv that is not a nested block, a conv of a
    conv→BN pair)."""
    return cast(nn.Conv2d, module)


# --------------------------------------------------------------------------------------------
# upstream deploy conversion, re-implemented (float32, per block, autograd on)


def _up_fuse_bn(kernel: torch.Tensor, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream transform I: scale the kernel by γ/σ, bias β − μγ/σ (the conv bias is not used)."""
    bn = _norm(module)
    gamma = bn.weight
    std = (bn.running_var + bn.eps).sqrt()
    return kernel * (gamma / std).reshape(-1, 1, 1, 1), bn.bias - bn.running_mean * gamma / std


def _up_1x1_kxk(
    k1: torch.Tensor, b1: torch.Tensor, k2: torch.Tensor, b2: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream transform III: the sequential 1×1 → K×K pair as a convolution of the second kernel
    by the transposed first one, one convolution per group, plus the first bias through the second
    kernel."""
    if groups == 1:
        k = F.conv2d(k2, k1.permute(1, 0, 2, 3))
        b_hat = (k2 * b1.reshape(1, -1, 1, 1)).sum((1, 2, 3))
    else:
        k_parts, b_parts = [], []
        k1_t = k1.permute(1, 0, 2, 3)
        w1 = k1.size(0) // groups
        w2 = k2.size(0) // groups
        for g in range(groups):
            k1_slice = k1_t[:, g * w1 : (g + 1) * w1, :, :]
            k2_slice = k2[g * w2 : (g + 1) * w2, :, :, :]
            k_parts.append(F.conv2d(k2_slice, k1_slice))
            b_parts.append((k2_slice * b1[g * w1 : (g + 1) * w1].reshape(1, -1, 1, 1)).sum((1, 2, 3)))
        k, b_hat = torch.cat(k_parts, dim=0), torch.cat(b_parts)
    return k, b_hat + b2


def _up_avg_kernel(channels: int, kernel_size: int, groups: int) -> torch.Tensor:
    """Upstream transform V: a dense ``(O, O/g, K, K)`` kernel of the average pool (numpy indices)."""
    input_dim = channels // groups
    k = torch.zeros((channels, input_dim, kernel_size, kernel_size))
    k[np.arange(channels), np.tile(np.arange(input_dim), groups), :, :] = 1.0 / kernel_size**2
    return k


def _up_pad_to(kernel: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """Upstream transform VI: zero-pad a centred smaller kernel to ``K_h × K_w``."""
    ph, pw = (kh - kernel.size(2)) // 2, (kw - kernel.size(3)) // 2
    return F.pad(kernel, [pw, pw, ph, ph])


def _up_identity_kernel(channels: int, groups: int, kh: int, kw: int) -> torch.Tensor:
    """The identity kernel built as upstream's RepVGG does it (a numpy array filled in a loop)."""
    input_dim = channels // groups
    value = np.zeros((channels, input_dim, kh, kw), dtype=np.float32)
    for i in range(channels):
        value[i, i % input_dim, kh // 2, kw // 2] = 1
    return torch.from_numpy(value)


def _up_equivalent_kernel_bias(block: DiverseBranchBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """``DiverseBranchBlock.get_equivalent_kernel_bias`` of upstream applied to our block's branches:
    every branch fused with its BN, the 1×1 → K×K and the 1×1 → average branches composed by
    transform III (the average pool as a dense kernel), the 1×1 kernel padded, all summed. The
    ``identity`` branch (not part of upstream's block) follows upstream's RepVGG; a conv bias of a
    conv-mode anchor (upstream's convs have none) is added through the anchor norm."""
    geo = block.geometry
    kh, kw = geo.kernel_size
    kernels: list[torch.Tensor] = []
    biases: list[torch.Tensor] = []
    for name in block.branch_names:
        br = block.branches[name]
        if isinstance(br, ConvBNBranch):
            if hasattr(br.conv, "_equivalent"):
                raise ValueError("upstream's conversion has no nested blocks")
            conv, bn = _conv(br.conv), _norm(br.bn)
            k, b = _up_fuse_bn(conv.weight, br.bn)
            if conv.bias is not None:
                b = b + conv.bias * bn.weight / (bn.running_var + bn.eps).sqrt()
            kernels.append(_up_pad_to(k, kh, kw))
            biases.append(b)
        elif isinstance(br, OneByOneKxKBranch):
            first = br.conv1.weight + br.conv1.id_tensor if isinstance(br.conv1, IdentityBasedConv1x1) else br.conv1.weight
            k1, b1 = _up_fuse_bn(first, br.bn1)
            k2, b2 = _up_fuse_bn(_conv(br.conv2).weight, br.bn2)
            k, b = _up_1x1_kxk(k1, b1, k2, b2, geo.groups)
            kernels.append(k)
            biases.append(b)
        elif isinstance(br, AvgBranch):
            if kh != kw:
                raise ValueError("upstream's average kernel is square")
            k_avg = _up_avg_kernel(geo.out_channels, kh, geo.groups)
            if br.path == "dense":
                k2, b2 = _up_fuse_bn(k_avg.to(_norm(br.bn2).weight.device), br.bn2)
                k1, b1 = _up_fuse_bn(br.conv.weight, br.bn1)
                k, b = _up_1x1_kxk(k1, b1, k2, b2, geo.groups)
            else:
                k, b = _up_fuse_bn(k_avg.to(_norm(br.bn).weight.device), br.bn)
            kernels.append(k)
            biases.append(b)
        elif isinstance(br, IdentityBranch):
            identity = _up_identity_kernel(geo.in_channels, geo.groups, kh, kw)
            k, b = _up_fuse_bn(identity.to(_norm(br.bn).weight.device), br.bn)
            kernels.append(k)
            biases.append(b)
        else:  # pragma: no cover - every kind of the library is handled above
            raise ValueError(f"no upstream conversion for branch {name!r}")
    # sum() starts from 0, which the first tensor replaces: both sums are tensors (a block has branches)
    return cast(torch.Tensor, sum(kernels)), cast(torch.Tensor, sum(biases))


def upstream_switch_to_deploy(model: nn.Module, pairs: dict[str, str]) -> nn.Module:
    """In place: upstream's deploy conversion (its ``convert.py`` calls ``switch_to_deploy`` on every
    module that has one): each block becomes a new biased ``nn.Conv2d`` (built with PyTorch's
    initialisation, then given the kernel and bias), every parameter of the old branches is
    detached and the branches are deleted; each remaining conv→BN pair (upstream's ``ConvBN``) is
    folded the same way. ``pairs`` maps conv paths to BN paths (``reparam.structure(model)["pairs"]``
    taken before timing)."""

    def put(path: str, module: nn.Module) -> None:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, module)

    for path, block in list(reparam.iter_blocks(model)):
        kernel, bias = _up_equivalent_kernel_bias(block)
        g = block.geometry
        conv = nn.Conv2d(g.in_channels, g.out_channels, g.kernel_size, g.stride, g.padding, g.dilation, g.groups,
                         bias=True, padding_mode=cast(_PaddingMode, g.padding_mode))
        assert conv.bias is not None  # bias=True
        conv.weight.data = kernel
        conv.bias.data = bias
        for p in block.parameters():
            p.detach_()
        put(path, conv)
    for conv_path, bn_path in pairs.items():
        old, bn = _conv(model.get_submodule(conv_path)), model.get_submodule(bn_path)
        kernel, bias = _up_fuse_bn(old.weight, bn)
        if old.bias is not None:  # upstream's ConvBN convs have none; kept exact for other models
            norm = _norm(bn)
            bias = bias + old.bias * norm.weight / (norm.running_var + norm.eps).sqrt()
        # torch types a conv's kernel_size/stride/padding/dilation as tuple[int, ...], which its own
        # constructor (tuple[int, int]) does not accept: the stubs disagree with themselves
        conv = nn.Conv2d(old.in_channels, old.out_channels, old.kernel_size, old.stride,  # type: ignore[arg-type]
                         old.padding, old.dilation, old.groups,  # type: ignore[arg-type]
                         bias=True, padding_mode=cast(_PaddingMode, old.padding_mode))
        assert conv.bias is not None  # bias=True
        conv.weight.data = kernel
        conv.bias.data = bias
        for p in list(old.parameters()) + list(bn.parameters()):
            p.detach_()
        put(conv_path, conv)
        put(bn_path, nn.Identity())
    return model


# --------------------------------------------------------------------------------------------
# model and timing


def _build_model(name: str, num_classes: int = 10) -> tuple[nn.Module, str]:
    if name == "resnet18":
        return build_model("resnet18", num_classes=num_classes), "CIFAR ResNet-18 (fedhetero.models.build_model('resnet18'))"
    if name == "tv-resnet18":
        tv = import_torchvision()
        return tv.models.resnet18(num_classes=num_classes), "torchvision resnet18"
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _best(samples: dict[str, list[float]], log: dict[str, list[float]], tag: str) -> dict[str, float]:
    """The minimum of each measure's samples; the samples (ms) go into ``log`` as ``tag.measure``."""
    for k, v in samples.items():
        log[f"{tag}.{k}"] = [round(t * 1e3, 3) for t in v]
    return {k: min(v) for k, v in samples.items()}


def _pass(log: dict[str, list[float]], tag: str) -> dict[str, list[float]]:
    """The samples of one timed pass (``tag.measure`` in ``log``), by measure."""
    return {k.split(".", 1)[1]: v for k, v in log.items() if k.startswith(tag + ".")}


def _interleaved(
    fns: dict[str, Callable[[], Any]], warmup: int, repeats: int, log: dict[str, list[float]], tag: str,
    tick: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Best seconds per call of each function, calls interleaved round-robin (samples into ``log``);
    ``tick(done, repeats)`` after each timed repeat. The order rotates from one repeat to the next,
    so that no function always runs in the same place (measured here: a fixed second place ran
    2–3 % slower than the first, enough to invert a comparison)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    for i in range(repeats):
        shift = i % len(keys) if keys else 0
        for k in keys[shift:] + keys[:shift]:
            samples[k].append(_timed(fns[k]))
        if tick is not None:
            tick(i + 1, repeats)
    return _best(samples, log, tag)


def _train_step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _infer_fn(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            model(x)

    return run


class _Products:
    """Batched matrix products on fixed operands; calling the object computes them all."""

    def __init__(self, operands: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.operands = operands

    def __call__(self) -> None:
        for left, right in self.operands:
            torch.bmm(left, right)


def float64_products(model: nn.Module, seed: int = 0) -> _Products:
    """The float64 matrix products a merge of ``model`` cannot avoid, as a callable that computes
    them on random operands of the same shapes (``.operands`` holds them).

    Each ``1x1_kxk`` branch composes its two convolutions: ``Σ_d W2[o, d, tap]·A[d, c]`` for every
    output row, tap and input channel, a ``(C/g + 1) × D/g × (O/g·taps)`` product per group (the
    extra row carries the first stage's bias), here as one call per branch (a float64 merge computes
    the same multiply-adds in chunks of output rows). Every other step of a merge is element-wise. The time
    of these products alone is the least time any float64 merge of this model takes on this
    machine; the benchmark shows it beside upstream's whole (float32) merge."""
    gen = torch.Generator().manual_seed(seed)
    operands = []
    for _, block in reparam.iter_blocks(model):
        geo = block.geometry
        for name in block.branch_names:
            br = block.branches[name]
            if not isinstance(br, OneByOneKxKBranch):
                continue
            g = geo.groups
            o, dg, kh, kw = _conv(br.conv2).weight.shape
            left = torch.randn((g, geo.in_channels // g + 1, dg), generator=gen, dtype=torch.float64)
            right = torch.randn((g, dg, (o // g) * kh * kw), generator=gen, dtype=torch.float64)
            operands.append((left, right))
    return _Products(operands)


def _merge_times(
    expanded: nn.Module, pairs: dict[str, str], repeats: int, log: dict[str, list[float]],
    tick: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Best seconds of each merge variant, each on a fresh copy made beforehand (the copy is not
    timed except in ``ours_with_copy``), and of the float64 products alone
    (:func:`float64_products`); variants interleaved, one untimed warm-up round; ``tick(done,
    repeats)`` after each timed round."""
    variants: dict[str, Callable[[nn.Module], Any]] = {
        "ours": lambda m: reparam.merge(m, inplace=True),
        "upstream": lambda m: upstream_switch_to_deploy(m, pairs),
        "ours_float64_arithmetic": lambda m: reparam.merge(m, inplace=True, compute_dtype=torch.float64),
    }
    products = float64_products(expanded)
    samples: dict[str, list[float]] = {k: [] for k in (*variants, "ours_with_copy", "float64_products")}
    for rep in range(repeats + 1):
        for name, fn in variants.items():
            c = copy.deepcopy(expanded)
            t = _timed(partial(fn, c))
            if rep:
                samples[name].append(t)
        t = _timed(lambda: reparam.merge(expanded))
        if rep:
            samples["ours_with_copy"].append(t)
        t = _timed(products)
        if rep:
            samples["float64_products"].append(t)
            if tick is not None:
                tick(rep, repeats)
    return _best(samples, log, "merge")


# --------------------------------------------------------------------------------------------
# benchmark


def run_benchmark(
    *,
    batch: int = 64,
    repeats: int = 5,
    warmup: int = 1,
    threads: int | None = 2,
    branches: Sequence[str] | None = None,
    merge_repeats: int = 5,
    train_repeats: int = 3,
    model: nn.Module | str | None = None,
    input_size: int = 32,
    seed: int = 0,
    tune_allocator: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Measure merge time (ours and upstream's), inference and training-step cost; return a
    JSON-able dict.

    Args:
        batch: batch size of the timed forward/training steps.
        repeats: timed inference repeats (best reported); ``warmup`` untimed calls first.
        threads: ``torch.set_num_threads`` during the run (restored afterwards); ``None`` keeps it.
        branches: branch kinds for ``reparam.expand`` (default: the library's default set).
        merge_repeats: timed repeats of each whole-model merge variant.
        train_repeats: timed training steps per model (best; training dominates the run time).
        model: a plain model (input ``3 × input_size²``), or a name from :data:`MODELS`
            (default ``"resnet18"``, the zoo's CIFAR ResNet-18).
        seed: seed of the random data and of the perturbation.
        tune_allocator: also time training after :func:`fedhetero.core.run.allocator.tune_malloc` (the target
            row); with ``False`` the allocator is left alone and the first measurement is the target.
        progress: called with one line per step (``[k/n] what``, with an estimate of the
            training steps' time once inference is timed) and one per timed repeat.
    """
    for name, v in (
        ("batch", batch), ("repeats", repeats), ("merge_repeats", merge_repeats), ("train_repeats", train_repeats)
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")

    log: dict[str, list[float]] = {}  # every timed sample (ms), by measure
    steps = 5 if tune_allocator else 4
    done = [0]

    def say(text: str) -> None:
        if progress is not None:
            done[0] += 1
            progress(f"[{done[0]}/{steps}] {text}")

    def tick(what: str) -> Callable[[int, int], None]:
        def report(i: int, n: int) -> None:
            if progress is not None:
                progress(f"      {what}: repeat {i}/{n} timed")

        return report

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        say(f"building {model if isinstance(model, str) else 'the model' if model is not None else 'resnet18'}, "
            "expanding it and perturbing it as training would")
        if model is None or isinstance(model, str):
            plain, model_name = _build_model(model or "resnet18")
        else:
            plain, model_name = model, type(model).__name__
        input_shape = (3, input_size, input_size)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, *input_shape, generator=gen)
        plain.eval()
        with torch.no_grad():
            num_classes = int(plain(x[:1]).shape[-1])
        y = torch.randint(0, num_classes, (batch,), generator=gen)

        expanded = reparam.expand(plain, branches=None if branches is None else list(branches))
        perturb_(expanded, gen)  # as training would: no vacuous merge
        expanded.eval()
        plain.eval()
        pairs = dict(reparam.structure(expanded)["pairs"])

        macs_plain = flops.model_macs(plain, input_shape)
        macs_expanded = flops.model_macs(expanded, input_shape)

        tuned_before = allocator.malloc_tuned()
        say(f"timing the whole-model merge: ours, upstream's, float64 (a warm-up, then {merge_repeats} timed)")
        merge = _merge_times(expanded, pairs, merge_repeats, log, tick("merge"))
        say("checking every merged model against the expanded one; timing inference: plain, expanded, merged "
            f"({warmup} warm-up + {repeats} repeats)")
        merged = reparam.merge(expanded)
        upstream = upstream_switch_to_deploy(copy.deepcopy(expanded), pairs)
        merged_f64 = reparam.merge(expanded, compute_dtype=torch.float64)
        merged.eval(), upstream.eval(), merged_f64.eval()
        with torch.no_grad():
            ref = expanded(x[:8])
            err = {
                "ours": rel_err(merged(x[:8]), ref),
                "upstream": rel_err(upstream(x[:8]), ref),
                "ours_float64_arithmetic": rel_err(merged_f64(x[:8]), ref),
            }

        infer = _interleaved(
            {"plain": _infer_fn(plain, x), "expanded": _infer_fn(expanded, x), "merged": _infer_fn(merged, x)},
            warmup,
            repeats,
            log,
            "inference",
            tick("inference"),
        )
        plain_t = copy.deepcopy(plain).train()
        expanded_t = copy.deepcopy(expanded).train()
        train_fns = {"plain": _train_step_fn(plain_t, x, y), "expanded": _train_step_fn(expanded_t, x, y)}
        # a training step costs roughly four inference forwards (a forward with autograd, the
        # backward, the update); the tuned pass also times the per-branch forward (~1.2× expanded)
        forwards = infer["plain"] + infer["expanded"]
        tuned_pass = forwards + 1.2 * infer["expanded"] if tune_allocator else 0.0
        guess = 4 * (warmup + train_repeats) * (forwards + tuned_pass)
        say(f"timing training steps: plain, expanded, allocator as found ({warmup} warm-up + {train_repeats} "
            f"repeats); estimate for the training steps: {_duration(guess)}")
        train_system = _interleaved(train_fns, warmup, train_repeats, log, "train_allocator_as_found",
                                    tick("training, allocator as found"))
        train = train_system
        tuned = False
        if tune_allocator:
            tuned = allocator.tune_malloc()
            say("timing training steps after tuning the C allocator: plain, expanded, per-branch forward"
                if tuned else "the C allocator cannot be tuned here: no second training measurement")
        if tuned:
            per_branch = _train_step_fn(copy.deepcopy(expanded).train(), x, y)

            def unfused() -> None:  # every branch module with F.conv2d and its BN, as upstream DBB trains
                with fused.fused_training(False), kernels.native_convs(False), kernels.batch_norms(False):
                    per_branch()

            train = _interleaved({**train_fns, "expanded_per_branch": unfused}, warmup, train_repeats, log,
                                 "train_tuned_malloc", tick("training, tuned allocator"))
    finally:
        torch.set_num_threads(old_threads)

    macs_ratio = macs_expanded / macs_plain
    step_ratio = train["expanded"] / train["plain"]
    system_ratio = train_system["expanded"] / train_system["plain"]
    return {
        "model": model_name,
        "batch": batch,
        "input_shape": list(input_shape),
        "threads": threads if threads is not None else old_threads,
        "repeats": repeats,
        "train_repeats": train_repeats,
        "merge_repeats": merge_repeats,
        "warmup": warmup,
        "branches": list(branches) if branches is not None else "default",
        "perturbed": True,
        "macs_plain": int(macs_plain),
        "macs_expanded": int(macs_expanded),
        "macs_ratio": macs_ratio,
        "merge_ms": merge["ours"] * 1e3,
        "merge_upstream_ms": merge["upstream"] * 1e3,
        "merge_over_upstream": merge["ours"] / merge["upstream"],
        "merge_with_copy_ms": merge["ours_with_copy"] * 1e3,
        "merge_float64_arithmetic_ms": merge["ours_float64_arithmetic"] * 1e3,
        "merge_float64_arithmetic_over_upstream": merge["ours_float64_arithmetic"] / merge["upstream"],
        "float64_products_ms": merge["float64_products"] * 1e3,
        "float64_products_over_upstream": merge["float64_products"] / merge["upstream"],
        "merge_rel_err": err,
        "merge_rel_err_fp32": err["ours"],
        "infer_ms": {k: v * 1e3 for k, v in infer.items()},
        "merged_over_plain": infer["merged"] / infer["plain"],
        "expanded_over_plain_infer": infer["expanded"] / infer["plain"],
        "train_step_ms": {k: v * 1e3 for k, v in train.items()},
        "step_ratio": step_ratio,
        "overhead_per_mac": step_ratio / macs_ratio,
        "malloc_tuned": tuned,
        "malloc_tuned_before": tuned_before,
        "train_step_ms_system_malloc": {k: v * 1e3 for k, v in train_system.items()},
        "step_ratio_system_malloc": system_ratio,
        "overhead_per_mac_system_malloc": system_ratio / macs_ratio,
        "per_branch_step_ratio": (train["expanded_per_branch"] / train["plain"]) if "expanded_per_branch" in train else None,
        "busy": busy_signs(_pass(log, "train_tuned_malloc" if tuned else "train_allocator_as_found"),
                           _pass(log, "train_allocator_as_found") if tuned else None),
        "targets": dict(TARGETS),
        "quoted_upstream": dict(QUOTED_UPSTREAM),
        "samples_ms": log,
    }


def _duration(seconds: float) -> str:
    """``~40 s``, ``~3 min``: a rough duration."""
    if seconds < 90:
        return f"~{max(seconds, 1):.0f} s"
    return f"~{seconds / 60:.0f} min"


def duration_note(*, defaults: bool) -> str:
    """What ``fedhetero bench reparam`` prints before it starts: how long it takes."""
    if defaults:
        return (f"this takes roughly {DEFAULT_DURATION} on an idle 2-core CPU, longer on a busy one (training "
                "steps take most of it); progress follows on stderr")
    return (f"with the default settings this takes roughly {DEFAULT_DURATION} on an idle 2-core CPU; a larger batch, "
            "input or more repeats take longer; an estimate of the training steps follows once inference is "
            "timed; progress follows on stderr")


# --------------------------------------------------------------------------------------------
# presentation


def print_table(res: dict, console: Any = None) -> None:
    """Print the numbers of :func:`run_benchmark` as a table (on ``console``, default stdout),
    with what "upstream" means below it."""

    def ok(value: float, target: float) -> str:
        return "[green]yes[/green]" if value <= target else "[red]no[/red]"

    t = Table(title=f"reparam benchmark: {res['model']}, every parameter perturbed as by training, batch "
              f"{res['batch']}, {res['threads']} threads, CPU (best of {res['repeats']} inference / "
              f"{res['train_repeats']} training / {res['merge_repeats']} merge repeats)")
    for col in ("measure", "ours", "target", "met", "upstream"):
        t.add_column(col, justify="right" if col != "measure" else "left")
    inf, tr, up = res["infer_ms"], res["train_step_ms"], res["quoted_upstream"]
    err = res["merge_rel_err"]
    t.add_row("whole-model merge, in place (ms)", f"{res['merge_ms']:.1f}", "", "",
              f"{res['merge_upstream_ms']:.1f} (measured)")
    t.add_row("  merge time ours / upstream", f"{res['merge_over_upstream']:.2f}", "<= 0.5",
              ok(res["merge_over_upstream"], TARGETS["merge_over_upstream"]), "")
    t.add_row("  reparam.merge(model), deep copy incl. (ms)", f"{res['merge_with_copy_ms']:.1f}", "", "", "")
    t.add_row("  merged vs expanded rel. err (float32 model)", f"{err['ours']:.1e}", "", "",
              f"{err['upstream']:.1e}")
    t.add_row("  with float64 arithmetic, compute_dtype=torch.float64 (ms)", f"{res['merge_float64_arithmetic_ms']:.1f}",
              "", "", "")
    t.add_row("    / upstream", f"{res['merge_float64_arithmetic_over_upstream']:.2f}", "", "", "")
    t.add_row("    its float64 matrix products alone (ms)", f"{res['float64_products_ms']:.1f}", "", "", "")
    t.add_row("    float64 products alone / upstream (least ratio in float64)",
              f"{res['float64_products_over_upstream']:.2f}", "", "", "")
    t.add_row("    merged vs expanded rel. err, float64 arithmetic", f"{err['ours_float64_arithmetic']:.1e}", "", "", "")
    t.add_row("inference plain (ms)", f"{inf['plain']:.1f}", "", "", "")
    t.add_row("inference expanded (ms)", f"{inf['expanded']:.1f}", "", "", "")
    t.add_row("inference merged (ms)", f"{inf['merged']:.1f}", "", "", "")
    t.add_row("merged / plain", f"{res['merged_over_plain']:.3f}", "<= 1.02",
              ok(res["merged_over_plain"], TARGETS["merged_over_plain"]), f"{up['merged_over_plain']:.2f} (quoted)")
    t.add_row("MACs expanded / plain", f"{res['macs_ratio']:.2f}", "", "", f"{up['macs_ratio']:.2f} (quoted)")
    sys_tr = res["train_step_ms_system_malloc"]
    label = "allocator as found" + (" (already tuned)" if res["malloc_tuned_before"] else "")
    if res["malloc_tuned"]:
        t.add_row(f"train step plain / expanded, {label} (ms)", f"{sys_tr['plain']:.0f} / {sys_tr['expanded']:.0f}",
                  "", "", "")
        t.add_row("  overhead per MAC, allocator as found", f"{res['overhead_per_mac_system_malloc']:.2f}", "", "", "")
        t.add_row("train step plain / expanded, tuned malloc (ms)", f"{tr['plain']:.0f} / {tr['expanded']:.0f}",
                  "", "", "")
        t.add_row("  expanded, per-branch forward (ms)", f"{tr['expanded_per_branch']:.0f}", "", "", "")
        t.add_row("  step time expanded / plain, per-branch forward", f"{res['per_branch_step_ratio']:.2f}", "", "", "")
    else:
        t.add_row(f"train step plain / expanded, {label} (ms)", f"{tr['plain']:.0f} / {tr['expanded']:.0f}", "", "", "")
    t.add_row("step time expanded / plain", f"{res['step_ratio']:.2f}", "", "", f"{up['step_ratio']:.2f} (quoted)")
    busy = res.get("busy") or []
    t.add_row("overhead per MAC (time ratio / MACs ratio)", f"{res['overhead_per_mac']:.2f}", f"<= {TARGETS['overhead_per_mac']}",
              "[yellow]unsure[/yellow]" if busy else ok(res["overhead_per_mac"], TARGETS["overhead_per_mac"]),
              f"{up['overhead_per_mac']:.2f} (quoted)")
    t.caption = UPSTREAM
    if busy:
        t.caption = ("the machine looked busy while the training steps were timed (" + "; ".join(busy)
                     + "): the overhead row is not judged; rerun on an idle machine or with more --train-repeats.\n"
                     + UPSTREAM)
    t.caption_justify = "left"
    (console or make_console()).print(t)
