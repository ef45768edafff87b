"""``algorithm.options.block_step: mean``: every SGD step of a client sees each block parameter's
loss gradient times ``reparam.branch_step_scales`` (saliency still reads it unscaled), every other
gradient as it is; at 1× (blocks of the anchor alone) it trains exactly as ``sum``."""

from __future__ import annotations

import torch

import reparam
from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine
from reparam.saliency import SaliencyMeter


def _cfg(tiers=None, **options):
    raw = {
        "seed": 0,
        "threads": 1,
        "data": {"num_clients": 4},
        "train": {"rounds": 2, "sample_rate": 1.0, "local_epochs": 2},
        "algorithm": {"name": "dynamicfl", "options": {"verify": True, **options}},
    }
    if tiers is not None:
        raw["budget"] = {"tiers": tiers}
    return from_dict(raw)


def test_mean_scales_each_block_gradient_by_its_branch_counts_at_every_step(tmp_path, monkeypatch):
    seen: dict[int, tuple[str, torch.Tensor, float]] = {}
    checked = {"steps": 0, "scaled": 0, "kept": 0}
    meter_step = SaliencyMeter.after_backward
    sgd_step = torch.optim.SGD.step

    def reading(self, *a, **k):  # what saliency reads: the loss gradient, before any scaling
        meter_step(self, *a, **k)
        scales = reparam.branch_step_scales(self.model)
        seen.clear()
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                seen[id(p)] = (name, p.grad.detach().clone(), scales.get(name, 1.0))

    def stepping(self, *a, **k):
        assert seen, "a step without the saliency meter's reading"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                name, raw, scale = seen[id(p)]
                assert torch.equal(p.grad, raw * scale if scale != 1.0 else raw), name
                checked["scaled" if scale != 1.0 else "kept"] += 1
        checked["steps"] += 1
        seen.clear()
        return sgd_step(self, *a, **k)

    monkeypatch.setattr(SaliencyMeter, "after_backward", reading)
    monkeypatch.setattr(torch.optim.SGD, "step", stepping)
    # the meter reads every step here (by default it skips the epochs whose values go unread), so
    # that every step's loss gradient is seen before the scaling
    from fedhetero.algorithms.dynamicfl.algorithm import DynamicFL

    monkeypatch.setattr(DynamicFL, "_records", lambda self, epoch, last, epochs: True)
    res = Engine(_cfg(block_step="mean"), tmp_path / "run", progress=False).run()
    assert res.summary["dropped_clients"] == 0
    assert checked["steps"] > 0 and checked["scaled"] > 0 and checked["kept"] > 0
    clients = [c for r in res.metrics for c in r["clients"]]
    assert all(0 <= c["lossless_out"] <= 1e-5 for c in clients)  # the upload is still what it trained


def test_mean_at_1x_trains_exactly_as_sum(tmp_path):
    one = [{"name": "all", "ratio": 1.0, "share": 1.0}]
    a = Engine(_cfg(one, block_step="sum"), tmp_path / "sum", progress=False).run()
    b = Engine(_cfg(one, block_step="mean"), tmp_path / "mean", progress=False).run()
    sa = torch.load(tmp_path / "sum" / "final_model.pt", weights_only=True)
    sb = torch.load(tmp_path / "mean" / "final_model.pt", weights_only=True)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.summary["final_accuracy"] == b.summary["final_accuracy"]


def test_mean_changes_training_where_blocks_have_branches(tmp_path):
    a = Engine(_cfg(block_step="sum", verify=False), tmp_path / "sum", progress=False).run()
    b = Engine(_cfg(block_step="mean", verify=False), tmp_path / "mean", progress=False).run()
    sa = torch.load(tmp_path / "sum" / "final_model.pt", weights_only=True)
    sb = torch.load(tmp_path / "mean" / "final_model.pt", weights_only=True)
    assert any(not torch.equal(sa[k], sb[k]) for k in sa)
    assert b.summary["final_accuracy"] > 0.5 and a.summary["dropped_clients"] == b.summary["dropped_clients"] == 0
