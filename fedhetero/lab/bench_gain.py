"""``fedhetero bench reparam-gain``: does training a model *expanded* and merging it back beat
training the same structure plain?

For each model and width of the grid and each seed, the same deployed structure is trained twice
from the same starting weights, with the same data order, epochs, learning-rate schedule and
optimizer: once plain, once expanded into Diverse Branch Blocks (``reparam.expand``) and merged
back (``reparam.merge``) before it is evaluated. The paired gain (merged minus plain, per seed) is
reported as mean ± std, beside ``width_gain``, what doubling the plain model's width is worth (the
capacity there is to transfer), and the training MACs of each arm.

Choices (which width the per-kind rows use) are made on a validation split held out of the
training set; the test split is only reported. The data order of a seed is one
``torch.Generator`` permutation per epoch, shared by both arms; the expanded arm's new branches
draw from a generator of their own, so the plain arm's random stream is the same with or without
the expanded arm.

Every merged model is checked against the expanded one it came from (eval mode, on a test batch):
a merge that is not lossless stops the benchmark.
"""

from __future__ import annotations

import copy
import inspect
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import reparam
from fedhetero.core.method.registry import IMPORT_ERRORS, import_target
from fedhetero.data.datasets import load_dataset
from fedhetero.models import build_model
from reparam.flops import train_macs

__all__ = [
    "DBB_PAPER", "DEFAULT_MODELS", "DEFAULT_WIDTHS", "GainSetup", "GainError", "load_splits", "print_table",
    "run_benchmark", "train_pair",
]

DEFAULT_MODELS = ("lenet5", "cnn")
DEFAULT_WIDTHS = (0.125, 0.25, 0.5, 1.0)

#: the DBB paper's centralized gains (Ding et al., CVPR 2021, Table 2: top-1 %, CIFAR the mean of
#: 5 runs): (data set, architecture, original, DBB-Net)
DBB_PAPER: tuple[tuple[str, str, float, float], ...] = (
    ("CIFAR-10", "VGG-16", 93.95, 94.62),
    ("CIFAR-100", "VGG-16", 74.05, 75.72),
    ("ImageNet", "AlexNet", 57.23, 59.19),
    ("ImageNet", "MobileNet", 71.89, 72.88),
    ("ImageNet", "ResNet-18", 69.54, 70.99),
    ("ImageNet", "ResNet-50", 76.14, 76.71),
)


class GainError(ValueError):
    """A set-up the benchmark cannot run (no expandable conv, an unknown model); one line."""


@dataclass(frozen=True)
class GainSetup:
    """How each arm is trained (the same for both)."""

    epochs: int = 3
    batch: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    schedule: str = "cosine"  # "cosine" (per step, to 0) or "constant"
    # a candidate cause: every BatchNorm's running statistics re-estimated over this many training
    # batches (an exact average, not the running one) before evaluation and merge, in both arms
    recalibrate_bn: int = 0
    # a candidate cause: the weight decay of the expanded arm's branches other than the anchor
    # (None: the same as every other parameter)
    branch_weight_decay: float | None = None
    # a candidate cause: "sum" (DBB training: every branch takes the full step, so a block's merged
    # kernel moves by the sum of its branches' steps) or "mean" (each block parameter's gradient
    # divided by the block's branch count: reparam.branch_step_scales)
    block_step: str = "sum"
    # a candidate cause: the internal width of every 1x1_kxk branch, as a multiple of the default
    # (the host conv's input channels); None: the default
    internal_scale: float | None = None


@dataclass
class Splits:
    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    name: str

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]


