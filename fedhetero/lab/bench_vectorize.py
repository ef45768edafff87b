"""``fedhetero bench vectorize``: many small clients trained one after another vs as one batched cohort.

The same FedAvg job (by default LeNet-5 with BatchNorm, clients of 600 Fashion-MNIST-sized images,
batch 32, one local epoch, every client training every round) runs three ways for each number of
clients per round, side by side in one process:

* **one after another**: the ``local`` back end, ``engine.vectorize: false``;
* **batched**: the same back end with ``engine.vectorize: true``, which trains the round's clients as
  one :class:`~fedhetero.core.local.cohort.Cohort` when the cohort can batch the model and falls back to one
  client after another when it cannot. Which of the two happened is not guessed from the times:
  :func:`count_cohort_calls` wraps :meth:`Cohort.train <fedhetero.core.local.cohort.Cohort.train>` in this
  process for the run and records every round it trained, and the row says "fell back to
  one-by-one" instead of a speedup when no timed round ran as a cohort;
* **Flower's simulation engine**: Flower's own FedAvg strategy on the same job
  (:func:`fedhetero.integrations.flower.bench.time_flower_fedavg`, one SuperNode per client), with
  the flower extra.

Only the client phase is timed (``timers.client_phase`` of every metrics row: the back end's seconds on
the round's client tasks); the first round is a warm-up when there are several, and the best of the
others is reported. Flower reports no client phase: its figure is the wall time the extra rounds of a
run add over a one-round run (Ray's start-up cancels out; the rounds' aggregation and central
evaluation stay in). The throughput of each is also given in GFLOP/s — training FLOPs of a round
(:func:`training_flops`) over its seconds — beside the machine's peak, measured in the same run
(:func:`measure_peak`).

Data: Fashion-MNIST when its IDX files are found (``--data-root``, else the data directory the
``fashion_mnist`` loader searches: ``$FEDHETERO_DATA_DIR`` or ``./data``), else images of the same
shape drawn by the ``synthetic`` data set's generator (``input_shape=(1, 28, 28)``). The run config's
``synthetic`` data set only sets its size (``data.synthetic_size``) and serves ``3×32×32`` images, so
either way the bench writes each row's images (``clients × samples`` training images, the first ones
of the source) as IDX files into a temporary directory read by the ``fashion_mnist`` loader: with an
``iid`` partition of ``clients`` clients every client then holds exactly ``samples`` images, and
Flower's processes read the same files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from fedhetero.core.local.cohort import Cohort
from fedhetero.core.common.config import RunConfig, from_dict, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import apply_overrides
from fedhetero.core.common.console import make_console
from fedhetero.core.run.engine import Engine
from fedhetero.data import load_dataset
from fedhetero.data.datasets import resolve_data_dir
from fedhetero.data.errors import DatasetNotFoundError

__all__ = [
    "DEFAULT_CLIENTS",
    "FELL_BACK",
    "SAMPLES",
    "TEST_IMAGES",
    "batched_share",
    "cohort_status",
    "count_cohort_calls",
    "duration_note",
    "estimate_seconds",
    "job_config",
    "load_source",
    "measure_peak",
    "print_table",
    "run_benchmark",
    "training_flops",
    "write_idx_set",
]

#: ``--clients``: clients per round of the rows
DEFAULT_CLIENTS = (10, 50, 100)
#: training images per client (Fashion-MNIST's 60,000 training images over 100 clients)
SAMPLES = 600
#: test images of each row's data (evaluated once, after the last round; every round in Flower's run)
TEST_IMAGES = 1000
#: what a row says when no timed round ran as a cohort
FELL_BACK = "fell back to one-by-one"
#: the shape of a Fashion-MNIST image
IMAGE_SHAPE = (1, 28, 28)

# rough costs on an idle 2-core CPU (LeNet-5 with BatchNorm, 2 threads), for the up-front estimate
_S_PER_IMAGE = 1.5e-4  # one local epoch, one image, one after another
_FLOWER_START_S = 4.0  # Ray's start-up and shut-down, per Flower run
_FLOWER_ROUND_S = 7.0  # Flower's own time per round, whatever the clients do
_FLOWER_S_PER_IMAGE = 2.5e-4


# ------------------------------------------------------------------------------------------- FLOPs
def training_flops(forward_macs: float, images: float) -> float:
    """Training FLOPs of ``images`` images trained once: the forward pass and the backward pass
    (about twice the forward) make 3 × the forward MACs per image, 2 FLOPs per MAC."""
    return 3.0 * float(forward_macs) * 2.0 * float(images)


# ----------------------------------------------------------------------------------- cohort check
@contextlib.contextmanager
def count_cohort_calls() -> Iterator[list[tuple[int, int]]]:
    """Record, while the block runs, every :meth:`Cohort.train` call in this process as
    ``(round, clients trained)``. The method is wrapped on the class (so every import of it sees
    the wrapper) and restored on exit."""
    calls: list[tuple[int, int]] = []
    original = Cohort.train

    @functools.wraps(original)
    def counted(self: Cohort, *args: Any, **kwargs: Any) -> Any:
        tasks = list(getattr(self, "tasks", None) or ())
        calls.append((int(tasks[0].round) if tasks else -1, len(tasks)))
        return original(self, *args, **kwargs)

    setattr(Cohort, "train", counted)  # noqa: B010 - an attribute assignment mypy would refuse
    try:
        yield calls
    finally:
        setattr(Cohort, "train", original)  # noqa: B010


def cohort_status(calls: Sequence[tuple[int, int]], rounds: Sequence[int], clients: int) -> tuple[str, int]:
    """Whether the timed ``rounds`` of a batched run trained their ``clients`` as a cohort, from
    :func:`count_cohort_calls`' record: ``("cohort", n)`` when every one did, ``(FELL_BACK, 0)`` when
    none did, ``("partly", n)`` otherwise; ``n``: the rounds in which every client was in a cohort."""
    per_round: dict[int, int] = {}
    for rnd, n in calls:
        per_round[rnd] = per_round.get(rnd, 0) + n
    full = sum(1 for r in rounds if per_round.get(r, 0) >= clients)
    if rounds and full == len(rounds):
        return "cohort", full
    if not any(per_round.get(r, 0) for r in rounds):
        return FELL_BACK, 0
    return "partly", full


def batched_share(calls: Sequence[tuple[int, int]], rounds: Sequence[int], clients: int) -> str:
    """The share of the timed rounds' client tasks that trained in cohorts, as a percentage
    (clients of very different lengths go to different cohorts, and a lone one runs by itself)."""
    done = sum(n for rnd, n in calls if rnd in set(rounds))
    return f"{100.0 * done / max(1, clients * len(rounds)):.0f} %"


# ------------------------------------------------------------------------------------------- peak
def measure_peak(threads: int | None, device: str = "cpu", repeats: int = 5) -> dict[str, Any]:
    """The machine's float32 peak at this thread count: the best of ``repeats`` large matrix products
    and of ``repeats`` 3×3 convolutions (after one warm-up each), in GFLOP/s; ``peak_gflops`` is the
    higher of the two and ``what`` says what was measured."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    n = 4096 if cuda else 1024
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dev)
    b = torch.randn(n, n, generator=gen).to(dev)
    batch, ch, hw = (128, 128, 56) if cuda else (32, 64, 28)
    x = torch.randn(batch, ch, hw, hw, generator=gen).to(dev)
    w = torch.randn(ch, ch, 3, 3, generator=gen).to(dev)

    def best(fn: Callable[[], Any], flops: float) -> float:
        seconds = []
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(dev)
            if i:  # the first call is a warm-up
                seconds.append(time.perf_counter() - t0)
        return flops / min(seconds) / 1e9

    with torch.no_grad():
        matmul = best(lambda: torch.mm(a, b), 2.0 * n**3)
        conv = best(lambda: F.conv2d(x, w, padding=1), 2.0 * batch * ch * ch * 9 * hw * hw)
    where = f"{threads} thread{'s' if threads != 1 else ''}" if not cuda else str(dev)
    what = (f"best of {repeats} float32 {n}×{n} matmuls ({matmul:.1f} GFLOP/s) and of {repeats} 3×3 convolutions "
            f"{batch}×{ch}×{hw}×{hw} → {ch} channels ({conv:.1f} GFLOP/s), {where}")
    return {"peak_gflops": max(matmul, conv), "matmul_gflops": matmul, "conv_gflops": conv, "what": what}


