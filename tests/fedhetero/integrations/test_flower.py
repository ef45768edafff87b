"""The ``flower`` back end: lossless encoding, the back end against a mock grid (no Ray), Flower's
simulation engine against ``local`` (numbers and resume), and (``slow``) a real deployment with a
SuperLink and three SuperNodes on 127.0.0.1."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before Flower is imported: no telemetry from tests

pytest.importorskip("flwr", reason='the flower back end needs the extra: pip install "fedhetero[flower]"')
try:
    from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
except ImportError:  # pragma: no cover - depends on the installed Flower
    pytest.skip("the flower back end needs flwr>=1.21 (Message API)", allow_module_level=True)

import numpy as np
import torch
import yaml

from fedhetero.core.exchange.types import ClientResult, ClientTask
from fedhetero.core.common.config import from_dict
from fedhetero.core.local.context import RunError
from fedhetero.core.run.engine import Engine
from fedhetero.core.exchange.types import Outcome
from fedhetero.integrations.flower.backend import FlowerBackend
from fedhetero.integrations.flower.client_app import app as client_app
from fedhetero.integrations.flower.client_app import (
    load_client_state,
    store_client_state,
)
from fedhetero.integrations.flower.codec import (
    decode_outcome,
    decode_task,
    decode_value,
    encode_outcome,
    encode_task,
    encode_value,
)

from _util import ROOT, processes, strip_wall



# ---------------------------------------------------------------------------------- helpers
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def _same(a, b) -> bool:
    """Exact equality: tensors bit for bit with dtype and shape, NaN == NaN, containers by type."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def _payload() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    return {
        "state": OrderedDict(
            [
                ("conv.weight", w),
                ("bn.running_var", torch.rand(3, generator=g, dtype=torch.float64)),
                ("bn.num_batches_tracked", torch.tensor(7)),
            ]
        ),
        "alias": w,  # the same tensor twice: sent once, shared again on arrival
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(2, 2, generator=g).half(),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "empty_bf16": torch.zeros(0, dtype=torch.bfloat16),
        "scalar": torch.tensor(-0.0),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "bad": torch.tensor([float("nan"), float("inf"), -float("inf")]),
        "width": 0.75,
        "ids": [1, 2, 3],
        "pair": (1, "two", None, 3.5),
        "nested": {"a": [{"b": torch.ones(2, dtype=torch.int32)}, ("x", b"\x00\xff")], 3: {"k": float("nan")}},
        "np": np.arange(4, dtype=np.int16),
        "np_scalar": np.float32(0.1),
        "flag": False,
    }


# ---------------------------------------------------------------------------------- (a) encoding
def test_task_round_trip_is_exact():
    task = ClientTask(
        cid=5, tier="medium", ratio=2.0, budget_macs=1.5e6, num_samples=37, round=4,
        budget_after_change=1.2e6, seed=2**62 + 3, payload=_payload(), step=1,
    )
    state = {"structure": {"blocks": [["conv", 3], ("bn", None)]}, "state": {"w": torch.randn(3, 3)}, "s_local": {"0/1": 0.25}}
    content = encode_task(task, state, config='{"seed": 1}', config_hash="abc")
    back, back_state, config, h = decode_task(content)
    assert isinstance(back, ClientTask)
    for f in ("cid", "tier", "ratio", "budget_macs", "num_samples", "round", "budget_after_change", "seed", "step"):
        assert getattr(back, f) == getattr(task, f), f
    assert _same(task.payload, back.payload)
    assert back.payload["alias"] is back.payload["state"]["conv.weight"]
    assert _same(state, back_state)
    assert (config, h) == ('{"seed": 1}', "abc")
    assert decode_task(encode_task(task))[1] is None  # no state: the node keeps its own


