"""Benchmarks of the federated engine, measured side by side in one run.

``fedhetero bench round``   FedAvg through the engine vs a bare hand-written PyTorch loop doing the
                            same training (same data, clients, order, model); the share of a
                            DynamicFL round spent in REP, DYMM and merge; and a round of FedAvg and
                            of DynamicFL at the DynamicFL paper's protocol, side by side, against
                            the ratio of their clients' training MACs.
``fedhetero bench engines`` the same FedAvg job on the ``process`` back end vs ``local`` (client
                            throughput; beside it two independent ``local`` runs at once, the
                            machine's ceiling, and the bound for free messages), ``local`` vs a
                            bare loop, and, with the ``flower`` extra, our Flower back end vs
                            Flower's own FedAvg strategy.
``fedhetero bench memory``  peak resident memory of 1000 clients at 1 % sampling vs 100 clients at
                            10 % sampling (each in a fresh subprocess), showing that memory follows
                            the clients sampled per round, not the clients that exist.
"""

from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.table import Table

from fedhetero.backends.process import ProcessBackend
from fedhetero.core.common.config import RunConfig, TrainConfig, from_dict, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.console import make_console
from fedhetero.core.run.engine import Engine
from fedhetero.core.run.metrics import sample_passes
from fedhetero.data import iterate_batches

__all__ = ["bare_fedavg", "engines_benchmark", "memory_benchmark", "paper_rounds", "paper_config", "round_benchmark"]


def _round_cfg(clients: int, per_round: int, rounds: int, algorithm: str, dataset: str, model: str) -> RunConfig:
    return from_dict(
        {
            "seed": 0,
            "data": {"dataset": dataset, "num_clients": clients, "partition": "iid", "min_partition_size": 1},
            "model": {"name": model},
            "train": {
                "rounds": rounds,
                "sample_rate": per_round / clients,
                "local_epochs": 1,
                "eval_every": rounds,
                "checkpoint_every": rounds,
            },
            "algorithm": {"name": algorithm},
        }
    )


#: a method as ``paper_rounds`` times it under another name: (method, ``engine.vectorize``).
#: ``dynamicfl-batched``: DynamicFL's coinciding segments as cohorts on a CPU too (a GPU batches
#: them by default); not in the default rows (minutes more, and no measurable gain on a 2-core CPU)
PAPER_VARIANTS = {"fedavg-one-by-one": ("fedavg", False), "dynamicfl-batched": ("dynamicfl", True)}


def paper_config(algorithm: str, rounds: int, data_dir: str, threads: int = 1, device: str = "cpu") -> RunConfig:
    """The DynamicFL paper's protocol (as ``examples/configs/fmnist_dynamicfl_paper.yaml``): 90
    devices on Fashion-MNIST (Dirichlet β = 0.5, 10 % held out for validation), 10 % sampled a
    round, E = 3 local epochs of batch 32, SGD lr 0.01 with momentum 0.9, LeNet-5, tiers 1 : 2 : 3
    in equal shares; ``rounds`` rounds, evaluated after the last one only. ``algorithm`` may name
    a :data:`PAPER_VARIANTS` entry (``fedavg-one-by-one``: FedAvg with batched cohorts off); ``device``:
    where clients train and the model is evaluated (``cpu``, ``cuda``)."""
    third = 0.3333333333333333  # the shipped config's shares, as written there
    algorithm, vectorize = PAPER_VARIANTS.get(algorithm, (algorithm, None))
    return from_dict({
        "seed": 0,
        "threads": threads,
        "device": device,
        "engine": {"vectorize": vectorize},
        "data": {"dataset": "fashion_mnist", "data_dir": data_dir, "partition": "dirichlet", "alpha": 0.5,
                 "num_clients": 90, "val_fraction": 0.1},
        "model": {"name": "lenet5"},
        "train": {"rounds": rounds, "sample_rate": 0.1, "local_epochs": 3, "batch_size": 32, "lr": 0.01,
                  "momentum": 0.9, "eval_every": rounds, "eval_batch_size": 2000, "checkpoint_every": rounds},
        "budget": {"tiers": [{"name": "small", "ratio": 1.0, "share": third},
                             {"name": "medium", "ratio": 2.0, "share": third},
                             {"name": "large", "ratio": 3.0, "share": 0.3333333333333334}]},
        "algorithm": {"name": algorithm},
    })


