"""``fedhetero bench reparam|reparam-gain|round|memory|engines|selector|vectorize``: the lab's benchmarks.

The options of every benchmark are declared here; the measuring code is in :mod:`fedhetero.lab`
(:mod:`~fedhetero.lab.bench_reparam`, :mod:`~fedhetero.lab.bench_gain`, :mod:`~fedhetero.lab.bench`, :mod:`~fedhetero.lab.bench_selector`,
:mod:`~fedhetero.lab.bench_vectorize`).
Those modules import torch (and ``reparam``), so each ``run_*`` imports its module when it runs:
``fedhetero --help`` does not pay for them. For the same reason the choices of two options are named
here (a test keeps them equal to the lab's).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from fedhetero.core.common.console import make_console

__all__ = [
    "GAIN_INITS", "REPARAM_MODELS", "SELECTORS", "add_parser", "run_engines", "run_memory", "run_reparam",
    "run_reparam_gain", "run_round", "run_selector", "run_vectorize",
]

#: ``--model`` of ``bench reparam``: :data:`fedhetero.lab.bench_reparam.MODELS` (not imported here)
REPARAM_MODELS = ("resnet18", "tv-resnet18")
#: ``--selectors`` of ``bench selector``: :data:`fedhetero.lab.bench_selector.SELECTORS` (not imported here)
SELECTORS = ("ensemble_dp", "exhaustive", "random", "genetic")
#: ``--inits`` of ``bench reparam-gain``: :data:`reparam.block.INITS` (not imported here)
GAIN_INITS = ("zero_gamma", "random_resolve", "random")
#: its default ``--epochs`` per data set (digits is small: 20 epochs are 400 steps)
GAIN_EPOCHS = {"digits": 20}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` with its benchmarks to a ``add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: reparam | reparam-gain | round | memory | engines | selector | vectorize",
        description="Benchmarks measured side by side in one run; pass --help after the name for its options.",
    )
    sub = parser.add_subparsers(dest="what", required=True)
    for add in (_add_reparam, _add_reparam_gain, _add_round, _add_memory, _add_engines, _add_selector, _add_vectorize):
        add(sub)
    return parser


# ---------------------------------------------------------------------------------------- reparam
def _add_reparam(sub: Any) -> None:
    p = sub.add_parser(
        "reparam",
        help="merge time, inference and training-step overhead of expanded models",
        description="``fedhetero bench reparam``: cost of the re-parameterization library on a ResNet-18 (CPU), "
        "next to upstream: the public reference implementation of the Diverse Branch Block "
        "(github.com/DingXiaoH/DiverseBranchBlock), whose merge is re-implemented and timed in the same run. "
        "Takes roughly 2-5 minutes with the defaults on an idle 2-core CPU; progress goes to stderr.",
    )
    p.add_argument("--model", choices=REPARAM_MODELS, default="resnet18",
                   help="resnet18: the zoo's CIFAR ResNet-18 (default); tv-resnet18: torchvision's resnet18")
    p.add_argument("--input-size", type=int, default=32, help="input height and width (default 32)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed inference repeats, best reported (default 5)")
    p.add_argument("--train-repeats", type=int, default=3, help="timed training steps per model (default 3)")
    p.add_argument("--merge-repeats", type=int, default=5, help="timed repeats of each merge variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls (default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2; 0 = keep torch's)")
    p.add_argument("--branches", type=str, default=None,
                   help="comma-separated branch kinds for expand (default: the library default set)")
    p.add_argument("--json", type=str, default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tune-malloc", action="store_true",
                   help="leave the C allocator alone (time training once, as the process found it)")
    p.set_defaults(func=run_reparam)


#: the settings ``bench_reparam.DEFAULT_DURATION`` was measured with (the parser's defaults)
_REPARAM_DEFAULTS = {"model": "resnet18", "input_size": 32, "batch": 64, "repeats": 5, "train_repeats": 3,
                     "merge_repeats": 5, "warmup": 1, "threads": 2, "branches": None}


def run_reparam(args: argparse.Namespace) -> int:
    """Run ``fedhetero bench reparam``."""
    # deferred for start-up time: the benchmark imports torch and reparam
    from fedhetero.lab import bench_reparam

    branches = None
    if args.branches:
        branches = [b.strip() for b in args.branches.split(",") if b.strip()]
    err = make_console(stderr=True, highlight=False)
    defaults = all(getattr(args, k) == v for k, v in _REPARAM_DEFAULTS.items())
    err.print(f"fedhetero bench reparam: {args.model}, batch {args.batch}, {args.input_size}×{args.input_size} input; "
              + bench_reparam.duration_note(defaults=defaults), markup=False)
    err.print(bench_reparam.UPSTREAM, markup=False)
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        err.print(f"{time.perf_counter() - t0:6.1f} s  {line}", markup=False)

    res = bench_reparam.run_benchmark(
        model=args.model,
        input_size=args.input_size,
        batch=args.batch,
        repeats=args.repeats,
        train_repeats=args.train_repeats,
        merge_repeats=args.merge_repeats,
        warmup=args.warmup,
        threads=args.threads or None,
        branches=branches,
        seed=args.seed,
        tune_allocator=not args.no_tune_malloc,
        progress=progress,
    )
    progress("done")
    bench_reparam.print_table(res, make_console())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=2)
    return 0


# ----------------------------------------------------------------------------------- reparam-gain
def _positive_list(cast: Any, what: str) -> Any:
    """An argparse type: comma-separated positive ``cast`` values (``what`` names them in errors)."""

    def parse(text: str) -> list[Any]:
        try:
            values = [cast(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive {what}, got {text!r}")
        return values

    return parse


def _names(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


def _inits(text: str) -> list[str]:
    values = _names(text)
    bad = [v for v in values if v not in GAIN_INITS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown init {bad[0]!r}; accepted: {', '.join(GAIN_INITS)}")
    return values


def _add_reparam_gain(sub: Any) -> None:
    p = sub.add_parser(
        "reparam-gain",
        help="accuracy of a model trained expanded and merged vs the same structure trained plain",
        description="``fedhetero bench reparam-gain``: trains the same deployed structure two ways from the "
        "same starting weights, with the same data order, epochs, schedule and seed: plain, and expanded into "
        "Diverse Branch Blocks (default branch kinds) then merged. Reports the merged model's test accuracy "
        "for each, the paired gain (mean ± std over seeds), the validation gain (choices are made on a "
        "validation split held out of the training set), the width gain (the plain model at twice the width "
        "minus at this width: the capacity there is to transfer) and the training MACs of each; then each "
        "branch kind alone at the width whose validation gain is largest, and the DBB paper's own gains "
        "beside. Digits (bundled) by default: about 10-17 minutes on 2 cores (20 epochs); Fashion-MNIST with "
        "--dataset fashion_mnist --data-dir DIR. Progress goes to stderr.",
    )
    p.add_argument("--dataset", default="digits", help="data set (default digits; e.g. fashion_mnist)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="folder holding the data set's files (default: $FEDHETERO_DATA_DIR or ./data)")
    p.add_argument("--models", type=_names, default=["lenet5", "cnn"], metavar="NAME,...",
                   help="zoo models (default lenet5,cnn: LeNet-5 and the FedDUMAP CNN, with BatchNorm), or a "
                   "model of your own as path/to/file.py:factory or package.module:factory, called with the "
                   "keywords it takes of num_classes, in_channels, width and input_size")
    p.add_argument("--widths", type=_positive_list(float, "numbers"), default=[0.125, 0.25, 0.5, 1.0], metavar="W,...",
                   help="width multipliers (default 0.125,0.25,0.5,1)")
    p.add_argument("--seeds", type=_positive, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--epochs", type=_positive, default=None,
                   help="epochs of each arm (default 20 on digits, 3 otherwise)")
    p.add_argument("--inits", type=_inits, default=None, metavar="INIT,...",
                   help="branch initialisations of the expanded arm, each measured (default: reparam.SCRATCH_INIT, "
                   "what expand(from_scratch=True) uses); the first is the summary's 'expanded'. "
                   f"Accepted: {', '.join(GAIN_INITS)}")
    p.add_argument("--batch", type=_positive, default=64, help="batch size (default 64)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, cosine to 0 (default 0.05)")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="weight decay of every parameter (default 1e-4)")
    p.add_argument("--recalibrate-bn", type=int, default=0, metavar="N",
                   help="candidate: re-estimate every BatchNorm's statistics over N training batches before "
                   "evaluating and merging, in both arms (default 0: the running statistics of training)")
    p.add_argument("--branch-weight-decay", type=float, default=None, metavar="WD",
                   help="candidate: weight decay of the expanded arm's branches other than the anchor "
                   "(default: --weight-decay)")
    p.add_argument("--block-step", choices=("sum", "mean"), default="sum",
                   help="candidate: how far a block's merged kernel moves in a step: the sum of its branches' "
                   "steps (default; DBB training) or their mean (reparam.branch_step_scales)")
    p.add_argument("--internal-scale", type=float, default=None, metavar="X",
                   help="candidate: the internal width of every 1x1_kxk branch, X times the default "
                   "(the conv's input channels)")
    p.add_argument("--train-samples", type=_positive, default=None,
                   help="train on a stratified subset of this many images (default: the whole training split)")
    p.add_argument("--no-kinds", action="store_true", help="skip the rows of each branch kind alone")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2; 0 = keep torch's)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the results as JSON (rewritten after every seed, so a stopped run keeps them)")
    p.set_defaults(func=run_reparam_gain)


def run_reparam_gain(args: argparse.Namespace) -> int:
    """Run ``fedhetero bench reparam-gain``; a set-up it cannot run ends in one line, exit 2."""
    # deferred for start-up time: the benchmark imports torch, reparam and the data sets
    from fedhetero.data.errors import DataConfigError, DatasetFormatError, DatasetNotFoundError
    from fedhetero.lab import bench_gain
    import reparam

    err = make_console(stderr=True, highlight=False)
    epochs = args.epochs or GAIN_EPOCHS.get(args.dataset, 3)
    inits = args.inits or [reparam.SCRATCH_INIT]
    setup = bench_gain.GainSetup(epochs=epochs, batch=args.batch, lr=args.lr, weight_decay=args.weight_decay,
                                 recalibrate_bn=args.recalibrate_bn, branch_weight_decay=args.branch_weight_decay,
                                 block_step=args.block_step, internal_scale=args.internal_scale)
    err.print(f"fedhetero bench reparam-gain: {', '.join(args.models)} on {args.dataset} at widths "
              f"{', '.join(f'{w:g}' for w in args.widths)}; {args.seeds} seeds, {epochs} epochs, inits "
              f"{', '.join(inits)}", markup=False)
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        err.print(f"{time.perf_counter() - t0:7.1f} s  {line}", markup=False)

    def write(res: dict[str, Any]) -> None:
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(res, indent=2), encoding="utf-8")
            tmp.replace(path)

    try:
        res = bench_gain.run_benchmark(
            dataset=args.dataset, data_dir=args.data_dir, models=args.models, widths=args.widths,
            seeds=args.seeds, inits=inits, kinds=not args.no_kinds, setup=setup,
            train_samples=args.train_samples, threads=args.threads or None, progress=progress,
            checkpoint=write,
        )
    except (bench_gain.GainError, DataConfigError, DatasetFormatError, DatasetNotFoundError) as exc:
        err.print(f"fedhetero bench reparam-gain: {' '.join(str(exc).split())}", markup=False)
        return 2
    except ValueError as exc:  # an unknown model name
        if "unknown model" not in str(exc):
            raise
        err.print(f"fedhetero bench reparam-gain: {exc}", markup=False)
        return 2
    progress("done")
    bench_gain.print_table(res, make_console())
    write(res)
    return 0


# ------------------------------------------------------------------------------------------ round
def _add_round(sub: Any) -> None:
    p = sub.add_parser(
        "round",
        help="engine overhead vs a bare PyTorch loop; REP/DYMM/merge share of a round",
        description="FedAvg through the engine vs a bare hand-written PyTorch loop doing the same training "
        "(same data, clients, batch order, model), and the share of a DynamicFL round spent in REP, DYMM "
        "and merge. Both sides run interleaved; the median of the repeats is reported. Then a round of "
        "FedAvg and one of DynamicFL at the DynamicFL paper's protocol (Fashion-MNIST when found), side by "
        "side, with the ratio of their clients' training MACs and, per DynamicFL tier, its time and MACs per "
        "training sample against FedAvg's.",
    )
    p.add_argument("--clients", type=int, default=100, help="clients in the federation (default 100)")
    p.add_argument("--per-round", type=int, default=10, help="clients sampled per round (default 10)")
    p.add_argument("--rounds", type=int, default=10, help="rounds per timed run (default 10)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of each side (default 5)")
    p.add_argument("--model", default="lenet5", help="zoo model (default lenet5)")
    p.add_argument("--dataset", default="digits", help="data set (default digits)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--dynamicfl-rounds", type=int, default=10, help="rounds of the DynamicFL share measurement")
    p.add_argument("--paper-rounds", type=int, default=4, metavar="N",
                   help="rounds of FedAvg and of DynamicFL at the DynamicFL paper's protocol, timed side by side "
                   "after the warm-up, and FedAvg again without batched cohorts (default 4; 0 skips them): JSON "
                   "dynamicfl_over_fedavg, mac_ratio and dynamicfl_over_fedavg_one_by_one")
    p.add_argument("--paper-warmup", type=int, default=30, metavar="N",
                   help="untimed rounds before them, so that the timed tasks are mostly returning clients "
                   "training trained models, as in a real run (default 30: about 3 minutes)")
    p.add_argument("--data-root", default=None, metavar="DIR",
                   help="folder holding Fashion-MNIST's IDX files for the paper-protocol rounds (default: "
                   "$FEDHETERO_DATA_DIR or ./data); synthetic images of the same shape when they are not there")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the paper-protocol rounds train: cpu (default) or cuda (a GPU's rows, where DynamicFL's "
                   "coinciding segments train as batched cohorts; the engine and share rows always run on the CPU)")
    p.add_argument("--paper-only", action="store_true",
                   help="only the paper-protocol rounds (skip the engine-vs-bare and DynamicFL-share rows)")
    p.add_argument("--json", help="write the numbers to this file")
    p.set_defaults(func=run_round)


def run_round(args: argparse.Namespace) -> int:
    """Run ``fedhetero bench round``."""
    # deferred for start-up time: the benchmark imports torch
    from fedhetero.lab import bench

    bench.round_benchmark(
        clients=args.clients, per_round=args.per_round, rounds=args.rounds, repeats=args.repeats,
        model=args.model, dataset=args.dataset, threads=args.threads, dynamicfl_rounds=args.dynamicfl_rounds,
        json_path=args.json, paper=args.paper_rounds, paper_warmup=args.paper_warmup, data_root=args.data_root,
        device=args.device, paper_only=args.paper_only,
    )
    return 0


# ----------------------------------------------------------------------------------------- memory
def _add_memory(sub: Any) -> None:
    p = sub.add_parser(
        "memory",
        help="peak memory: 1000 clients at 1 %% vs 100 clients at 10 %%",
        description="Peak resident memory of 1000 clients at 1 % sampling vs 100 clients at 10 % sampling "
        "(each in a fresh subprocess), showing that memory follows the clients sampled per round, not "
        "the clients that exist.",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--algorithm", default="dynamicfl")
    p.add_argument("--json", help="write the numbers to this file")
    p.set_defaults(func=run_memory)


def run_memory(args: argparse.Namespace) -> int:
    """Run ``fedhetero bench memory``."""
    # deferred for start-up time: the benchmark imports torch
    from fedhetero.lab import bench

    bench.memory_benchmark(rounds=args.rounds, algorithm=args.algorithm, json_path=args.json)
    return 0


# ---------------------------------------------------------------------------------------- engines
def _add_engines(sub: Any) -> None:
    p = sub.add_parser(
        "engines",
        help="process vs local back end (and the machine's ceiling), local vs a bare loop, "
        "Flower vs Flower's FedAvg",
        description="The same FedAvg job (digits, LeNet-5, 100 clients, 10 per round, 1 local epoch, "
        "10 rounds; evaluation after the last round) on each back end, measured side by side: "
        "process/local client throughput (also for the client phase alone, beside two independent "
        "local runs at once and the bound a back end with free messages could reach on this "
        "machine), local vs a bare hand-written loop and, with the flower extra, our Flower back end "
        "vs Flower's own FedAvg strategy. Worker start-up is timed apart from the rounds.",
    )
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2,
                   help="engine.workers of the process back end: executors, this process included (default 2)")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--model", default="lenet5")
    p.add_argument("--no-flower", action="store_true", help="skip the Flower rows")
    p.add_argument("--heavy-epochs", type=int, default=5,
                   help="local epochs of the second process/local row (more work per client task; default 5)")
    p.add_argument("--json", help="write the numbers to this file")
    p.set_defaults(func=run_engines)


def run_engines(args: argparse.Namespace) -> int:
    """Run ``fedhetero bench engines``."""
    # deferred for start-up time: the benchmark imports torch
    from fedhetero.lab import bench

    bench.engines_benchmark(
        clients=args.clients, per_round=args.per_round, rounds=args.rounds, repeats=args.repeats,
        workers=args.workers, dataset=args.dataset, model=args.model, flower=not args.no_flower,
        heavy_epochs=args.heavy_epochs, json_path=args.json,
    )
    return 0


# --------------------------------------------------------------------------------------- selector
def _add_selector(sub: Any) -> None:
    p = sub.add_parser(
        "selector",
        help="DynaComm's group selectors: KL reached and time per call",
        description="``fedhetero bench selector``: DynaComm's group selectors side by side.",
    )
    p.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100], help="active clients per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds (active sets) per client count")
    p.add_argument("--population", type=int, default=None,
                   help="clients in the partition (default 10 per active client; at least --clients)")
    p.add_argument("--samples", type=int, default=500, help="samples per client in the pool")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration of the partition")
    p.add_argument("--beta", type=float, default=None, help="Dynamic-β cap ⌊β·n⌋ on the group size")
    p.add_argument("--orders", type=int, default=10, help="random client orders of ensemble_dp")
    p.add_argument("--exhaustive-max", type=int, default=12, help="largest n searched exhaustively")
    p.add_argument("--ga-population", type=int, default=50)
    p.add_argument("--ga-iterations", type=int, default=200)
    p.add_argument("--ga-mutation", type=float, default=0.01)
    p.add_argument("--selectors", nargs="+", choices=SELECTORS, default=list(SELECTORS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON")
    p.set_defaults(func=run_selector)


def run_selector(args: argparse.Namespace) -> int:
    """Run ``fedhetero bench selector``."""
    # deferred for start-up time: the selectors import torch (through fedhetero.algorithms)
    from fedhetero.lab import bench_selector

    result = bench_selector.run_benchmark(
        args.clients, repeats=args.repeats, population=args.population, samples=args.samples,
        classes=args.classes, alpha=args.alpha, beta=args.beta, orders=args.orders,
        exhaustive_max=args.exhaustive_max, ga_population=args.ga_population,
        ga_iterations=args.ga_iterations, ga_mutation=args.ga_mutation, selectors=args.selectors,
        seed=args.seed,
    )
    bench_selector.print_table(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


# -------------------------------------------------------------------------------------- vectorize
def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_vectorize(sub: Any) -> None:
    p = sub.add_parser(
        "vectorize",
        help="many small clients one after another vs as one batched cohort (engine.vectorize), and Flower",
        description="``fedhetero bench vectorize``: the same FedAvg job (LeNet-5 with BatchNorm, clients of "
        "600 Fashion-MNIST-sized 1×28×28 images, batch 32, 1 local epoch, every client every round) with its "
        "clients trained one after another and as one batched cohort (engine.vectorize: true), and in "
        "Flower's simulation engine, for each number of clients per round. Only the client phase is timed "
        "(the first round is a warm-up); clients/s and GFLOP/s beside the machine's peak, measured in the "
        "same run. A row whose batched run could not batch the model says 'fell back to one-by-one'. "
        "Fashion-MNIST when its files are found, else synthetic images of its shape. Takes roughly 3-6 "
        "minutes with the defaults on an idle 2-core CPU; progress goes to stderr.",
    )
    p.add_argument("--clients", type=_positive_list(int, "numbers of clients"), default=[10, 50, 100], metavar="N,N,...",
                   help="clients per round of the rows, comma-separated (default 10,50,100)")
    p.add_argument("--rounds", type=_positive, default=2,
                   help="rounds per run; the first is a warm-up when > 1 (default 2)")
    p.add_argument("--samples", type=_positive, default=600, help="training images per client (default 600)")
    p.add_argument("--threads", type=_positive, default=2, help="torch threads (default 2)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (default) or cuda")
    p.add_argument("--data-root", default=None, metavar="DIR",
                   help="folder holding Fashion-MNIST's IDX files (default: $FEDHETERO_DATA_DIR or ./data); "
                   "synthetic images of the same shape when they are not there")
    p.add_argument("--model", default="lenet5", help="zoo model (default lenet5)")
    p.add_argument("--norm", default="bn", choices=("bn", "groupnorm1", "none"), help="model.norm (default bn)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override applied to every run's job after the bench's own settings (repeatable)")
    p.add_argument("--no-flower", action="store_true", help="skip Flower's simulation engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=run_vectorize)


def run_vectorize(args: argparse.Namespace) -> int:
    """Run ``fedhetero bench vectorize``."""
    # deferred for start-up time: the benchmark imports torch
    from fedhetero.lab import bench_vectorize

    err = make_console(stderr=True, highlight=False)
    flower = not args.no_flower
    what = f"{args.model} ({args.norm})" if args.model == "lenet5" else args.model
    err.print(
        f"fedhetero bench vectorize: FedAvg, {what}, {args.samples} images of 1×28×28 per client, batch 32, "
        f"1 local epoch; {', '.join(map(str, args.clients))} clients per round, {args.rounds} round"
        f"{'s' if args.rounds != 1 else ''}{' (the first a warm-up)' if args.rounds > 1 else ''}; client phase "
        f"timed one after another vs batched (engine.vectorize){' vs Flower' if flower else ''}; "
        f"{args.threads} threads, {args.device}; "
        + bench_vectorize.duration_note(args.clients, args.rounds, args.samples, flower),
        markup=False,
    )
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        err.print(f"{time.perf_counter() - t0:6.1f} s  {line}", markup=False)

    res = bench_vectorize.run_benchmark(
        clients=args.clients, rounds=args.rounds, samples=args.samples, threads=args.threads, device=args.device,
        data_root=args.data_root, flower=flower, model=args.model, norm=args.norm, overrides=args.set,
        seed=args.seed, progress=progress,
    )
    progress("done")
    bench_vectorize.print_table(res, make_console())
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2), encoding="utf-8")
    return 0