# ------------------------------------------------------------------------------------------- data
def load_source(data_root: str | None, images: int, test: int, seed: int = 0) -> dict[str, Any]:
    """The images every row takes its first ones from, as uint8 ``N×28×28`` arrays: Fashion-MNIST
    from ``data_root`` (None: the directory the ``fashion_mnist`` loader searches) when it holds the
    files, else ``images`` training and ``test`` test images of the ``synthetic`` generator at
    ``1×28×28``. ``data`` says which was used (and why the files were not used)."""
    try:
        train = load_dataset("fashion_mnist", data_dir=data_root, split="train", normalize=False)
        held = load_dataset("fashion_mnist", data_dir=data_root, split="test", normalize=False)
    except DatasetNotFoundError:
        why = f"no Fashion-MNIST IDX files in {resolve_data_dir(data_root)}"
        gen = "synthetic"
        train = load_dataset(gen, split="train", normalize=False, num_samples=images, num_test=test,
                             num_classes=10, input_shape=IMAGE_SHAPE, seed=seed)
        held = load_dataset(gen, split="test", normalize=False, num_samples=images, num_test=test,
                            num_classes=10, input_shape=IMAGE_SHAPE, seed=seed)
        to_bytes = _gaussian_bytes
        data = f"synthetic 1×28×28 images, 10 classes (fedhetero's synthetic generator; {why})"
    else:
        to_bytes = _unit_bytes
        data = (f"Fashion-MNIST from {resolve_data_dir(data_root)} (each row: the first clients × images per "
                f"client of its {len(train):,} training images, its first {min(test, len(held)):,} test images)")
    return {
        "train": (to_bytes(train.images[:images]), train.labels[:images].numpy().astype(np.uint8)),
        "test": (to_bytes(held.images[:test]), held.labels[:test].numpy().astype(np.uint8)),
        "data": data,
        "fashion_mnist": to_bytes is _unit_bytes,
    }


