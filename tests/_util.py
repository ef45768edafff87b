"""Helpers shared by the tests (``from _util import ...``: tests/ is on ``sys.path``, as the folder of
the rootdir conftest.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: the repository's root folder (examples/, docs/, fedhetero/ ...), wherever a test file lies
ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str) -> Any:
    """The script ``examples/<name>.py`` as a module (examples are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def strip_wall(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics rows without their wall-clock fields (the rest must match between runs)."""
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k not in ("wall_s", "timers")}
        if "clients" in r:  # each client's wall time of its tasks
            r["clients"] = [{k: v for k, v in c.items() if k != "wall_s"} for c in r["clients"]]
        out.append(r)
    return out


class ServerOnlyModel(nn.Module):
    """A linear classifier whose forward fails in any process but the one that built it (a model
    a worker process cannot evaluate)."""

    def __init__(self, in_features: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, classes)
        self.pid = os.getpid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.getpid() != self.pid:
            raise RuntimeError("not in this process")
        return self.fc(x.flatten(1))


def processes() -> list[tuple[int, str, list[str], bytes]]:
    """Every process as ``(pid, name, stat fields after the name, command line)``, read from
    /proc (Linux); a process that ends while it is read is left out."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out.append((int(entry.name), name, stat[stat.rindex(")") + 2 :].split(), command))
    return out


def live_children(parent: int | None = None) -> set[int]:
    """The pids of the running children of ``parent`` (default: this process), read from /proc
    (Linux); a child that ended and waits for its reaper (a zombie) is left out."""
    parent = os.getpid() if parent is None else parent
    return {pid for pid, _, fields, _ in processes() if int(fields[1]) == parent and fields[0] != "Z"}


def budget_method_cfg(algorithm: str, options: dict[str, Any], **over: dict[str, Any]) -> Any:
    """A small synthetic run of a budget-sized method (six LeNet-5 clients at width 1/4, two
    rounds, a public split for the distillation methods); ``over``: sections to update."""
    from fedhetero.core.common.config import from_dict

    base: dict[str, Any] = {
        "seed": 5,
        "data": {
            "dataset": "synthetic", "synthetic_size": 180, "num_clients": 6, "min_partition_size": 5,
            "public_fraction": 0.2,
        },
        "model": {"name": "lenet5", "width": 0.25},
        "train": {"rounds": 2, "sample_rate": 0.5, "local_epochs": 1, "batch_size": 16, "eval_batch_size": 256},
        "algorithm": {"name": algorithm, "options": options},
    }
    for k, v in over.items():
        base.setdefault(k, {}).update(v)
    return from_dict(base)


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a run directory's metrics.jsonl."""
    import json

    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def run_within_budgets(tmp_path: Path, cfg: Any) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    """Run ``cfg`` and check what every budget-sized method must show: two finite rounds with a
    per-tier accuracy, every client within its budget and sending bytes both ways, the summary
    agreeing with the last row. Returns the engine, the rows, the client entries and the largest
    MACs trained per tier (a larger tier trains a larger model)."""
    import math

    from fedhetero.core.run.engine import Engine

    engine = Engine(cfg, tmp_path, progress=False, shared_splits=True)
    res = engine.run()
    rows = metrics_rows(tmp_path)
    assert len(rows) == 2
    last = rows[-1]
    assert 0.0 <= last["accuracy"] <= 1.0 and math.isfinite(last["loss"])
    assert set(last["tier_accuracy"]) == {"small", "medium", "large"}
    clients = [c for r in rows for c in r["clients"]]
    assert len(clients) == 6
    for c in clients:
        assert 0 < c["macs"] <= c["budget_macs"] * (1 + 1e-9)
        assert c["fits_budget"] is True
        assert c["bytes_up"] > 0 and c["bytes_down"] > 0
        assert math.isfinite(c["loss"])
    assert res.summary["all_fit_budget"] is True
    assert res.summary["final_accuracy"] == last["accuracy"]
    by_tier: dict[str, set[int]] = {}
    for c in clients:
        by_tier.setdefault(c["tier"], set()).add(c["macs"])
    macs = {t: max(v) for t, v in by_tier.items()}
    if "small" in macs and "large" in macs:
        assert macs["small"] < macs["large"]
    return engine, rows, clients, macs


def equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Assert two state dicts hold the same keys, in order, and bit-equal tensors."""
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


class SharedRuns:
    """Engine runs shared by the tests of one module (each configuration runs once): a module
    fixture returns ``SharedRuns(tmp_path_factory.mktemp(...))`` and tests call ``get``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[Any, Any]] = {}

    def get(self, tag: str, cfg: Any, **kw: Any) -> tuple[Any, Any]:
        from fedhetero.core.run.engine import Engine

        if tag not in self.done:
            eng = Engine(cfg, self.root / tag, progress=False, **kw)
            self.done[tag] = (eng, eng.run())
        return self.done[tag]