def load_splits(dataset: str, data_dir: str | None, *, val_fraction: float = 0.1,
                train_samples: int | None = None) -> Splits:
    """The training split less a stratified validation hold-out (``val_fraction`` of each class,
    fixed, independent of the seed), and the test split. ``train_samples`` keeps a stratified
    subset of what remains for training (the same for every seed)."""
    train = load_dataset(dataset, data_dir=data_dir, split="train")
    test = load_dataset(dataset, data_dir=data_dir, split="test")
    g = torch.Generator().manual_seed(12345)
    val_idx: list[Tensor] = []
    keep_idx: list[Tensor] = []
    n_train = len(train.labels)
    for c in range(train.num_classes):
        idx = torch.nonzero(train.labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_val = int(round(len(idx) * val_fraction))
        val_idx.append(idx[:n_val])
        rest = idx[n_val:]
        if train_samples is not None:
            rest = rest[: max(1, int(round(len(rest) * train_samples / n_train / (1 - val_fraction))))]
        keep_idx.append(rest)
    vi, ki = torch.cat(val_idx), torch.cat(keep_idx)
    ki = ki[torch.randperm(len(ki), generator=g)]
    return Splits(train.images[ki], train.labels[ki], train.images[vi], train.labels[vi],
                  test.images, test.labels, train.num_classes, dataset)


def _accuracy(model: nn.Module, x: Tensor, y: Tensor, batch: int = 1000) -> float:
    model.eval()
    hits = 0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            hits += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    return 100.0 * hits / max(1, len(y))


def _train(model: nn.Module, data: Splits, setup: GainSetup, seed: int) -> None:
    """Train ``model`` in place; the data order depends on ``seed`` only."""
    groups: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    if setup.branch_weight_decay is not None:
        extra = {id(p) for p in _branch_parameters(model)}
        groups = [{"params": [p for p in model.parameters() if id(p) not in extra]},
                  {"params": [p for p in model.parameters() if id(p) in extra],
                   "weight_decay": setup.branch_weight_decay}]
    opt = torch.optim.SGD(groups, lr=setup.lr, momentum=setup.momentum, weight_decay=setup.weight_decay)
    n = len(data.train_y)
    steps_per_epoch = math.ceil(n / setup.batch)
    total = steps_per_epoch * setup.epochs
    order = torch.Generator().manual_seed(seed)
    scales: list[tuple[nn.Parameter, float]] = []
    if setup.block_step == "mean":
        named = dict(model.named_parameters())
        scales = [(named[name], scale) for name, scale in reparam.branch_step_scales(model).items()]
    step = 0
    model.train()
    for _ in range(setup.epochs):
        perm = torch.randperm(n, generator=order)
        for i in range(0, n, setup.batch):
            idx = perm[i:i + setup.batch]
            if setup.schedule == "cosine":
                for group in opt.param_groups:
                    group["lr"] = 0.5 * setup.lr * (1 + math.cos(math.pi * step / total))
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(data.train_x[idx]), data.train_y[idx]).backward()
            for param, scale in scales:
                if param.grad is not None:
                    param.grad.mul_(scale)
            opt.step()
            step += 1
    if setup.recalibrate_bn:
        _recalibrate_bn(model, data.train_x, setup.batch, setup.recalibrate_bn, seed)


def _branch_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every block's branches other than the anchor."""
    anchor = reparam.kinds.anchor_name()
    out: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, reparam.DiverseBranchBlock):
            for name, branch in m.branches.items():
                if name != anchor:
                    out.extend(branch.parameters())
    return out