def paper_rounds(*, rounds: int, data_root: str | None, threads: int = 1, warmup: int = 30,
                 algorithms: tuple[str, ...] = ("fedavg", "dynamicfl", "fedavg-one-by-one"),
                 images: int = 60_000, device: str = "cpu") -> dict[str, Any]:
    """One run per algorithm at the DynamicFL paper's protocol (:func:`paper_config`), on
    Fashion-MNIST when ``data_root`` (or the loader's default folder) holds its IDX files, else on
    synthetic images of its shape (``data`` says which): ``warmup`` untimed rounds, then
    ``rounds`` timed ones. The warm-up is what users meet: in a real run almost every task is a
    returning client (stored structure, REP, DYMM mid-round) training a model that has trained,
    while the first rounds are first-time clients on fresh weights (``first_time_share`` says how
    many of the timed tasks were still first-time). Per algorithm: the seconds of each timed round
    without its evaluation (``round_s``: their median), the named timers summed over the timed
    rounds (``timers_s``), the clients' mean training MACs over the timed rounds and, per tier,
    their time and MACs per training sample (``tiers``, :func:`tier_costs`); at the top,
    ``dynamicfl_over_fedavg`` (DynamicFL's round time over FedAvg's), ``mac_ratio`` (their
    clients' mean training MACs, DynamicFL over FedAvg) and ``tiers`` (DynamicFL's tiers against
    FedAvg, :func:`tier_ratios`); per algorithm ``cohort_epoch_share``: the share of its clients'
    epochs that DynamicFL trained in batched cohorts (on a GPU, or ``dynamicfl-batched``). FedAvg
    trains a round's clients as batched cohorts by default (on a CPU, 4 or more clients of 10 or
    more steps), which DynamicFL's clients do not join on a CPU:
    ``fedavg-one-by-one`` times FedAvg without them, and ``dynamicfl_over_fedavg_one_by_one`` is
    DynamicFL's round time over that. ``images``: training images
    (Fashion-MNIST's 60,000; fewer only to test the benchmark). ``device``: where the runs train
    (``cuda``: a GPU's rows; on a GPU cohorts of two or more clients batch)."""
    from fedhetero.lab.bench_vectorize import load_source, write_idx_set  # deferred: only this part needs it

    if len(set(algorithms)) != len(algorithms):  # the results are keyed by name: a repeat would replace one
        raise ConfigError(f"paper_rounds: each algorithm once, got {list(algorithms)}")

    out: dict[str, Any] = {"rounds": rounds, "warmup": warmup, "threads": threads, "device": device, "algorithms": {}}
    with tempfile.TemporaryDirectory(prefix="fedhetero-bench-paper-") as tmp:
        source = load_source(data_root, images, 10_000)
        out["data"] = source["data"] if not source["fashion_mnist"] else "Fashion-MNIST"
        out["fashion_mnist"] = bool(source["fashion_mnist"])
        write_idx_set(Path(tmp), source, images)
        for algo in algorithms:
            cfg = paper_config(algo, warmup + rounds, tmp, threads, device)
            _, rows = _timed_run(cfg)
            seen = {c["cid"] for r in rows[:warmup] for c in r["clients"]}
            timed = rows[warmup:]
            per_round = [r["wall_s"] - r["timers"].get("evaluate", 0.0) for r in timed]
            clients = [c for r in timed for c in r["clients"]]
            timers: dict[str, float] = {}
            for r in timed:
                for k, v in r["timers"].items():
                    timers[k] = timers.get(k, 0.0) + v
            out["algorithms"][algo] = {
                "round_s": statistics.median(per_round),
                "rounds_s": per_round,
                "timers_s": timers,
                "client_macs": sum(c["macs"] for c in clients) / max(len(clients), 1),
                "clients": len(clients),
                "tiers": tier_costs(clients, cfg.train),
                # DynamicFL: the share of its clients' epochs that trained in batched cohorts
                "cohort_epoch_share": sum(int(c.get("cohort_epochs", 0)) for c in clients)
                / max(len(clients) * cfg.train.local_epochs, 1),
            }
            first = 0
            for r in timed:  # a client's first task is in the round that first samples it
                for c in r["clients"]:
                    first += c["cid"] not in seen
                seen |= {c["cid"] for c in r["clients"]}
            out["first_time_share"] = first / max(len(clients), 1)
    if "fedavg" in out["algorithms"] and "dynamicfl" in out["algorithms"]:
        a, d = out["algorithms"]["fedavg"], out["algorithms"]["dynamicfl"]
        out["dynamicfl_over_fedavg"] = d["round_s"] / a["round_s"]
        out["mac_ratio"] = d["client_macs"] / a["client_macs"]
        out["tiers"] = tier_ratios(d["tiers"], a["tiers"])
        if "fedavg-one-by-one" in out["algorithms"]:
            out["dynamicfl_over_fedavg_one_by_one"] = d["round_s"] / out["algorithms"]["fedavg-one-by-one"]["round_s"]
    return out