def test_outcome_round_trip_is_exact():
    from fedhetero.core.hetero.submodel import rolling_spec
    from fedhetero.models import build_model

    model = build_model("lenet5", num_classes=10, in_channels=1, input_size=32)
    spec = rolling_spec(model, 0.5, 3)
    task = ClientTask(cid=2, tier="small", ratio=1.0, budget_macs=1e6, num_samples=10, round=3)
    result = ClientResult(
        cid=2, num_samples=10, state=dict(model.state_dict()), spec=spec, macs=123456, budget_macs=1e6,
        bytes_up=999, bytes_down=1000, tier="small",
        metrics={"loss": 0.5, "lossless_out": 1.2e-7, "mode": "grown", "branches": 4, "nan": float("nan")},
        payload={"logits": torch.randn(6, 10), "ids": [4, 5]},
        client_state={"state": {"w": torch.randn(2).to(torch.bfloat16)}, "meta": ("a", 1)},
        timers={"train": 0.25},
    )
    out = decode_outcome(encode_outcome(Outcome(task, result, None, 1.25, "")), task)
    assert out.task is task and out.error is None and out.seconds == 1.25
    r = out.result
    assert r is not None and r.spec == spec and r.spec is not spec
    for f in ("cid", "num_samples", "macs", "budget_macs", "bytes_up", "bytes_down", "tier", "timers"):
        assert getattr(r, f) == getattr(result, f), f
    for f in ("state", "metrics", "payload", "client_state"):
        assert _same(getattr(result, f), getattr(r, f)), f
    failed = decode_outcome(encode_outcome(Outcome(task, None, "InjectedFault: boom", 0.5, "Traceback ...")), task)
    assert (failed.result, failed.error, failed.seconds, failed.detail) == (None, "InjectedFault: boom", 0.5, "Traceback ...")


def test_encoding_never_pickles():
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"payload\['obj'\].*cannot be sent"):
        encode_value({"obj": Opaque()}, "payload")
    with pytest.raises(TypeError, match="object"):
        encode_value(np.array([Opaque()], dtype=object))
    text, arrays = encode_value({"x": torch.ones(2)})
    assert all(a.stype == "numpy.ndarray" for a in arrays.values())  # np.save without pickle
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        decode_value(text.replace("float32", "save"), arrays)


def test_client_state_stays_on_the_node_versioned_by_round():
    rd = RecordDict()
    assert load_client_state(rd, 3, before_round=5) is None
    store_client_state(rd, 3, 2, {"w": torch.full((2,), 2.0)})
    store_client_state(rd, 3, 4, {"w": torch.full((2,), 4.0)})
    store_client_state(rd, 33, 4, {"w": torch.full((2,), 33.0)})
    assert load_client_state(rd, 3, before_round=4)["w"][0] == 2.0  # a second exchange in round 4
    assert load_client_state(rd, 3, before_round=5)["w"][0] == 4.0
    store_client_state(rd, 3, 6, {"w": torch.full((2,), 6.0)})  # round 2's version is no longer needed
    assert load_client_state(rd, 3, before_round=5)["w"][0] == 4.0
    assert load_client_state(rd, 3, before_round=7)["w"][0] == 6.0
    assert load_client_state(rd, 3, before_round=3) is None
    assert load_client_state(rd, 33, before_round=7)["w"][0] == 33.0


# ---------------------------------------------------------------------------------- (b) mock grid
@pytest.fixture
def task_identity():
    """Messages are stamped with the running task's identity (Flower's runtime sets it)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


class MockGrid:
    """A grid whose nodes run the ClientApp in this process (or a custom handler); node ids are
    random-looking and not in partition order."""

    def __init__(self, n: int, handler=None, partitions=None) -> None:
        ids = [9_000_000_000 - 977 * i for i in range(n)]
        parts = list(range(n))[::-1] if partitions is None else partitions
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config={} if p is None else {"partition-id": p, "num-partitions": n},
                         state=RecordDict(), run_config={})
            for nid, p in zip(ids, parts)
        }
        self.handler = handler or client_app
        self.replies: dict[str, Message] = {}
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            self.sent.append(m)
            try:
                reply = self.handler(m, self.contexts[m.metadata.dst_node_id])
            except Exception as exc:  # as Flower does: an exception becomes an error reply
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=m)
            if reply is not None:
                self.replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def _cfg(name: str = "fedavg", **over):
    data = {
        "seed": 2,
        "threads": 1,
        "data": {"num_clients": 6},
        "train": {"rounds": 3, "sample_rate": 0.5, "local_epochs": 1, "checkpoint_every": 1},
        "algorithm": {"name": name},
    }
    for k, v in over.items():
        data.setdefault(k, {}).update(v) if isinstance(v, dict) else data.__setitem__(k, v)
    return from_dict(data)


def _strip(rows):
    return strip_wall(rows)


def _read(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize(
    "name",
    ["fedavg", "dynamicfl", "fedprox", "scaffold", "feddyn", "fednova", "moon", "fedacg", "fedensemble", "fedgen",
     "dynacomm"],
)
def test_mock_grid_gives_the_numbers_of_local(tmp_path, task_identity, name):
    """The whole path (encode → ClientApp → decode) is bit-exact; DynamicFL's private client state
    lives in the nodes' context.state and gives the numbers of the server-side store."""
    cfg = _cfg(name)
    a = Engine(cfg, tmp_path / "local", progress=False)
    ra = a.run()
    grid = MockGrid(4)
    b = Engine(cfg, tmp_path / "flower", progress=False, backend=FlowerBackend(cfg, grid, num_nodes=4))
    rb = b.run()
    assert _strip(ra.metrics) == _strip(rb.metrics)
    sa, sb = a.algorithm.global_model.state_dict(), b.algorithm.global_model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not (tmp_path / "flower" / "client_state").exists() or not any((tmp_path / "flower" / "client_state").iterdir())
    if name == "dynamicfl":  # kept on the nodes instead
        assert any(k.startswith("fedhetero.state.") for c in grid.contexts.values() for k in c.state)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(json.loads(str(m.content["fedhetero"]["doc"]))["D"][1][1] is None for m in train)  # no state sent