def _recalibrate_bn(model: nn.Module, x: Tensor, batch: int, batches: int, seed: int) -> None:
    """Every BatchNorm's running statistics: the exact mean over ``batches`` training batches."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return
    saved = [(m, m.momentum) for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(20_000 + seed))
    model.train()
    with torch.no_grad():
        for i in range(batches):
            idx = perm[i * batch:(i + 1) * batch]
            if len(idx):
                model(x[idx])
    for m, momentum in saved:
        m.momentum = momentum


def _factory(model_name: str) -> Callable[..., Any]:
    try:
        factory = import_target(model_name)
    except IMPORT_ERRORS as exc:
        raise GainError(f"cannot load the model {model_name!r} ({type(exc).__name__}: {exc})") from None
    if not callable(factory):
        raise GainError(f"{model_name!r} is not callable (a model class or a function returning a model)")
    return factory  # type: ignore[no-any-return]


def _accepts(factory: Callable[..., Any]) -> Callable[[str], bool]:
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return lambda name: True
    return lambda name: name in params


def _takes_width(model_name: str) -> bool:
    """Whether the model can be built at another width (a zoo model, or a factory with ``width``)."""
    return ":" not in model_name or _accepts(_factory(model_name))("width")


def _plain(model_name: str, width: float, data: Splits, seed: int) -> nn.Module:
    """The plain model, built after ``torch.manual_seed(seed)``: a zoo model, or a model of your own
    named ``path/to/file.py:factory`` / ``package.module:factory``, called with the keywords it
    takes of ``num_classes``, ``in_channels``, ``width`` and ``input_size``."""
    torch.manual_seed(seed)
    kwargs = {"num_classes": data.num_classes, "in_channels": data.shape[0], "width": width,
              "input_size": data.shape[1]}
    if ":" not in model_name:
        return build_model(model_name, **kwargs)  # type: ignore[arg-type]
    factory = _factory(model_name)
    accepts = _accepts(factory)
    if width != 1.0 and not accepts("width"):
        raise GainError(f"{model_name!r} takes no 'width' argument; measure it with --widths 1")
    model = factory(**{k: v for k, v in kwargs.items() if accepts(k)})
    if not isinstance(model, nn.Module):
        raise GainError(f"{model_name!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def _blocks(model: nn.Module) -> int:
    return sum(isinstance(m, reparam.DiverseBranchBlock) for m in model.modules())


def _internal_plan(scale: float) -> Callable[[str, nn.Conv2d, Any], Any]:
    """A plan giving every conv the default plan expands its applicable default kinds, with
    ``1x1_kxk``'s internal width ``scale`` × the default (the conv's input channels; twice that for
    a depthwise conv), rounded to a multiple of the conv's groups."""
    from reparam.flops import default_internal
    from reparam.kinds import default_kinds

    def plan(path: str, conv: nn.Conv2d, bn: Any) -> Any:
        if not 1 < max(conv.kernel_size) <= 5:
            return None
        geometry = reparam.ConvGeometry.from_conv(conv)
        reasons = reparam.applicability(geometry)
        kinds: dict[str, dict[str, Any]] = {}
        for kind in default_kinds(geometry.is_depthwise):
            if reasons.get(kind) is None and not reparam.get_kind(kind).anchor:
                kinds[kind] = {}
        if "1x1_kxk" in kinds:
            g = conv.groups
            kinds["1x1_kxk"] = {"internal": max(g, int(round(scale * default_internal(geometry) / g)) * g)}
        return kinds

    return plan