def tier_costs(clients: list[dict[str, Any]], train: TrainConfig) -> dict[str, dict[str, float]]:
    """Per tier, from metrics rows' client entries: how many tasks, their wall seconds, the
    training samples they pushed through their models (:func:`~fedhetero.core.run.metrics.sample_passes`,
    as the simulated time counts them), the microseconds per such sample and the mean MACs per
    sample."""
    out: dict[str, dict[str, float]] = {}
    for c in clients:
        t = out.setdefault(str(c["tier"]), {"clients": 0, "wall_s": 0.0, "samples": 0, "macs": 0.0})
        t["clients"] += 1
        t["wall_s"] += float(c.get("wall_s", 0.0))
        t["samples"] += sample_passes(train, int(c["num_samples"]), c.get("steps"))
        t["macs"] += float(c["macs"])
    for t in out.values():
        t["us_per_sample"] = 1e6 * t["wall_s"] / max(t["samples"], 1)
        t["macs"] /= max(t["clients"], 1)
    return out


def tier_ratios(method: dict[str, dict[str, float]], base: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per tier of ``method``: its time per training sample and its MACs per sample over
    ``base``'s (all of ``base``'s tiers pooled: one model for every tier), and their quotient, the
    time per MAC relative to ``base``'s."""
    samples = sum(t["samples"] for t in base.values())
    base_us = 1e6 * sum(t["wall_s"] for t in base.values()) / max(samples, 1)
    base_macs = sum(t["macs"] * t["clients"] for t in base.values()) / max(sum(t["clients"] for t in base.values()), 1)
    out = {}
    for name, t in method.items():
        time_ratio = t["us_per_sample"] / base_us if base_us > 0 else float("nan")
        mac_ratio = t["macs"] / base_macs if base_macs > 0 else float("nan")
        out[name] = {"time_ratio": time_ratio, "mac_ratio": mac_ratio, "time_per_mac": time_ratio / mac_ratio}
    return out


def bare_fedavg(cfg: RunConfig, rounds: int) -> float:
    """A hand-written FedAvg loop over the engine's own partitions and batch order; returns seconds."""
    with tempfile.TemporaryDirectory(prefix="fedhetero-bare-") as out:  # nothing of it is kept
        return _bare_fedavg(Engine(cfg, out, progress=False), cfg, rounds)