def test_mock_grid_injected_faults_drop_the_same_clients_as_local(tmp_path, task_identity):
    cfg = _cfg(engine={"inject_faults": {"rate": 0.4, "kinds": ["raise", "nan"]}})
    ra = Engine(cfg, tmp_path / "local", progress=False).run()
    rb = Engine(cfg, tmp_path / "flower", progress=False, backend=FlowerBackend(cfg, MockGrid(3), num_nodes=3)).run()
    drops = [[(d["cid"], d["reason"].split(":")[0]) for d in r["dropped"]] for r in ra.metrics]
    assert any(drops) and drops == [[(d["cid"], d["reason"].split(":")[0]) for d in r["dropped"]] for r in rb.metrics]
    assert _strip(ra.metrics) == _strip(rb.metrics)


def test_mock_grid_error_replies_drop_the_client_and_the_run_goes_on(tmp_path, task_identity):
    cfg = _cfg(train={"rounds": 2, "sample_rate": 1.0})

    def handler(msg, ctx):
        if msg.metadata.message_type == "train" and int(msg.content["fedhetero"]["cid"]) == 4:
            raise RuntimeError("boom on the node")
        return client_app(msg, ctx)

    res = Engine(cfg, tmp_path / "run", progress=False, backend=FlowerBackend(cfg, MockGrid(3, handler), num_nodes=3)).run()
    for row in res.metrics:
        assert [d["cid"] for d in row["dropped"]] == [4]
        assert "the ClientApp raised an exception" in row["dropped"][0]["reason"] and "boom on the node" in row["dropped"][0]["reason"]
        assert [c["cid"] for c in row["clients"]] == [0, 1, 2, 3, 5]
    assert res.summary["dropped_clients"] == 2


def test_backend_error_missing_and_garbled_replies_become_failed_outcomes(task_identity):
    cfg = _cfg(engine={"client_timeout_s": 0.3})

    def handler(msg, ctx):
        if msg.metadata.message_type == "query":
            return client_app(msg, ctx)
        task, _, _, _ = decode_task(msg.content)
        if task.cid == 1:
            return Message(Error(code=2, reason="<class 'ValueError'>:<'bad data'>"), reply_to=msg)
        if task.cid == 2:
            return None  # never answers
        if task.cid == 3:
            return Message(RecordDict({"x": ConfigRecord({"a": 1})}), reply_to=msg)
        res = ClientResult(cid=task.cid, num_samples=3, state={"w": torch.full((2,), float(task.cid))})
        return Message(encode_outcome(Outcome(task, res, None, 0.01)), reply_to=msg)

    backend = FlowerBackend(cfg, MockGrid(2, handler), num_nodes=2, delivery_grace_s=0.0, poll_s=0.01)
    tasks = [ClientTask(cid=c, tier="small", ratio=1.0, budget_macs=1.0, num_samples=3, round=1) for c in (4, 3, 2, 1, 0)]
    done: list[Outcome] = []
    t0 = time.perf_counter()
    outs = backend.run(None, tasks, {}, on_done=done.append)
    assert time.perf_counter() - t0 < 5
    assert [o.task.cid for o in outs] == [0, 1, 2, 3, 4] and sorted(o.task.cid for o in done) == [0, 1, 2, 3, 4]
    assert all(any(o is d for d in done) for o in outs)  # on_done saw every outcome itself
    ok = {o.task.cid: o for o in outs if o.result is not None}
    assert sorted(ok) == [0, 4] and torch.equal(ok[4].result.state["w"], torch.full((2,), 4.0))
    reasons = {o.task.cid: o.error for o in outs if o.result is None}
    assert "the ClientApp raised an exception" in reasons[1] and "bad data" in reasons[1]
    assert reasons[2].startswith("timeout: no reply") and "client_timeout_s=0.3" in reasons[2]
    assert "could not be decoded" in reasons[3]
    # clients 0, 2 and 4 share a node: it gets its next task only when its last one is answered or
    # timed out, so client 4's task leaves after client 2's time-out
    sent = {int(m.content["fedhetero"]["cid"]): m.metadata.created_at for m in backend.grid.sent if m.metadata.message_type == "train"}
    assert sorted(sent) == [0, 1, 2, 3, 4] and sent[4] - sent[2] >= 0.3