def expanded_from(plain: nn.Module, *, init: str, branches: Any, seed: int,
                  internal_scale: float | None = None) -> nn.Module:
    """The expanded arm's model: ``plain`` (untrained) expanded, its new branches drawn from a
    generator of their own; ``internal_scale`` widens (or narrows) every ``1x1_kxk`` branch."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    if internal_scale is not None:
        return reparam.expand(plain, _internal_plan(internal_scale), init=init, generator=gen)
    return reparam.expand(plain, branches=branches, init=init, generator=gen)


def train_pair(model_name: str, width: float, data: Splits, setup: GainSetup, seed: int, *,
               inits: Sequence[str], branches: Any = None, plain: bool = True) -> dict[str, Any]:
    """One seed of one model and width: the plain arm (unless ``plain=False``) and one expanded arm
    per init; accuracies of the (merged) models on validation and test, and training MACs."""
    base = _plain(model_name, width, data, seed)
    out: dict[str, Any] = {}
    if plain:
        model = copy.deepcopy(base)
        _train(model, data, setup, seed)
        out["plain"] = {"val": _accuracy(model, data.val_x, data.val_y),
                        "test": _accuracy(model, data.test_x, data.test_y)}
        out["macs_plain"] = train_macs(base, data.shape)
    for init in inits:
        big = expanded_from(base, init=init, branches=branches, seed=seed,
                            internal_scale=setup.internal_scale if branches is None else None)
        if _blocks(big) == 0:
            raise GainError(f"{model_name} at width {width} has no conv that reparam expands "
                            f"(branches {branches or 'default'}); nothing to compare")
        if "macs_expanded" not in out:  # the same structure for every init
            out["macs_expanded"] = train_macs(big, data.shape)
        _train(big, data, setup, seed)
        big.eval()
        merged = reparam.merge(big)
        x = data.test_x[:256]
        with torch.no_grad():
            ref, got = big(x), merged(x)
        err = float((ref - got).abs().max()) / max(1e-12, float(ref.abs().max()))
        if not err < 1e-4:  # float32, relative to the output scale
            raise RuntimeError(f"{model_name} width {width} init {init}: the merge is not lossless "
                               f"(relative error {err:.2e})")
        out[init] = {"val": _accuracy(merged, data.val_x, data.val_y),
                     "test": _accuracy(merged, data.test_x, data.test_y), "merge_error": err}
    return out


def _mean_std(values: Iterable[float]) -> tuple[float, float]:
    v = list(values)
    return (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0)


def _summarise(rows: dict[int, dict[str, Any]], init: str, split: str = "test") -> dict[str, Any]:
    seeds = sorted(rows)
    gains = [rows[s][init][split] - rows[s]["plain"][split] for s in seeds]
    plain, plain_std = _mean_std(rows[s]["plain"][split] for s in seeds)
    expanded, expanded_std = _mean_std(rows[s][init][split] for s in seeds)
    gain, gain_std = _mean_std(gains)
    return {
        "plain": plain, "plain_std": plain_std, "expanded": expanded, "expanded_std": expanded_std,
        "gain": gain, "gain_std": gain_std, "gains": gains,
    }


def _by_init(rows: dict[int, dict[str, Any]], init: str) -> dict[str, Any]:
    """One init's test summary (without the plain arm's) and its validation gain."""
    test, val = _summarise(rows, init), _summarise(rows, init, "val")
    return {**{k: v for k, v in test.items() if k not in ("plain", "plain_std")},
            "val_gain": val["gain"], "val_gain_std": val["gain_std"]}


def run_benchmark(
    *,
    dataset: str = "digits",
    data_dir: str | None = None,
    models: Sequence[str] = DEFAULT_MODELS,
    widths: Sequence[float] = DEFAULT_WIDTHS,
    seeds: int = 3,
    inits: Sequence[str] = (reparam.SCRATCH_INIT,),
    kinds: bool = True,
    setup: GainSetup = GainSetup(),
    val_fraction: float = 0.1,
    train_samples: int | None = None,
    threads: int | None = 2,
    progress: Callable[[str], None] = lambda line: None,
    checkpoint: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Run the grid; see the module docstring. The first of ``inits`` is the ``expanded`` arm of
    the summary; every init has its own entry under ``inits``. ``checkpoint`` is called with the
    result so far after every seed (the seeds of an unfinished model under ``"partial"``), so that
    a long run stopped early keeps what it measured."""
    if threads:
        torch.set_num_threads(threads)
    if not inits:
        raise GainError("no init to measure")
    for init in inits:
        if init not in reparam.block.INITS:
            raise GainError(f"unknown init {init!r}; accepted: {', '.join(reparam.block.INITS)}")
    t0 = time.perf_counter()
    data = load_splits(dataset, data_dir, val_fraction=val_fraction, train_samples=train_samples)
    seed_list = list(range(seeds))
    widths = sorted(set(widths))
    result: dict[str, Any] = {
        "dataset": dataset, "input_shape": list(data.shape), "train_samples": len(data.train_y),
        "val_samples": len(data.val_y), "test_samples": len(data.test_y), "seeds": seed_list,
        "setup": setup.__dict__, "inits": list(inits), "default_init": inits[0],
        "dbb_paper": [{"dataset": d, "model": m, "original": a, "dbb": b, "gain": round(b - a, 2)}
                      for d, m, a, b in DBB_PAPER],
        "models": {},
    }
    for model_name in models:
        per_width: dict[float, dict[int, dict[str, Any]]] = {}
        for width in widths:
            per_width[width] = {}
            for seed in seed_list:
                per_width[width][seed] = train_pair(model_name, width, data, setup, seed, inits=inits)
                r = per_width[width][seed]
                progress(f"{model_name} ×{width:g} seed {seed}: test (val) plain {r['plain']['test']:.2f} "
                         f"({r['plain']['val']:.2f}) %, "
                         + ", ".join(f"{i} {r[i]['test']:.2f} ({r[i]['val']:.2f}) %" for i in inits))
                partial = result.setdefault("partial", {}).setdefault(model_name, {})
                partial.setdefault(f"{width:g}", {})[str(seed)] = r
                checkpoint(result)
        # the plain model at twice the largest width: the width gain of the largest width
        doubled: dict[float, list[float]] = {}
        top = widths[-1]
        if 2 * top not in per_width and _takes_width(model_name):
            doubled[2 * top] = []
            for seed in seed_list:
                model = _plain(model_name, 2 * top, data, seed)
                _train(model, data, setup, seed)
                doubled[2 * top].append(_accuracy(model, data.test_x, data.test_y))
            progress(f"{model_name} ×{2 * top:g} plain: {statistics.fmean(doubled[2 * top]):.2f} %")
        entries: dict[str, Any] = {}
        for width in widths:
            rows = per_width[width]
            entry = _summarise(rows, inits[0])
            entry["seeds"] = seed_list
            entry["val"] = {k: v for k, v in _summarise(rows, inits[0], "val").items() if k != "gains"}
            twice = 2 * width
            plain_twice = ([per_width[twice][s]["plain"]["test"] for s in seed_list] if twice in per_width
                           else doubled.get(twice))
            entry["width_gain"] = (statistics.fmean(plain_twice) - entry["plain"]) if plain_twice else None
            entry["macs_plain"] = rows[seed_list[0]]["macs_plain"]
            entry["macs_expanded"] = rows[seed_list[0]]["macs_expanded"]
            entry["inits"] = {i: _by_init(rows, i) for i in inits}
            entries[f"{width:g}"] = entry
        result["models"][model_name] = {"widths": entries}
        result.get("partial", {}).pop(model_name, None)
        checkpoint(result)
        if kinds:
            # each branch kind alone, at the width whose gain is largest on the validation split
            best = max(widths, key=lambda w: entries[f"{w:g}"]["val"]["gain"])
            base = _plain(model_name, best, data, 0)
            scan = reparam.expand(base)
            present = sorted({name for m in scan.modules() if isinstance(m, reparam.DiverseBranchBlock)
                              for name in m.branches if name != reparam.kinds.anchor_name()})
            alone: dict[str, Any] = {}
            for kind in present:
                rows = {}
                for seed in seed_list:
                    rows[seed] = {"plain": per_width[best][seed]["plain"],
                                  **train_pair(model_name, best, data, setup, seed, inits=inits[:1],
                                               branches=[kind], plain=False)}
                alone[kind] = {**_summarise(rows, inits[0]),
                               "val_gain": _summarise(rows, inits[0], "val")["gain"],
                               "macs_expanded": rows[seed_list[0]]["macs_expanded"]}
                progress(f"{model_name} ×{best:g} {kind} alone: gain {alone[kind]['gain']:+.2f} "
                         f"± {alone[kind]['gain_std']:.2f}")
            result["models"][model_name]["kinds_alone"] = {"width": best, "kinds": alone}
            checkpoint(result)
    result["seconds"] = time.perf_counter() - t0
    result.pop("partial", None)
    return result