def _bare_fedavg(eng: Engine, cfg: RunConfig, rounds: int) -> float:
    eng.setup()
    ctx, data = eng.ctx, eng.data
    global_model = eng.algorithm.global_model
    assert global_model is not None  # made by the algorithm's setup
    t0 = time.perf_counter()
    for rnd in range(1, rounds + 1):
        ctx.round = rnd
        cids = eng.sample_clients(rnd)
        states, weights = [], []
        for cid in cids:
            model = copy.deepcopy(global_model)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum, weight_decay=cfg.train.weight_decay)
            gen = ctx.torch_generator("data", rnd, cid, 0)
            for x, y in iterate_batches(data.train, data.client_indices[cid], cfg.train.batch_size, generator=gen, shuffle=True):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            states.append(model.state_dict())
            weights.append(len(data.client_indices[cid]))
        total = float(sum(weights))
        avg: dict[str, torch.Tensor] = {}
        for k, v in states[0].items():
            if torch.is_floating_point(v):
                avg[k] = sum(s[k] * (w / total) for s, w in zip(states, weights))
            else:
                avg[k] = v
        global_model.load_state_dict(avg)
    ctx.evaluate(global_model)
    return time.perf_counter() - t0


def round_benchmark(*, clients: int, per_round: int, rounds: int, repeats: int, model: str, dataset: str,
                    threads: int, dynamicfl_rounds: int, json_path: str | None = None, paper: int = 4,
                    paper_warmup: int = 30, data_root: str | None = None, device: str = "cpu",
                    paper_only: bool = False) -> dict[str, Any]:
    """``fedhetero bench round``: FedAvg through the engine vs :func:`bare_fedavg` (``repeats``
    interleaved runs of ``rounds`` rounds each, the median reported) and the share of a DynamicFL round
    spent in REP, DYMM and merge (``dynamicfl_rounds`` rounds), both on the CPU; then ``paper``
    rounds at the DynamicFL paper's protocol on ``device`` (:func:`paper_rounds`). ``paper_only``
    skips the first part (a GPU's rows). Prints the tables, writes the numbers to ``json_path`` when
    given and returns them."""
    if paper_only and not paper:
        raise ConfigError("paper_rounds: --paper-only needs paper-protocol rounds (--paper-rounds 1 or more)")
    if device == "cuda" and paper and not torch.cuda.is_available():  # before the CPU part, not after it
        raise ConfigError("device: 'cuda' requested but CUDA is not available; use --device cpu")
    torch.set_num_threads(threads)
    console = make_console()
    out: dict[str, Any] = {}
    if not paper_only:
        out.update(_engine_rows(console, clients=clients, per_round=per_round, rounds=rounds, repeats=repeats,
                                model=model, dataset=dataset, dynamicfl_rounds=dynamicfl_rounds))
    if paper:
        p = paper_rounds(rounds=paper, warmup=paper_warmup, data_root=data_root, device=device)
        out["paper_protocol"] = p
        out["dynamicfl_over_fedavg"] = p["dynamicfl_over_fedavg"]
        out["mac_ratio"] = p["mac_ratio"]
        console.print(paper_table(p))
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2))
    return out