#: a DynInit session run on digits (logistic regression, 7 sessions of 5 rounds)
SESSION_BASE = {
    "seed": 0,
    "threads": 1,
    "data": {"dataset": "digits", "partition": "session_groups", "num_clients": 20, "alpha": 0.5},
    "model": {"name": "logreg"},
    "train": {"rounds": 35, "sample_rate": 1.0, "batch_size": 32, "lr": 0.05, "local_epochs": 1,
              "lr_schedule": "polynomial", "lr_min": 0.01, "weight_decay": 0.0},
    "sessions": {"count": 7, "rounds": 5, "transition_window": 3},
    "algorithm": {"name": "dyninit", "options": {"host": "fedavg"}},
}


def session_cfg(**over: Any) -> Any:
    """:data:`SESSION_BASE` with dotted overrides (``train.rounds=10``)."""
    import json

    from fedhetero.core.common.config import from_dict

    return from_dict(dotted(json.loads(json.dumps(SESSION_BASE)), over))


def dotted(data: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config as nested dicts) with dotted overrides (``train.rounds``) set in place."""
    for key, value in over.items():
        node = data
        *parts, last = key.split(".")
        for p in parts:
            node = node.setdefault(p, {})
        node[last] = value
    return data


def fedavg_cfg(name: str = "fedavg", backend: str = "local", rounds: int = 3, options: Any = None, **engine: Any) -> Any:
    """Ten digits clients, 40 % sampled, ``rounds`` rounds of one local epoch, checkpoints every
    round, on ``backend`` with the ``engine`` options (clients one by one unless they say
    otherwise) and the method's ``options``."""
    from fedhetero.core.common.config import from_dict

    return from_dict(
        {
            "seed": 1,
            "threads": 1,
            "data": {"num_clients": 10},
            "train": {"rounds": rounds, "sample_rate": 0.4, "local_epochs": 1, "checkpoint_every": 1},
            "algorithm": {"name": name, "options": dict(options or {})},
            # one by one unless a test asks otherwise: the back ends then agree bit for bit
            "engine": {"backend": backend, "vectorize": False, **engine},
        }
    )


def client_half_from_the_task_alone(cfg: Any, tmp_path: Any, keeps_client_state: bool) -> None:
    """The client half needs only the options, the task (after a trip through pickle, as to a
    worker process) and a client context without the server's store; it gives the same upload
    either way, reports what the server sent, and its result pickles too; the server aggregates
    the results."""
    import pickle

    import torch

    from fedhetero.core.local.context import client_context
    from fedhetero.core.run.engine import Engine
    from fedhetero.core.exchange.types import payload_bytes

    engine = Engine(cfg, tmp_path, progress=False, shared_splits=True)
    engine.setup()
    engine.ctx.round = 1
    algo = engine.algorithm
    clients = [engine.client_info(c, 1) for c in engine.sample_clients(1)]
    tasks = algo.configure(engine.ctx, clients)
    assert [t.cid for t in tasks] == [c.cid for c in clients]
    cctx = client_context(cfg, engine.data)
    assert not hasattr(cctx, "store")
    results = []
    for task in tasks:
        out = []
        for t in (task, pickle.loads(pickle.dumps(task))):
            with cctx.client_scope(t):
                out.append(type(algo)(algo.options).client_update(cctx, t, None))
        a, b = out
        assert a.state.keys() == b.state.keys()
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
        assert a.bytes_down == payload_bytes(task.payload) > 0
        assert (a.client_state is not None) == keeps_client_state
        results.append(pickle.loads(pickle.dumps(b)))
    algo.aggregate(engine.ctx, results)
    algo.server_update(engine.ctx)


def local_cfg(name: str = "fedavg", rounds: int = 3, options: Any = None, train: Any = None, data: Any = None,
              **top: Any) -> Any:
    """Eight digits clients, half sampled, one local epoch, checkpoints every round."""
    from fedhetero.core.common.config import from_dict

    return from_dict(
        {
            "seed": 3,
            "threads": 1,
            "data": {"num_clients": 8, **(data or {})},
            "train": {"rounds": rounds, "sample_rate": 0.5, "local_epochs": 1, "checkpoint_every": 1, **(train or {})},
            "algorithm": {"name": name, "options": options or {}},
            # one by one unless a test asks otherwise: methods that batch and methods that do
            # not then agree bit for bit where they should
            **{"engine": {"vectorize": False}, **top},
        }
    )


