"""Benchmarks of the federated engine, measured side by side in one run.

``fedhetero bench round``   FedAvg through the engine vs a bare hand-written PyTorch loop doing the
                            same training (same data, clients, order, model); and the share of a
                            DynamicFL round spent in REP, DYMM and merge.
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

import argparse
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

__all__ = ["bare_fedavg", "engines_main", "round_main", "memory_main"]


def _round_cfg(clients: int, per_round: int, rounds: int, algorithm: str, dataset: str, model: str):
    from fedhetero.config import from_dict

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


def bare_fedavg(cfg, rounds: int) -> float:
    """A hand-written FedAvg loop over the engine's own partitions and batch order; returns seconds."""
    from fedhetero.data import iterate_batches
    from fedhetero.engine import Engine

    eng = Engine(cfg, tempfile.mkdtemp(prefix="fedhetero-bare-"), progress=False)
    eng._setup()
    ctx, data = eng.ctx, eng.data
    global_model = eng.algorithm.global_model
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
        avg = {}
        for k, v in states[0].items():
            if torch.is_floating_point(v):
                avg[k] = sum(s[k] * (w / total) for s, w in zip(states, weights))
            else:
                avg[k] = v
        global_model.load_state_dict(avg)
    ctx.evaluate(global_model)
    return time.perf_counter() - t0