def _engine_rows(console: Any, *, clients: int, per_round: int, rounds: int, repeats: int, model: str,
                 dataset: str, dynamicfl_rounds: int) -> dict[str, Any]:
    """The first part of ``fedhetero bench round``: engine vs bare loop, DynamicFL's shares."""
    cfg = _round_cfg(clients, per_round, rounds, "fedavg", dataset, model)
    eng_t, bare_t = [], []
    # warm-up: one-time costs of a fresh process (lazy imports, first optimizer) are not a round's
    warm = _round_cfg(clients, per_round, 1, "fedavg", dataset, model)
    bare_fedavg(warm, 1)
    _timed_run(warm)
    for _ in range(repeats):  # interleaved so machine noise hits both alike
        bare_t.append(bare_fedavg(cfg, rounds))
        eng_t.append(_timed_run(cfg)[0])
    e, b = statistics.median(eng_t), statistics.median(bare_t)
    dcfg = _round_cfg(20, 10, dynamicfl_rounds, "dynamicfl", dataset, model)
    d = to_dict(dcfg)
    d["train"]["local_epochs"] = 2
    d["data"]["partition"] = "dirichlet"
    d["data"]["min_partition_size"] = 10
    dcfg = from_dict(d)
    _, rows = _timed_run(dcfg)
    wall = sum(r["wall_s"] for r in rows)
    shares = {k: sum(r["timers"].get(k, 0.0) for r in rows) / wall for k in ("rep", "dymm", "merge")}
    table = Table(title=f"FedAvg round: engine vs bare PyTorch loop ({clients} clients, {per_round}/round, {dataset}, {model}, {rounds} rounds, median of {repeats})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row("engine, s per round", f"{e / rounds:.4f}", "")
    table.add_row("bare loop, s per round", f"{b / rounds:.4f}", "")
    table.add_row("engine / bare", f"{e / b:.3f}", "≤ 1.05")
    table.add_row("(reference: Flower simulation / bare)", "3.8–4.1", "")
    table.add_row(f"DynamicFL round: REP share ({dynamicfl_rounds} rounds)", f"{100 * shares['rep']:.2f} %", "")
    table.add_row("DynamicFL round: DYMM share", f"{100 * shares['dymm']:.2f} %", "")
    table.add_row("DynamicFL round: merge share", f"{100 * shares['merge']:.2f} %", "")
    table.add_row("DynamicFL round: REP + DYMM + merge", f"{100 * sum(shares.values()):.2f} %", "≤ 5 %")
    console.print(table)
    return {"engine_s": e, "bare_s": b, "ratio": e / b, "dynamicfl_shares": shares, "rounds": rounds}


def paper_table(p: dict[str, Any]) -> Table:
    """The table of :func:`paper_rounds`."""
    first, last = p["warmup"] + 1, p["warmup"] + p["rounds"]
    device = p.get("device", "cpu")
    where = f"{p['threads']} thread" + ("s" if p["threads"] != 1 else "") + ("" if device == "cpu" else f", {device}")
    table = Table(title=f"A round at the DynamicFL paper's protocol (90 clients, 9 a round, E = 3, LeNet-5, tiers "
                  f"1 : 2 : 3; {where}; median of rounds {first}–{last}, evaluation excluded)",
                  caption=f"data: {p['data']}; {100 * p['first_time_share']:.0f} % of the timed tasks were a "
                  "client's first (the rest returning clients, as in most of a run)")
    table.add_column("method")
    table.add_column("s per round", justify="right")
    table.add_column("client MMACs (mean)", justify="right")
    # the timers are summed over the timed rounds; the table shows them per round, beside the round
    table.add_column("REP / DYMM / merge, s per round", justify="right")
    for algo, r in p["algorithms"].items():
        t = r["timers_s"]
        table.add_row(algo, f"{r['round_s']:.2f}", f"{r['client_macs'] / 1e6:.3f}",
                      " / ".join(f"{t.get(k, 0.0) / max(p['rounds'], 1):.3f}" for k in ("rep", "dymm", "merge")))
    if "dynamicfl_over_fedavg" in p:
        x, y = p["dynamicfl_over_fedavg"], p["mac_ratio"]
        table.add_row("DynamicFL / FedAvg", f"{x:.2f}", f"{y:.2f}", f"time / MACs {x / y:.2f} (target ≤ 1.3)")
        if "dynamicfl_over_fedavg_one_by_one" in p:
            z = p["dynamicfl_over_fedavg_one_by_one"]
            table.add_row("DynamicFL / FedAvg one by one (no batched cohorts)", f"{z:.2f}", f"{y:.2f}", f"time / MACs {z / y:.2f}")
    for algo, r in p["algorithms"].items():
        if r.get("cohort_epoch_share"):
            table.add_row(f"· {algo}: client-epochs trained in batched cohorts", f"{100 * r['cohort_epoch_share']:.0f} %", "", "")
    for name, t in p.get("tiers", {}).items():  # where the time goes, tier by tier
        table.add_row(f"· DynamicFL {name} tier / FedAvg, per training sample", f"{t['time_ratio']:.2f}",
                      f"{t['mac_ratio']:.2f}", f"time / MACs {t['time_per_mac']:.2f}")
    return table


_MEM_CHILD = r"""
import json, resource, sys, tempfile
from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine
clients, rate, rounds, algo = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = from_dict({"seed": 0, "threads": 1,
    "data": {"dataset": "synthetic", "synthetic_size": 12000, "num_clients": clients, "partition": "iid", "min_partition_size": 1},
    "model": {"name": "lenet5"},
    "train": {"rounds": rounds, "sample_rate": rate, "local_epochs": 1, "eval_every": rounds, "checkpoint_every": rounds},
    "algorithm": {"name": algo}})
with tempfile.TemporaryDirectory() as d:
    res = Engine(cfg, d, progress=False).run()
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "acc": res.summary["final_accuracy"]}))
"""


def _child_peak(clients: int, rate: float, rounds: int, algo: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _MEM_CHILD, str(clients), str(rate), str(rounds), algo],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_benchmark(*, rounds: int, algorithm: str, json_path: str | None = None) -> dict[str, Any]:
    """``fedhetero bench memory``: peak resident memory of 100 clients at 10 % sampling and of 1000
    clients at 1 % sampling, ``rounds`` rounds of ``algorithm`` each in a fresh subprocess; prints the
    table, writes the numbers to ``json_path`` when given and returns them."""
    small = _child_peak(100, 0.10, rounds, algorithm)
    big = _child_peak(1000, 0.01, rounds, algorithm)
    ratio = big["maxrss_kb"] / small["maxrss_kb"]
    table = Table(title=f"Peak memory with the on-disk client state store ({algorithm}, {rounds} rounds, 10 clients per round)")
    table.add_column("setting")
    table.add_column("peak RSS (MiB)", justify="right")
    table.add_row("100 clients, 10 % sampled", f"{small['maxrss_kb'] / 1024:.1f}")
    table.add_row("1000 clients, 1 % sampled", f"{big['maxrss_kb'] / 1024:.1f}")
    table.add_row("ratio (target ≤ 1.2)", f"{ratio:.3f}")
    make_console().print(table)
    out = {"small": small, "big": big, "ratio": ratio}
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2))
    return out