def run_engine(tmp_path: Path, cfg: Any, tag: str, **kw: Any) -> tuple[Any, Any]:
    """The engine of a run in ``tmp_path / tag`` and the run's result."""
    from fedhetero.core.run.engine import Engine

    eng = Engine(cfg, tmp_path / tag, progress=False, **kw)
    return eng, eng.run()


def global_state(eng: Any) -> dict[str, torch.Tensor]:
    """A copy of the engine's global model state."""
    return {k: v.detach().clone() for k, v in eng.algorithm.global_model.state_dict().items()}


def bn_nodes(out: torch.Tensor) -> int:
    """BatchNorm passes in the autograd graph of ``out``."""
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += "BatchNorm" in type(fn).__name__
        stack.extend(f for f, _ in fn.next_functions)
    return count


def expanded_block(gen, branches=("1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"), *, cin=1, cout=6, k=5, stride=1,
                   padding=0, dilation=1, hw=(14, 14), momentum=0.1, nest=(), nested_branches=("1x1", "1x1_avg"),
                   n=8):
    """A float64 conv (+BN) expanded the way DynamicFL expands LeNet-5's first conv (its defaults):
    anchor BN, crop windows for the 1×1/1×K/K×1 branches, optionally nested blocks in ``nest``
    branches; BatchNorms randomised and every parameter perturbed. Returns it in training mode and
    an input batch of ``n``."""
    from reparam import DiverseBranchBlock
    from reparam.testing import randomize_bn_

    F64 = torch.float64
    conv = nn.Conv2d(cin, cout, k, stride, padding, dilation, bias=False)
    blk = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(cout, momentum=momentum), branches=list(branches))
    for name in nest:
        blk.grow_nested(name, list(nested_branches))
    blk = blk.to(F64)
    randomize_bn_(blk, gen)
    with torch.no_grad():
        for m in blk.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = momentum
        for p in blk.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.2)
    x = torch.randn(n, cin, *hw, generator=gen, dtype=F64) + 0.3
    return blk.train(), x


def step_against_per_branch(ref: Any, new: Any, x: torch.Tensor, *, input_grad: bool = True,
                            new_context: Any = None, buffer_floor: float = 0.0,
                            new_memory_format: torch.memory_format = torch.preserve_format,
                            ) -> tuple[list[float], tuple[torch.Tensor, torch.Tensor]]:
    """One training step of ``ref`` with the per-branch forward and of ``new`` as it runs (inside
    ``new_context()`` when given), on copies of ``x`` (``new``'s in ``new_memory_format``), both
    backward with one output gradient.

    Returns the relative errors of ``new`` — output, input gradient (with ``input_grad``), every
    parameter gradient (over the largest reference gradient), every floating buffer (over
    ``max(max|reference|, buffer_floor)``, 1 when that is 0) — and the two outputs. Asserts that the
    same parameters received gradients and that integer buffers (batch counts) are equal."""
    from reparam.fused import fused_training
    from reparam.testing import rel_err

    xr = x.clone().requires_grad_(input_grad)
    xn = x.clone(memory_format=new_memory_format).requires_grad_(input_grad)
    with fused_training(False):
        o_ref = ref(xr)
    with new_context() if new_context is not None else contextlib.nullcontext():
        o_new = new(xn)
    g = torch.randn_like(o_ref)
    o_ref.backward(g)
    o_new.backward(g)
    errs = [rel_err(o_new, o_ref)]
    if input_grad:
        errs.append(rel_err(xn.grad, xr.grad))
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for (name, p_ref), p_new in zip(ref.named_parameters(), new.parameters()):
        assert (p_ref.grad is None) == (p_new.grad is None), name
        if p_ref.grad is not None:
            errs.append(float((p_new.grad - p_ref.grad).abs().max()) / scale)
    for (name, b_ref), b_new in zip(ref.named_buffers(), new.buffers()):
        if b_ref.is_floating_point():
            denom = max(float(b_ref.abs().max()), buffer_floor)
            errs.append(float((b_new - b_ref).abs().max()) / (denom if denom > 0 else 1.0))
        else:
            assert torch.equal(b_ref, b_new), name
    return [float(e) for e in errs], (o_ref, o_new)