def print_table(res: dict[str, Any], console: Any = None) -> None:
    """The result as tables (rich when a console is given, else plain text)."""
    lines = [f"reparam-gain on {res['dataset']} ({res['train_samples']} training / {res['val_samples']} "
             f"validation / {res['test_samples']} test images; {len(res['seeds'])} seeds; "
             f"{res['setup']['epochs']} epochs; expanded arm: init {res['default_init']})"]
    header = "model  width  plain %  expanded %  gain (mean ± std)  val gain  width gain  train MACs ×"
    for name, m in res["models"].items():
        lines.append("")
        lines.append(header)
        for width, e in m["widths"].items():
            wg = "—" if e["width_gain"] is None else f"{e['width_gain']:+.2f}"
            lines.append(
                f"{name:6s} {width:>5s}  {e['plain']:7.2f}  {e['expanded']:10.2f}  {e['gain']:+7.2f} ± {e['gain_std']:.2f}"
                f"     {e['val']['gain']:+6.2f}  {wg:>10s}  {e['macs_expanded'] / e['macs_plain']:.2f}"
            )
        inits = res["inits"]
        if len(inits) > 1:
            lines.append("  by init (test gain ± std | val gain): " + "; ".join(
                f"×{w}: " + ", ".join(f"{i} {e['inits'][i]['gain']:+.2f} ± {e['inits'][i]['gain_std']:.2f} | "
                                      f"{e['inits'][i]['val_gain']:+.2f}" for i in inits)
                for w, e in m["widths"].items()))
        ka = m.get("kinds_alone")
        if ka:
            lines.append(f"  each kind alone at ×{ka['width']:g}: " + ", ".join(
                f"{k} {v['gain']:+.2f} ± {v['gain_std']:.2f}" for k, v in ka["kinds"].items()))
    lines.append("")
    lines.append("the DBB paper (Table 2; top-1 %): " + "; ".join(
        f"{r['dataset']} {r['model']} {r['original']:.2f} → {r['dbb']:.2f} ({r['gain']:+.2f})" for r in res["dbb_paper"]))
    text = "\n".join(lines)
    if console is None:
        print(text)
    else:
        console.print(text, markup=False, highlight=False)