def _timed_run(cfg: RunConfig, backend: Any = None) -> tuple[float, list[dict[str, Any]]]:
    """Seconds spent in rounds (set-up of data, model and tiers excluded) and the metrics of one
    engine run."""
    with tempfile.TemporaryDirectory(prefix="fedhetero-bench-") as d:
        res = Engine(cfg, d, progress=False, backend=backend).run()
    return sum(r["wall_s"] for r in res.metrics), res.metrics


def _timer(rows: list[dict[str, Any]], name: str) -> float:
    """Seconds under ``timers[name]`` in these metrics rows (``client_phase``: running client tasks;
    ``evaluate``: evaluating the global model)."""
    return float(sum(r.get("timers", {}).get(name, 0.0) for r in rows))


def parallel_bound(local: float, clients: float, evaluation: float, two_local: float, split_eval: bool) -> float:
    """process/local throughput a back end with free messages could reach with two executors on
    this machine: a ``local`` run of ``local`` seconds keeps its serial part, and its parallel part
    (the client phase, and the evaluation when the back end shares its batches) runs halved, each
    half as much slower as two independent runs at once (``two_local`` seconds) make one."""
    parallel = clients + (evaluation if split_eval else 0.0)
    serial = max(local - parallel, 0.0)
    return local / (serial + parallel / 2 * two_local / local)