def test_backend_waits_for_nodes_with_a_deadline(task_identity):
    backend = FlowerBackend(_cfg(), MockGrid(2), num_nodes=3, node_wait_s=0.5)
    t0 = time.perf_counter()
    with pytest.raises(RunError, match=r"2 node\(s\) connected within 0.5 s, 3 expected"):
        backend.connect()
    assert time.perf_counter() - t0 < 5


def test_backend_maps_clients_by_partition_id_not_node_id(task_identity):
    grid = MockGrid(3, partitions=[2, 0, 1])
    backend = FlowerBackend(_cfg(), grid, num_nodes=3)
    by_part = {ctx.node_config["partition-id"]: nid for nid, ctx in grid.contexts.items()}
    assert [backend.node_of(c) for c in range(7)] == [by_part[c % 3] for c in range(7)]
    with pytest.raises(RunError, match="partition ids 0..2"):
        FlowerBackend(_cfg(), MockGrid(3, partitions=[0, 1, None]), num_nodes=3).connect()


# ---------------------------------------------------------------------------------- the plot
def _serve(cfg, out: Path, **kw):
    from fedhetero.integrations.flower.server_app import ServerSettings, run_server

    return run_server(MockGrid(3), ServerSettings(config=cfg, out_dir=out, num_nodes=3, node_wait_s=5.0, **kw))


_PLOT = {"seed": 3, "train": {"rounds": 2}}


def test_server_app_writes_the_plot(tmp_path, task_identity):
    """The ServerApp (deployment and simulation alike) writes accuracy.png beside the metrics."""
    pytest.importorskip("matplotlib", reason="the plot needs the plot extra")
    res = _serve(_cfg(**_PLOT), tmp_path / "run")
    assert res.summary and (tmp_path / "run" / "accuracy.png").read_bytes().startswith(b"\x89PNG")


def test_an_unfinished_run_writes_no_plot(tmp_path, task_identity):
    res = _serve(_cfg(**_PLOT), tmp_path / "cut", stop_after=1)
    assert res.summary == {} and not (tmp_path / "cut" / "accuracy.png").exists()


