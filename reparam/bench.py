"""Benchmark of the re-parameterization library on a CIFAR ResNet-18 (CPU).

Measured side by side in one run, with warm-up iterations and interleaved repeats; each time is the
best of its repeats (as ``timeit`` reports: on a shared machine other processes only ever add time,
so the minimum is the stable estimate of a cost; every sample is kept in the JSON output):

* whole-model merge time: ``reparam.merge(model, inplace=True)`` (the target row) and the default
  ``reparam.merge(model)``, which deep-copies the model first (both before any allocator tuning);
* inference time (eval mode, ``no_grad``) of the merged, the expanded and the plain original model;
* training-step time (forward, backward, SGD step) of the expanded and the plain model, next to
  their forward-MAC ratio, and the overhead per MAC = step-time ratio ÷ MAC ratio. Measured twice:
  first with the C allocator as the process found it, then after :func:`reparam.allocator.tune_malloc`
  (freed activation memory stays in the heap; the ``fedhetero`` trainer runs this way), where the
  expanded model is also timed with the per-branch forward (:func:`reparam.fused.fused_training`
  off) to show what the fused training forward saves. The target row is the tuned one.

Reference numbers of the upstream implementation that the library replaces are printed alongside.

Run ``python -m reparam.bench --help``. :func:`run_benchmark` returns the numbers as a dict and
:func:`main` is the command-line entry point.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn
import torch.nn.functional as F

__all__ = ["run_benchmark", "main", "UPSTREAM", "TARGETS"]

#: upstream reference numbers (same model, input and batch size)
UPSTREAM: dict[str, float] = {
    "macs_ratio": 2.27,
    "step_ratio": 3.89,
    "overhead_per_mac": 1.71,
    "merge_ms": 258.0,
    "merged_over_plain": 0.97,
}
#: targets of this library
TARGETS: dict[str, float] = {"merge_ms": 50.0, "merged_over_plain": 1.02, "overhead_per_mac": 1.3}


# --------------------------------------------------------------------------------------------
# model


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class _CifarResNet18(nn.Module):
    """Fallback CIFAR ResNet-18 (3×3 stem, no max-pool) used when no model zoo is importable."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(_Basic(cin, cout, stride), _Basic(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _default_model(num_classes: int = 10) -> tuple[nn.Module, str]:
    """CIFAR ResNet-18: the project's model zoo if present, else torchvision adapted, else built in."""
    try:
        zoo = importlib.import_module("models")
        return zoo.build_model("resnet18", num_classes=num_classes), "models.build_model('resnet18')"
    except (ImportError, AttributeError, ValueError):
        pass
    try:
        try:
            tv = importlib.import_module("fedhetero._compat").import_torchvision()
        except ImportError:
            tv = importlib.import_module("torchvision")
        m = tv.models.resnet18(num_classes=num_classes)
        m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        m.maxpool = nn.Identity()
        return m, "torchvision resnet18 (3x3 stem, no max-pool)"
    except Exception:  # noqa: BLE001 - any failure of the optional import falls back
        return _CifarResNet18(num_classes), "built-in CIFAR ResNet-18"