def _twin_main() -> None:
    """A second process running the ``local`` job on demand (``fedhetero bench engines``' ceiling
    row): reads ``{"cfg": config}`` as one JSON line, warms up, says ``ready``, then answers every ``go``
    line with the job's seconds in rounds."""
    init = json.loads(sys.stdin.readline())
    cfg = from_dict(init["cfg"])  # its ``threads`` (1) is applied by the engine
    _timed_run(cfg)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(_timed_run(cfg)[0], flush=True)


class _Twin:
    """The :func:`_twin_main` process: the same ``local`` job started at the same moment as ours."""

    def __init__(self, cfg_data: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
             "from fedhetero.lab.bench import _twin_main; _twin_main()", json.dumps(sys.path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cfg": cfg_data}) + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the second local process did not start")

    def start(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def seconds(self) -> float:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the second local process ended (exit code {self.proc.wait()})")
        return float(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self.proc.kill()
            self.proc.wait()


def engines_benchmark(*, clients: int, per_round: int, rounds: int, repeats: int, workers: int, dataset: str,
                      model: str, flower: bool, heavy_epochs: int, json_path: str | None = None) -> dict[str, Any]:
    """``fedhetero bench engines``: back ends side by side on one FedAvg job (``repeats`` interleaved
    repeats, the best of each reported; ``workers`` executors of the process back end; a second
    process/local row with ``heavy_epochs`` local epochs; with ``flower`` and the extra installed,
    our Flower back end vs Flower's own FedAvg strategy); prints the table, writes the numbers to
    ``json_path`` when given and returns them."""
    console = make_console()
    base = to_dict(_round_cfg(clients, per_round, rounds, "fedavg", dataset, model))
    base["threads"] = 1

    def cfg_for(**engine: Any) -> RunConfig:
        d = json.loads(json.dumps(base))
        d["engine"] = {**d.get("engine", {}), **engine}
        return from_dict(d)

    local_cfg = cfg_for(backend="local")
    proc_cfg = cfg_for(backend="process", workers=workers)
    base["train"]["local_epochs"] = heavy_epochs
    heavy_local, heavy_proc = cfg_for(backend="local"), cfg_for(backend="process", workers=workers)
    torch.set_num_threads(1)
    def started(cfg: Any) -> ProcessBackend:
        backend = ProcessBackend(cfg)
        backend.start()
        return backend

    t0 = time.perf_counter()
    pool = started(proc_cfg)
    startup = time.perf_counter() - t0
    split_eval = pool.evaluation_shares() >= 2  # the back end shares an evaluation of several batches
    heavy_pool = started(heavy_proc)
    twin: _Twin | None = None
    samples: dict[str, list[float]] = {
        "local": [], "process": [], "bare": [], "heavy_local": [], "heavy_process": [],
        "local_clients": [], "process_clients": [], "local_eval": [], "process_eval": [], "two_local": [],
    }
    try:
        try:
            twin = _Twin(to_dict(local_cfg))
        except (OSError, RuntimeError) as exc:  # the ceiling rows are left out, the rest is measured
            console.print(f"two local runs at once: skipped ({exc})", style="yellow")
        _timed_run(local_cfg)  # warm-up of this process and of the workers (their first task
        _timed_run(proc_cfg, backend=pool)  # builds caches: a one-time cost, like start-up)
        _timed_run(heavy_proc, backend=heavy_pool)
        for _ in range(repeats):  # interleaved so machine noise hits all alike
            for name, cfg, backend in (("local", local_cfg, None), ("process", proc_cfg, pool)):
                seconds, rows = _timed_run(cfg, backend=backend)
                samples[name].append(seconds)
                samples[f"{name}_clients"].append(_timer(rows, "client_phase"))
                samples[f"{name}_eval"].append(_timer(rows, "evaluate"))
            samples["bare"].append(bare_fedavg(local_cfg, rounds))
            samples["heavy_local"].append(_timed_run(heavy_local)[0])
            samples["heavy_process"].append(_timed_run(heavy_proc, backend=heavy_pool)[0])
            if twin is not None:
                twin.start()  # the same local job in two processes at once: one per core
                ours = _timed_run(local_cfg)[0]
                samples["two_local"].append(max(ours, twin.seconds()))
    finally:
        pool.close()
        heavy_pool.close()
        if twin is not None:
            twin.close()
    best = {k: min(v) for k, v in samples.items() if v}
    tasks = rounds * per_round
    ceiling = bound = "skipped"
    if "two_local" in best:
        ceiling = f"{2 * best['local'] / best['two_local']:.2f}×"
        bound = f"{parallel_bound(best['local'], best['local_clients'], best['local_eval'], best['two_local'], split_eval):.2f}×"
    table_rows = [
        ("local: client tasks / s", f"{tasks / best['local']:.1f}", ""),
        (f"process (engine.workers={workers}: this process + {workers - 1} worker"
         f"{'s' if workers != 2 else ''}): client tasks / s", f"{tasks / best['process']:.1f}", ""),
        ("process / local throughput", f"{best['local'] / best['process']:.2f}×", "≥ 1.7× with 2 workers on 2 cores"),
        ("process / local, median of pairs",
         f"{statistics.median(a / b for a, b in zip(samples['local'], samples['process'])):.2f}×",
         "(each repeat runs both back to back)"),
        ("process / local, client phase",
         f"{best['local_clients'] / best['process_clients']:.2f}×",
         "(time in the back end's run of the tasks only: the server's serial work left out)"),
        ("two local runs at once / one", ceiling,
         "(throughput of two independent local runs, one per core: the machine's ceiling)"),
        ("process / local bound, no message cost", bound,
         "(the server's serial work alone, the client phase"
         f"{' and the evaluation' if split_eval else ''} halved at the slowdown of two busy cores)"),
        (f"process / local throughput, {heavy_epochs} local epoch{'s' if heavy_epochs != 1 else ''}",
         f"{best['heavy_local'] / best['heavy_process']:.2f}×", "(more work per client task)"),
        ("local / bare loop time", f"{best['local'] / best['bare']:.3f}", "≤ 1.05"),
        ("process worker start-up (once per run)", f"{startup:.2f} s", ""),
    ]
    out: dict[str, Any] = {"samples": samples, "startup_s": startup, "job": base}
    if flower:
        try:
            # deferred: it imports flwr, the optional "flower" extra (and Ray through the simulation)
            from fedhetero.integrations.flower import bench as fbench
        except ImportError as exc:
            table_rows.append(("flower rows", "skipped", f"install fedhetero[flower] ({exc})"))
        else:
            # Flower's FedAvg samples nodes, so both sides get one SuperNode per client; each run
            # includes Ray's start-up, so they are repeated, interleaved, and the best of each taken
            ours_t, theirs_t = [], []
            for _ in range(repeats):
                ours_t.append(fbench.time_ours(local_cfg, supernodes=clients))
                theirs_t.append(fbench.time_flower_fedavg(local_cfg, supernodes=clients))
            out["flower"] = {"ours_s": ours_t, "flower_fedavg_s": theirs_t}
            table_rows.append(("flower: ours / Flower's FedAvg strategy", f"{min(ours_t) / min(theirs_t):.3f}", "≤ 1.1"))
    table = Table(title=f"Back ends on one FedAvg job ({clients} clients, {per_round}/round, {rounds} rounds, {dataset}, {model}; best of {repeats} interleaved repeats)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target")
    for r in table_rows:
        table.add_row(*r)
    console.print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2))
    return out