def _unit_bytes(x: torch.Tensor) -> np.ndarray:
    """Pixels in [0, 1] (a loader's ``normalize=False``) back to the file's bytes."""
    return np.asarray(x.squeeze(1).mul(255.0).round().clamp(0, 255).to(torch.uint8).numpy())


def _gaussian_bytes(x: torch.Tensor) -> np.ndarray:
    """The synthetic generator's Gaussian pixels (prototype + noise: spread about 1.4) as bytes,
    ±3 spreads over the byte range."""
    return np.asarray(x.squeeze(1).mul(30.0).add(127.5).round().clamp(0, 255).to(torch.uint8).numpy())


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_idx_set(folder: Path, source: dict[str, Any], train: int) -> int:
    """Write the first ``train`` training images of ``source`` (and all its test images) as the four
    Fashion-MNIST IDX files in ``folder``; returns the training images written (fewer when the
    source holds fewer)."""
    folder.mkdir(parents=True, exist_ok=True)
    x, y = source["train"]
    train = min(train, len(y))
    _write_idx(folder / "train-images-idx3-ubyte", x[:train])
    _write_idx(folder / "train-labels-idx1-ubyte", y[:train])
    tx, ty = source["test"]
    _write_idx(folder / "t10k-images-idx3-ubyte", tx)
    _write_idx(folder / "t10k-labels-idx1-ubyte", ty)
    return train