# --------------------------------------------------------------------------------------------
# timing


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(
    fns: dict[str, Callable[[], Any]], warmup: int, repeats: int, log: dict[str, list[float]], tag: str
) -> dict[str, float]:
    """Best seconds per call of each function, calls interleaved round-robin (samples into ``log``)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            samples[k].append(_timed(fn))
    return _best(samples, log, tag)


def _best(samples: dict[str, list[float]], log: dict[str, list[float]], tag: str) -> dict[str, float]:
    """The minimum of each measure's samples; the samples (ms) go into ``log`` as ``tag.measure``."""
    for k, v in samples.items():
        log[f"{tag}.{k}"] = [round(t * 1e3, 3) for t in v]
    return {k: min(v) for k, v in samples.items()}


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
    model: nn.Module | None = None,
    input_size: int = 32,
    seed: int = 0,
    tune_allocator: bool = True,
) -> dict:
    """Measure merge time, inference and training-step cost; return a JSON-able dict.

    Args:
        batch: batch size of the timed forward/training steps.
        repeats: timed inference repeats (best reported); ``warmup`` untimed calls first.
        threads: ``torch.set_num_threads`` during the run (restored afterwards); ``None`` keeps it.
        branches: branch kinds for ``reparam.expand`` (default: the library's default set).
        merge_repeats: timed repeats of the whole-model merge.
        train_repeats: timed training steps per model (best; training dominates the run time).
        tune_allocator: also time training after :func:`reparam.allocator.tune_malloc` (the target
            row); with ``False`` the allocator is left alone and the first measurement is the target.
        model: a plain model to use instead of the CIFAR ResNet-18 (input ``3 × input_size²``).
        seed: seed of the random data and BN statistics.
    """
    from . import allocator, convert, flops, fused

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
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        if model is None:
            plain, model_name = _default_model()
        else:
            plain, model_name = model, type(model).__name__
        input_shape = (3, input_size, input_size)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, *input_shape, generator=gen)
        plain.eval()
        with torch.no_grad():
            num_classes = int(plain(x[:1]).shape[-1])
        y = torch.randint(0, num_classes, (batch,), generator=gen)

        kwargs = {} if branches is None else {"branches": list(branches)}
        expanded = convert.expand(plain, **kwargs)
        # non-trivial branch weights and statistics, so the merge is not vacuous
        _randomize(expanded, gen)
        expanded.eval()
        plain.eval()

        macs_plain = flops.model_macs(plain, input_shape)
        macs_expanded = flops.model_macs(expanded, input_shape)

        tuned_before = allocator.malloc_tuned()
        merge_system = _merge_times(expanded, merge_repeats, log, "allocator_as_found")
        merged = convert.merge(expanded)
        merged.eval()
        with torch.no_grad():
            ref = expanded(x[:8])
            out = merged(x[:8])
        merge_rel_err = float((out - ref).abs().max() / ref.abs().max())

        infer = _interleaved(
            {"plain": _infer_fn(plain, x), "expanded": _infer_fn(expanded, x), "merged": _infer_fn(merged, x)},
            warmup,
            repeats,
            log,
            "inference",
        )
        plain_t = copy.deepcopy(plain).train()
        expanded_t = copy.deepcopy(expanded).train()
        steps = {"plain": _train_step_fn(plain_t, x, y), "expanded": _train_step_fn(expanded_t, x, y)}
        train_system = _interleaved(steps, warmup, train_repeats, log, "train_allocator_as_found")
        train = train_system
        tuned = False
        if tune_allocator:
            tuned = allocator.tune_malloc()
        if tuned:
            per_branch = _train_step_fn(copy.deepcopy(expanded).train(), x, y)

            def unfused() -> None:
                with fused.fused_training(False):
                    per_branch()

            train = _interleaved({**steps, "expanded_per_branch": unfused}, warmup, train_repeats, log, "train_tuned_malloc")
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
        "macs_plain": int(macs_plain),
        "macs_expanded": int(macs_expanded),
        "macs_ratio": macs_ratio,
        "merge_ms": merge_system[0] * 1e3,
        "merge_with_copy_ms": merge_system[1] * 1e3,
        "merge_rel_err_fp32": merge_rel_err,
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
        "targets": dict(TARGETS),
        "upstream": dict(UPSTREAM),
        "samples_ms": log,
    }