def test_flower_simulate_names_the_plot(tmp_path, task_identity, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs the plot extra")
    from fedhetero.cli import main
    from fedhetero.integrations.flower import simulation
    from fedhetero.integrations.flower.server_app import ServerSettings, run_server

    def fake_simulate(cfg, out, num_supernodes=None, resume=False, **kw):  # the ServerApp, without Ray
        settings = ServerSettings(config=cfg, out_dir=Path(out).resolve(), num_nodes=3, node_wait_s=5.0)
        return run_server(MockGrid(3), settings, kw.get("console"))

    monkeypatch.setattr(simulation, "simulate", fake_simulate)
    out = tmp_path / "sim"
    sets = [a for k in ("data.num_clients=6", "train.rounds=2", "train.sample_rate=0.5", "train.local_epochs=1",
                        "algorithm.name=fedavg", "threads=1", "seed=3") for a in ("--set", k)]
    assert main(["flower", "simulate", *sets, "--out", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"plot: {out / 'accuracy.png'} (accuracy and loss by round)"
    assert "fedavg: final accuracy" in "\n".join(lines) and (out / "accuracy.png").is_file()


# ---------------------------------------------------------------------------------- (c), (d) simulation
SIM = {
    "seed": 1,
    "threads": 1,
    "data": {"dataset": "digits", "num_clients": 8},
    "train": {"rounds": 3, "sample_rate": 0.5, "local_epochs": 1, "checkpoint_every": 1},
    "algorithm": {"name": "fedavg"},
}


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory):
    """One local run and three simulation runs (uninterrupted, cut after round 1, resumed)."""
    from fedhetero.integrations.flower import simulate

    root = tmp_path_factory.mktemp("flower-sim")
    cfg = from_dict(SIM)
    local = Engine(cfg, root / "local", progress=False).run()
    flower = simulate(cfg, root / "flower", 8)
    cut = simulate(cfg, root / "cut", 8, stop_after=1)
    resumed = simulate(None, root / "cut", 8, True)
    return {"root": root, "local": local, "flower": flower, "cut": cut, "resumed": resumed}


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    state = torch.load(out / "checkpoint.pt", weights_only=True, map_location="cpu")["algorithm"]
    return state["global_model"]


def test_ray_keeps_its_session_folders_in_the_test_runs_temp_dir(sim_runs, ray_temp_dir):
    assert os.environ["RAY_TMPDIR"] == str(ray_temp_dir)
    assert list(ray_temp_dir.glob("ray/session_*")), "the simulation's Ray session is not under RAY_TMPDIR"


def test_simulation_fedavg_equals_local(sim_runs):
    root = sim_runs["root"]
    wl, wf = _final_weights(root / "local"), _final_weights(root / "flower")
    assert list(wl) == list(wf)
    for k in wl:
        if torch.is_floating_point(wl[k]):
            scale = float(wl[k].abs().max()) or 1.0
            assert float((wl[k] - wf[k]).abs().max()) / scale < 1e-5, k
        else:
            assert torch.equal(wl[k], wf[k]), k
    a, b = _read(root / "local"), _read(root / "flower")
    n_test = json.loads((root / "local" / "run.json").read_text())["data"]["test_size"]
    assert [r["round"] for r in a] == [r["round"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert [c["cid"] for c in ra["clients"]] == [c["cid"] for c in rb["clients"]]
        assert abs(ra["accuracy"] - rb["accuracy"]) <= 1.0 / n_test + 1e-12  # at most one test sample
        assert rb["dropped"] == []
    assert yaml.safe_load((root / "flower" / "config.yaml").read_text())["engine"]["backend"] == "flower"


def test_simulation_resume_equals_uninterrupted(sim_runs):
    root = sim_runs["root"]
    assert [r["round"] for r in sim_runs["cut"].metrics] == [1]
    assert [r["round"] for r in sim_runs["resumed"].metrics] == [1, 2, 3]
    assert _strip(_read(root / "cut")) == _strip(_read(root / "flower"))
    assert sim_runs["resumed"].summary["final_accuracy"] == sim_runs["flower"].summary["final_accuracy"]
    wa, wb = _final_weights(root / "flower"), _final_weights(root / "cut")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("form", ["file", "module"])
def test_user_algorithm_of_the_guide_runs_on_flower(tmp_path, monkeypatch, form):
    """docs/write_your_own_algorithm.md's example, as written, on Flower's simulation engine: named
    ``path/file.py:Class``, and ``module:Class`` from its folder."""
    import sys

    from fedhetero.integrations.flower import simulate

    example = ROOT / "examples" / "my_algorithm.py"
    data = json.loads(json.dumps(SIM))
    if form == "file":
        data["algorithm"] = {"name": f"{example}:FedAvgM"}
    else:
        monkeypatch.chdir(example.parent)
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(example.parent))])
        monkeypatch.delitem(sys.modules, "my_algorithm", raising=False)
        data["algorithm"] = {"name": "my_algorithm:FedAvgM"}
    cfg = from_dict(data)
    local = Engine(cfg, tmp_path / "local", progress=False).run()
    flower = simulate(cfg, tmp_path / "flower", 8)
    assert [r["round"] for r in flower.metrics] == [1, 2, 3]
    assert abs(flower.summary["final_accuracy"] - local.summary["final_accuracy"]) <= 1.0 / 360 + 1e-12
    assert flower.summary["final_accuracy"] > 0.3


# ---------------------------------------------------------------------------------- app and CLI
def test_written_app_passes_flowers_validation(tmp_path):
    from flwr.cli.config_utils import load_and_validate

    from fedhetero.integrations.flower.deploy import flower_config, write_app
    from fedhetero.integrations.flower.server_app import settings_from_run_config

    cfg = _cfg("dynamicfl", algorithm={"options": {"verify": True}})
    path = write_app(tmp_path / "app", cfg, out_dir=tmp_path / "run", num_supernodes=3, overrides=["train.rounds=2"])
    config, _ = load_and_validate(path, check_module=True)
    assert config["tool"]["flwr"]["app"]["components"]["serverapp"].endswith("server_app:app")
    settings = settings_from_run_config(config["tool"]["flwr"]["app"]["config"])
    assert settings.config.algorithm.options == {"verify": True} and settings.config.train.rounds == 2
    assert settings.out_dir == (tmp_path / "run").resolve() and settings.num_nodes == 3 and not settings.resume
    conf = flower_config(tmp_path / "home", "127.0.0.1:9999")
    assert 'address = "127.0.0.1:9999"' in conf.read_text()


def test_cli_writes_the_app(tmp_path, capsys):
    import argparse

    from fedhetero.integrations.flower.cli import add_parser

    parser = argparse.ArgumentParser(prog="fedhetero")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["flower", "app", str(tmp_path / "app"), "--set", "train.rounds=2", "--out", str(tmp_path / "run"), "--supernodes", "3"])
    assert args.func(args) == 0
    text = (tmp_path / "app" / "pyproject.toml").read_text()
    assert "num-supernodes = 3" in text and '"train.rounds\\":2' not in text and "flwr run" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- (e) deployment