def round_main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(
        prog="fedhetero bench round",
        description="FedAvg through the engine vs a bare hand-written PyTorch loop doing the same training "
        "(same data, clients, batch order, model), and the share of a DynamicFL round spent in REP, DYMM "
        "and merge. Both sides run interleaved; the median of the repeats is reported.",
    )
    p.add_argument("--clients", type=int, default=100, help="clients in the federation (default 100)")
    p.add_argument("--per-round", type=int, default=10, help="clients sampled per round (default 10)")
    p.add_argument("--rounds", type=int, default=10, help="rounds per timed run (default 10)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of each side (default 5)")
    p.add_argument("--model", default="lenet5", help="zoo model (default lenet5)")
    p.add_argument("--dataset", default="digits", help="data set (default digits)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--dynamicfl-rounds", type=int, default=10, help="rounds of the DynamicFL share measurement")
    p.add_argument("--json", help="write the numbers to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console()
    cfg = _round_cfg(args.clients, args.per_round, args.rounds, "fedavg", args.dataset, args.model)
    eng_t, bare_t = [], []
    # warm-up: one-time costs of a fresh process (lazy imports, first optimizer) are not a round's
    warm = _round_cfg(args.clients, args.per_round, 1, "fedavg", args.dataset, args.model)
    bare_fedavg(warm, 1)
    _timed_run(warm)
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        bare_t.append(bare_fedavg(cfg, args.rounds))
        eng_t.append(_timed_run(cfg)[0])
    e, b = statistics.median(eng_t), statistics.median(bare_t)
    dcfg = _round_cfg(20, 10, args.dynamicfl_rounds, "dynamicfl", args.dataset, args.model)
    from fedhetero.config import from_dict, to_dict

    d = to_dict(dcfg)
    d["train"]["local_epochs"] = 2
    d["data"]["partition"] = "dirichlet"
    d["data"]["min_partition_size"] = 10
    dcfg = from_dict(d)
    _, rows = _timed_run(dcfg)
    wall = sum(r["wall_s"] for r in rows)
    shares = {k: sum(r["timers"].get(k, 0.0) for r in rows) / wall for k in ("rep", "dymm", "merge")}
    table = Table(title=f"FedAvg round: engine vs bare PyTorch loop ({args.clients} clients, {args.per_round}/round, {args.dataset}, {args.model}, {args.rounds} rounds, median of {args.repeats})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row("engine, s per round", f"{e / args.rounds:.4f}", "")
    table.add_row("bare loop, s per round", f"{b / args.rounds:.4f}", "")
    table.add_row("engine / bare", f"{e / b:.3f}", "≤ 1.05")
    table.add_row("(reference: Flower simulation / bare)", "3.8–4.1", "")
    table.add_row(f"DynamicFL round: REP share ({args.dynamicfl_rounds} rounds)", f"{100 * shares['rep']:.2f} %", "")
    table.add_row("DynamicFL round: DYMM share", f"{100 * shares['dymm']:.2f} %", "")
    table.add_row("DynamicFL round: merge share", f"{100 * shares['merge']:.2f} %", "")
    table.add_row("DynamicFL round: REP + DYMM + merge", f"{100 * sum(shares.values()):.2f} %", "≤ 5 %")
    console.print(table)
    out = {"engine_s": e, "bare_s": b, "ratio": e / b, "dynamicfl_shares": shares, "rounds": args.rounds}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


_MEM_CHILD = r"""
import json, resource, sys, tempfile
from fedhetero.config import from_dict
from fedhetero.engine import Engine
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


def memory_main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(prog="fedhetero bench memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--algorithm", default="dynamicfl")
    p.add_argument("--json", help="write the numbers to this file")
    args = p.parse_args(argv)
    small = _child_peak(100, 0.10, args.rounds, args.algorithm)
    big = _child_peak(1000, 0.01, args.rounds, args.algorithm)
    ratio = big["maxrss_kb"] / small["maxrss_kb"]
    table = Table(title=f"Peak memory with the on-disk client state store ({args.algorithm}, {args.rounds} rounds, 10 clients per round)")
    table.add_column("setting")
    table.add_column("peak RSS (MiB)", justify="right")
    table.add_row("100 clients, 10 % sampled", f"{small['maxrss_kb'] / 1024:.1f}")
    table.add_row("1000 clients, 1 % sampled", f"{big['maxrss_kb'] / 1024:.1f}")
    table.add_row("ratio (target ≤ 1.2)", f"{ratio:.3f}")
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"small": small, "big": big, "ratio": ratio}, indent=2))
    return 0


def _timed_run(cfg, backend: Any = None) -> tuple[float, list[dict[str, Any]]]:
    """Seconds spent in rounds (set-up of data, model and tiers excluded) and the metrics of one
    engine run."""
    from fedhetero.engine import Engine

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
    from fedhetero.config import from_dict

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


def engines_main(argv: list[str] | None = None) -> int:
    """``fedhetero bench engines``: back ends side by side on one FedAvg job."""
    from rich.console import Console
    from rich.table import Table

    from fedhetero.config import from_dict, to_dict
    from fedhetero.engines.process import ProcessBackend

    p = argparse.ArgumentParser(
        prog="fedhetero bench engines",
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
    args = p.parse_args(argv)
    console = Console()
    base = to_dict(_round_cfg(args.clients, args.per_round, args.rounds, "fedavg", args.dataset, args.model))
    base["threads"] = 1

    def cfg_for(**engine: Any):
        d = json.loads(json.dumps(base))
        d["engine"] = {**d.get("engine", {}), **engine}
        return from_dict(d)

    local_cfg = cfg_for(backend="local")
    proc_cfg = cfg_for(backend="process", workers=args.workers)
    base["train"]["local_epochs"] = args.heavy_epochs
    heavy_local, heavy_proc = cfg_for(backend="local"), cfg_for(backend="process", workers=args.workers)
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
        for _ in range(args.repeats):  # interleaved so machine noise hits all alike
            for name, cfg, backend in (("local", local_cfg, None), ("process", proc_cfg, pool)):
                seconds, rows = _timed_run(cfg, backend=backend)
                samples[name].append(seconds)
                samples[f"{name}_clients"].append(_timer(rows, "client_phase"))
                samples[f"{name}_eval"].append(_timer(rows, "evaluate"))
            samples["bare"].append(bare_fedavg(local_cfg, args.rounds))
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
    tasks = args.rounds * args.per_round
    ceiling = bound = "skipped"
    if "two_local" in best:
        ceiling = f"{2 * best['local'] / best['two_local']:.2f}×"
        bound = f"{parallel_bound(best['local'], best['local_clients'], best['local_eval'], best['two_local'], split_eval):.2f}×"
    rows = [
        ("local: client tasks / s", f"{tasks / best['local']:.1f}", ""),
        (f"process (engine.workers={args.workers}: this process + {args.workers - 1} worker"
         f"{'s' if args.workers != 2 else ''}): client tasks / s", f"{tasks / best['process']:.1f}", ""),
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
        (f"process / local throughput, {args.heavy_epochs} local epoch{'s' if args.heavy_epochs != 1 else ''}",
         f"{best['heavy_local'] / best['heavy_process']:.2f}×", "(more work per client task)"),
        ("local / bare loop time", f"{best['local'] / best['bare']:.3f}", "≤ 1.05"),
        ("process worker start-up (once per run)", f"{startup:.2f} s", ""),
    ]
    out: dict[str, Any] = {"samples": samples, "startup_s": startup, "job": base}
    if not args.no_flower:
        try:
            from fedhetero.integrations.flower import bench as fbench
        except ImportError as exc:
            rows.append(("flower rows", "skipped", f"install fedhetero[flower] ({exc})"))
        else:
            # Flower's FedAvg samples nodes, so both sides get one SuperNode per client; each run
            # includes Ray's start-up, so they are repeated, interleaved, and the best of each taken
            ours_t, theirs_t = [], []
            for _ in range(args.repeats):
                ours_t.append(fbench.time_ours(local_cfg, supernodes=args.clients))
                theirs_t.append(fbench.time_flower_fedavg(local_cfg, supernodes=args.clients))
            out["flower"] = {"ours_s": ours_t, "flower_fedavg_s": theirs_t}
            rows.append(("flower: ours / Flower's FedAvg strategy", f"{min(ours_t) / min(theirs_t):.3f}", "≤ 1.1"))
    table = Table(title=f"Back ends on one FedAvg job ({args.clients} clients, {args.per_round}/round, {args.rounds} rounds, {args.dataset}, {args.model}; best of {args.repeats} interleaved repeats)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