def _merge_times(expanded: nn.Module, repeats: int, log: dict[str, list[float]], tag: str) -> tuple[float, float]:
    """Median seconds of ``reparam.merge(copy, inplace=True)`` (the merge alone, on copies made
    beforehand) and of ``reparam.merge(expanded)`` (deep copy included), after one warm-up each."""
    from . import convert

    convert.merge(expanded)
    convert.merge(copy.deepcopy(expanded), inplace=True)
    with_copy = [_timed(lambda: convert.merge(expanded)) for _ in range(repeats)]
    copies = [copy.deepcopy(expanded) for _ in range(repeats)]
    inplace = [_timed(lambda c=c: convert.merge(c, inplace=True)) for c in copies]
    best = _best({"merge_inplace": inplace, "merge_with_copy": with_copy}, log, tag)
    return best["merge_inplace"], best["merge_with_copy"]


def _randomize(model: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d) and m.affine:
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)


# --------------------------------------------------------------------------------------------
# presentation


def _print_table(res: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency of the project
        print(json.dumps(res, indent=2))
        return

    def ok(value: float, target: float) -> str:
        return "[green]yes[/green]" if value <= target else "[red]no[/red]"

    t = Table(title=f"reparam benchmark: {res['model']}, batch {res['batch']}, "
              f"{res['threads']} threads, CPU (best of {res['repeats']} inference / "
              f"{res['train_repeats']} training / {res['merge_repeats']} merge repeats)")
    for col in ("measure", "ours", "target", "met", "upstream"):
        t.add_column(col, justify="right" if col != "measure" else "left")
    inf, tr, up = res["infer_ms"], res["train_step_ms"], res["upstream"]
    t.add_row("whole-model merge, in place (ms)", f"{res['merge_ms']:.1f}", "<= 50",
              ok(res["merge_ms"], TARGETS["merge_ms"]), f"{up['merge_ms']:.0f}")
    t.add_row("  reparam.merge(model), deep copy incl. (ms)", f"{res['merge_with_copy_ms']:.1f}", "", "", "")
    t.add_row("  merged vs expanded rel. err (fp32)", f"{res['merge_rel_err_fp32']:.1e}", "", "", "")
    t.add_row("inference plain (ms)", f"{inf['plain']:.1f}", "", "", "")
    t.add_row("inference expanded (ms)", f"{inf['expanded']:.1f}", "", "", "")
    t.add_row("inference merged (ms)", f"{inf['merged']:.1f}", "", "", "")
    t.add_row("merged / plain", f"{res['merged_over_plain']:.3f}", "<= 1.02",
              ok(res["merged_over_plain"], TARGETS["merged_over_plain"]), f"{up['merged_over_plain']:.2f}")
    t.add_row("MACs expanded / plain", f"{res['macs_ratio']:.2f}", "", "", f"{up['macs_ratio']:.2f}")
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
    t.add_row("step time expanded / plain", f"{res['step_ratio']:.2f}", "", "", f"{up['step_ratio']:.2f}")
    t.add_row("overhead per MAC (time ratio / MACs ratio)", f"{res['overhead_per_mac']:.2f}", "<= 1.3",
              ok(res["overhead_per_mac"], TARGETS["overhead_per_mac"]), f"{up['overhead_per_mac']:.2f}")
    Console().print(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m reparam.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed inference repeats, best reported (default 5)")
    p.add_argument("--train-repeats", type=int, default=3, help="timed training steps per model (default 3)")
    p.add_argument("--merge-repeats", type=int, default=5, help="timed whole-model merges (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls (default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2; 0 = keep torch's)")
    p.add_argument("--branches", type=str, default=None,
                   help="comma-separated branch kinds for expand (default: the library default set)")
    p.add_argument("--json", type=str, default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tune-malloc", action="store_true",
                   help="leave the C allocator alone (time training once, as the process found it)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    branches = None
    if args.branches:
        branches = [b.strip() for b in args.branches.split(",") if b.strip()]
    res = run_benchmark(
        batch=args.batch,
        repeats=args.repeats,
        train_repeats=args.train_repeats,
        merge_repeats=args.merge_repeats,
        warmup=args.warmup,
        threads=args.threads or None,
        branches=branches,
        seed=args.seed,
        tune_allocator=not args.no_tune_malloc,
    )
    _print_table(res)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