# -------------------------------------------------------------------------------------------- job
def job_config(*, clients: int, rounds: int, data_dir: str, model: str = "lenet5", norm: str = "bn",
               threads: int = 2, device: str = "cpu", vectorize: bool = False, seed: int = 0,
               overrides: Sequence[str] = ()) -> RunConfig:
    """The FedAvg job of one row: ``clients`` clients on an iid partition of the IDX files in
    ``data_dir``, all of them every round, one local epoch of batch 32 (SGD as configured by
    default), evaluated after the last round only; ``overrides`` (``key=value``) applied last."""
    data: dict[str, Any] = {
        "seed": seed,
        "threads": threads,
        "device": device,
        "data": {"dataset": "fashion_mnist", "data_dir": data_dir, "num_clients": clients, "partition": "iid",
                 "min_partition_size": 1},
        "model": {"name": model, "norm": norm},
        "train": {"rounds": rounds, "sample_rate": 1.0, "local_epochs": 1, "batch_size": 32,
                  "eval_every": rounds, "checkpoint_every": rounds},
        "algorithm": {"name": "fedavg"},
        "engine": {"backend": "local", "vectorize": vectorize},
    }
    if overrides:
        data = apply_overrides(data, list(overrides))
    return from_dict(data)


def _engine_run(cfg: RunConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The metrics rows and ``run.json`` of one engine run in a temporary run directory."""
    with tempfile.TemporaryDirectory(prefix="fedhetero-bench-") as d:
        res = Engine(cfg, Path(d) / "run", progress=False).run()
        meta = json.loads((Path(d) / "run" / "run.json").read_text(encoding="utf-8"))
    return res.metrics, meta


def _images_trained(cfg: RunConfig, row: dict[str, Any]) -> int:
    """Images one round's clients trained (each image once per local epoch)."""
    t = cfg.train
    total = 0
    for c in row.get("clients", []):
        n = int(c["num_samples"])
        total += n * t.local_epochs if t.local_steps is None else t.local_steps * min(t.batch_size, n)
    return total


def _best_s(side: dict[str, Any]) -> float:
    """The client phase of a side's fastest timed round."""
    times = side["client_phase_s"]
    return float(min(times[1:] or times))


def _timed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that are timed: all but the first (a warm-up) when there are several."""
    return rows[1:] if len(rows) > 1 else rows


def _side(cfg: RunConfig, rows: list[dict[str, Any]], macs: float) -> dict[str, Any]:
    """Clients/s and GFLOP/s of one run, from its fastest timed round."""
    best = min(_timed(rows), key=lambda r: float(r["timers"]["client_phase"]))
    seconds = float(best["timers"]["client_phase"])
    clients = len(best.get("clients", []))
    flops = training_flops(macs, _images_trained(cfg, best))
    return {
        "client_phase_s": [float(r["timers"]["client_phase"]) for r in rows],
        "clients_per_s": clients / seconds,
        "gflops": flops / seconds / 1e9,
        "round_flops": flops,
    }


# ------------------------------------------------------------------------------------------ Flower
def _flower_timer(flower: bool) -> tuple[Any, str | None]:
    """Flower's FedAvg timing function, or None and why the Flower column is skipped."""
    if not flower:
        return None, "skipped (--no-flower)"
    try:
        # deferred: it imports flwr, the optional "flower" extra (and Ray through the simulation)
        from fedhetero.integrations.flower import bench as fbench
    except ImportError as exc:
        return None, f"skipped: the flower extra is not installed (pip install 'fedhetero[flower]'; {exc})"
    return fbench.time_flower_fedavg, None


def _flower_side(timer: Callable[..., float], cfg: RunConfig, clients: int, threads: int,
                 round_flops: float) -> dict[str, Any]:
    """Flower's clients/s on the job: the wall time ``rounds - 1`` extra rounds add to a one-round run
    (both runs pay Ray's start-up), or the one-round run's whole time when ``rounds`` is 1. Each
    ClientApp trains on one thread; ``threads`` of them run at once."""
    rounds = cfg.train.rounds
    job = from_dict({**to_dict(cfg), "threads": 1})
    with _quiet_flower():
        return _flower_runs(timer, job, rounds, clients, threads, round_flops)


@contextlib.contextmanager
def _quiet_flower() -> Iterator[None]:
    """Flower's per-round INFO log off while it is timed (the progress lines stay readable)."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _flower_runs(timer: Callable[..., float], job: RunConfig, rounds: int, clients: int, threads: int,
                 round_flops: float) -> dict[str, Any]:
    one = timer(from_dict({**to_dict(job), "train": {**to_dict(job.train), "rounds": 1, "eval_every": 1,
                                                       "checkpoint_every": 1}}),
                supernodes=clients, num_cpus=threads)
    out: dict[str, Any] = {"one_round_s": one}
    if rounds > 1:
        full = timer(job, supernodes=clients, num_cpus=threads)
        out["all_rounds_s"] = full
        seconds = (full - one) / (rounds - 1)
        out["start_up_excluded"] = True
    else:
        seconds = one
        out["start_up_excluded"] = False
    if seconds <= 0:  # noise larger than the rounds' time
        out.update(clients_per_s=None, gflops=None)
    else:
        out.update(clients_per_s=clients / seconds, gflops=round_flops / seconds / 1e9, round_s=seconds)
    return out


def _flower_line(fl: dict[str, Any], rounds: int) -> str:
    """What Flower's two runs took, for the progress lines."""
    line = f"one-round run {fl['one_round_s']:.1f} s"
    if "all_rounds_s" in fl:
        line += f", {rounds}-round run {fl['all_rounds_s']:.1f} s (wall, Ray's start-up in both)"
    if fl.get("round_s") is None:
        return line + "; no measurable time per round (the runs' start-up varies more: try more --rounds)"
    return line + f" → {fl['round_s']:.2f} s per round"


# --------------------------------------------------------------------------------------- the bench
def estimate_seconds(clients: Sequence[int], rounds: int, samples: int, flower: bool) -> float:
    """A rough duration of the bench on an idle 2-core CPU (LeNet-5, 2 threads)."""
    engine = sum(2 * rounds * c * samples * _S_PER_IMAGE for c in clients)
    runs = 2 if rounds > 1 else 1
    flower_rounds = rounds + 1 if rounds > 1 else 1
    fl = sum(runs * _FLOWER_START_S + flower_rounds * (_FLOWER_ROUND_S + c * samples * _FLOWER_S_PER_IMAGE)
             for c in clients)
    return engine + (fl if flower else 0.0) + 5.0


def duration_note(clients: Sequence[int], rounds: int, samples: int, flower: bool) -> str:
    """``takes roughly …`` for these settings."""
    s = estimate_seconds(clients, rounds, samples, flower)
    took = f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"
    return f"this takes roughly {took} on an idle 2-core CPU with 2 threads (an estimate for LeNet-5)"


def run_benchmark(
    *,
    clients: Sequence[int] = DEFAULT_CLIENTS,
    rounds: int = 2,
    samples: int = SAMPLES,
    threads: int = 2,
    device: str = "cpu",
    data_root: str | None = None,
    flower: bool = True,
    model: str = "lenet5",
    norm: str = "bn",
    overrides: Sequence[str] = (),
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every row (see the module docstring) and return the results (what ``--json`` writes)."""
    say = progress or (lambda line: None)
    clients = [int(c) for c in clients]
    if not clients or min(clients) < 1:
        raise ValueError("--clients: give one or more positive numbers of clients per round")
    if rounds < 1 or samples < 1 or threads < 1:
        raise ValueError("--rounds, --samples and --threads must be at least 1")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' requested but CUDA is not available; use --device cpu")
    torch.set_num_threads(threads)
    timer, flower_note = _flower_timer(flower)
    steps = 2 + len(clients)
    say(f"[1/{steps}] measuring the peak: large float32 matmuls and convolutions, {threads} threads, {device}")
    peak = measure_peak(threads, device)
    say(f"      peak {peak['peak_gflops']:.1f} GFLOP/s")
    say(f"[2/{steps}] loading the data")
    source = load_source(data_root, max(clients) * samples, TEST_IMAGES, seed=seed)
    say(f"      {source['data']}")
    timed_rounds = list(range(2, rounds + 1)) if rounds > 1 else [1]
    out: dict[str, Any] = {
        "speedup": {}, "clients_per_s": {}, "gflops": {}, "cohort": {}, "images_per_client": {},
        "peak_gflops": peak["peak_gflops"], "peak": peak, "device": device, "threads": threads,
        "data": source["data"], "rounds": rounds, "timed_rounds": timed_rounds,
        "statistic": "best timed round" + (" (round 1 is a warm-up)" if rounds > 1 else " (no warm-up round)"),
        "flower": flower_note, "rows": {},
    }
    with tempfile.TemporaryDirectory(prefix="fedhetero-bench-vectorize-") as tmp:
        for i, c in enumerate(clients):
            key = str(c)
            folder = Path(tmp) / f"clients-{c}"
            written = write_idx_set(folder, source, c * samples)
            if written < c:
                raise ValueError(f"{c} clients need at least {c} training images; the data holds {written}")

            def cfg_for(vectorize: bool, c: int = c, folder: Path = folder) -> RunConfig:
                return job_config(clients=c, rounds=rounds, data_dir=str(folder), model=model, norm=norm,
                                  threads=threads, device=device, vectorize=vectorize, seed=seed, overrides=overrides)

            say(f"[{3 + i}/{steps}] {c} clients per round, {rounds} round{'s' if rounds != 1 else ''} each: "
                f"one after another, batched{', Flower' if timer is not None else ''}")
            cfg = cfg_for(False)
            rows, meta = _engine_run(cfg)
            macs = float(meta["plain_macs"])
            serial = _side(cfg, rows, macs)
            say(f"      one after another: client phase {_best_s(serial):.3f} s per round")
            vcfg = cfg_for(True)
            with count_cohort_calls() as calls:
                vrows, _ = _engine_run(vcfg)
            batched = _side(vcfg, vrows, macs)
            status, full = cohort_status(calls, timed_rounds, c)
            say(f"      batched (engine.vectorize): client phase {_best_s(batched):.3f} s per round; "
                + ("ran as a cohort" if status == "cohort" else status if status == FELL_BACK
                   else f"a cohort in {full} of {len(timed_rounds)} timed rounds"))
            speed = batched["clients_per_s"] / serial["clients_per_s"]
            out["speedup"][key] = None if status == FELL_BACK else speed
            out["cohort"][key] = (status if status != "partly"
                                  else f"partly: {batched_share(calls, timed_rounds, c)} of clients in cohorts, "
                                       "the rest one by one")
            per_client = sorted({int(n) for n in meta.get("client_samples", [])})
            out["images_per_client"][key] = per_client[0] if len(per_client) == 1 else per_client
            fl: dict[str, Any] | None = None
            if timer is not None:
                say(f"      Flower's simulation engine, {c} SuperNodes (Ray start-up included; "
                    f"{2 if rounds > 1 else 1} run{'s' if rounds > 1 else ''})")
                fl = _flower_side(timer, cfg, c, threads, serial["round_flops"])
                say(f"      Flower: {_flower_line(fl, rounds)}")
            out["clients_per_s"][key] = {
                "one_by_one": serial["clients_per_s"], "batched": batched["clients_per_s"],
                "flower": fl["clients_per_s"] if fl else None,
            }
            out["gflops"][key] = {
                "one_by_one": serial["gflops"], "batched": batched["gflops"], "flower": fl["gflops"] if fl else None,
            }
            out["rows"][key] = {"one_by_one": serial, "batched": batched, "flower": fl, "cohort_calls": calls,
                                "speedup_measured": speed}
            out["forward_macs"] = macs
        out["job"] = to_dict(cfg_for(True))
    job_model = out["job"]["model"]
    out["model"] = job_model["name"] + ("" if job_model["name"] == "logreg" else f" ({job_model['norm']})")
    out["job"]["data"]["data_dir"] = None  # a temporary directory, gone now
    return out


# ------------------------------------------------------------------------------------------ table
def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _gf(value: float | None, peak: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f} ({100 * value / peak:.1f} %)" if peak > 0 else f"{value:.2f}"


def print_table(res: dict[str, Any], console: Console | None = None) -> None:
    """The rows of :func:`run_benchmark`'s results, with what was measured under them."""
    console = console or make_console()
    peak = float(res["peak_gflops"])
    flower_cols = res.get("flower") is None
    title = (f"FedAvg clients one after another vs one batched cohort ({res['model']}, "
             f"{res['device']}, {res['threads']} thread{'s' if res['threads'] != 1 else ''}; client phase, "
             f"{res['statistic']})")
    table = Table(title=title)
    for name in ("clients/round", "one after another, clients/s", "batched, clients/s", "speedup",
                 "Flower sim, clients/s", "GFLOP/s one after another", "GFLOP/s batched", "GFLOP/s Flower"):
        table.add_column(name, justify="left" if name == "speedup" else "right")
    for key, cps in res["clients_per_s"].items():
        gf = res["gflops"][key]
        status = res["cohort"][key]
        speed = res["speedup"][key]
        if status == FELL_BACK:
            speed_cell = FELL_BACK
        elif status == "cohort":
            speed_cell = f"{speed:.2f}×"
        else:
            speed_cell = f"{speed:.2f}× ({status})"
        table.add_row(
            key, _num(cps["one_by_one"]), _num(cps["batched"]), speed_cell,
            _num(cps["flower"]) if flower_cols else "skipped",
            _gf(gf["one_by_one"], peak), _gf(gf["batched"], peak),
            _gf(gf["flower"], peak) if flower_cols else "skipped",
        )
    console.print(table)
    per_client = sorted({str(v) for v in res["images_per_client"].values()})
    notes = [
        f"data: {res['data']}; {', '.join(per_client)} training images per client, all clients every round",
        f"peak: {peak:.1f} GFLOP/s, the {res['peak']['what']}; GFLOP/s in parentheses: share of the peak",
        f"FLOPs of a round: 3 × {res.get('forward_macs', 0):,.0f} forward MACs per image (run.json plain_macs) "
        "× 2 × images trained",
        "speedup: batched / one after another clients/s; a row whose batched run trained no timed round as "
        f"a cohort (the engine could not batch the model) says '{FELL_BACK}'",
    ]
    if flower_cols:
        notes.append("Flower: its own FedAvg strategy in its simulation engine, one SuperNode per client, one "
                     f"thread per ClientApp, {res['threads']} at once; the time a run's extra rounds add to a "
                     "one-round run (aggregation and central evaluation included, Ray's start-up excluded)"
                     if res["rounds"] > 1 else
                     "Flower: its own FedAvg strategy in its simulation engine; one round, Ray's start-up included")
        if any(v["flower"] is None for v in res["clients_per_s"].values()):
            notes.append("Flower n/a: its longer run took no longer than its one-round run (Ray's start-up varies "
                         "more than a round takes); more --rounds make the difference measurable")
    else:
        notes.append(f"Flower: {res['flower']}")
    for line in notes:
        console.print(line, markup=False, highlight=False)