def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _session_members(sids: set[int]) -> list[tuple[int, str]]:
    """Processes (pid, name) whose session is one of ``sids`` (from /proc)."""
    return [(pid, name) for pid, name, fields, _ in processes() if int(fields[3]) in sids]  # state ppid pgrp session


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited early with code {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process checks read /proc")
def test_deployment_superlink_and_three_supernodes(tmp_path):
    from fedhetero.integrations.flower.deploy import flower_config, write_app

    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_HOME=str(tmp_path / "flwr-home"), OMP_NUM_THREADS="1")
    link_port, *node_ports = _free_ports(4)
    cfg = from_dict(
        {
            "seed": 1,
            "threads": 1,
            "data": {"dataset": "digits", "num_clients": 3},
            "train": {"rounds": 3, "sample_rate": 1.0, "local_epochs": 1},
            "algorithm": {"name": "dynamicfl", "options": {"verify": True}},
        }
    )
    app = write_app(tmp_path / "app", cfg, out_dir=tmp_path / "run", num_supernodes=3, node_wait_s=120).parent
    flower_config(tmp_path / "flwr-home", f"127.0.0.1:{link_port}")
    procs: list[subprocess.Popen] = []
    logs = []

    def start(args: list[str], log: str) -> subprocess.Popen:
        logs.append((tmp_path / log).open("w"))
        p = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        link = start([str(bin_dir / "flower-superlink"), "--insecure", "--port", str(link_port),
                      "--disable-runtime-dependency-installation"], "superlink.log")
        _wait_port(link_port, link, 60)
        for i, port in enumerate(node_ports):
            start([str(bin_dir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                   "--port", str(port), "--node-config", f"partition-id={i} num-partitions=3"], f"supernode{i}.log")
        run = subprocess.run([str(bin_dir / "flwr"), "run", str(app), "fedhetero", "--stream"], check=False, env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=900)
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-3000:]
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        rows = _read(tmp_path / "run")
        assert [r["round"] for r in rows] == [1, 2, 3], log[-3000:]
        for r in rows:
            assert [c["cid"] for c in r["clients"]] == [0, 1, 2] and r["dropped"] == []
            for c in r["clients"]:
                assert c["fits_budget"] and c["macs"] <= c["budget_macs"]
                assert c["lossless_in"] < 1e-4 and c["lossless_out"] < 1e-4
        assert summary["all_fit_budget"] and summary["rounds"] == 3
    finally:
        sids = {p.pid for p in procs}
        for p in procs[1:] + procs[:1]:  # the SuperNodes, then the SuperLink
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                codes.append(None)
        deadline = time.monotonic() + 90
        while _session_members(sids) and time.monotonic() < deadline:
            time.sleep(1)
        left = _session_members(sids)
        for sid in sids:  # never leave anything behind, whatever the assertions say
            try:
                os.killpg(sid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for fh in logs:
            fh.close()
    # a clean stop on SIGTERM: a SuperNode exits with 0, the SuperLink re-raises the signal
    assert all(c in (0, -signal.SIGTERM) for c in codes), f"exit codes after SIGTERM: {codes}"
    assert not left, f"processes left after shutdown: {left}"
