"""The merge benchmark (``fedhetero bench reparam``, in ``fedhetero.lab.bench_reparam``: it needs
the model zoo and a reference to compare with, so it is not part of ``reparam``). Checked here: the
timed model is perturbed (no vacuous merge), the re-implementation of upstream's deploy conversion
computes the same function as our merge, and the result dict is consistent.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import reparam
from reparam import OneByOneKxKBranch
from reparam.flops import model_macs
from reparam.testing import perturb_, rel_err

bench = pytest.importorskip("fedhetero.lab.bench_reparam")


def _net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=4, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_upstream_reimplementation_computes_our_merge(dtype, tol) -> None:
    """Dense, grouped, stride-2 and depthwise blocks (identity-based and plain first stages,
    dense and depthwise average paths, identity branch), plus an unexpanded 1x1 conv+BN pair."""
    gen = torch.Generator().manual_seed(0)
    expanded = perturb_(reparam.expand(_net().to(dtype)), gen).eval()
    pairs = reparam.structure(expanded)["pairs"]
    assert pairs, "the net must keep a conv+BN pair for upstream's ConvBN path"
    x = torch.randn(2, 3, 16, 16, generator=gen, dtype=dtype)
    with torch.no_grad():
        ref = expanded(x)
        ours = reparam.merge(expanded)(x)
        upstream_model = bench.upstream_switch_to_deploy(expanded, pairs)  # in place
        assert not any(isinstance(m, (reparam.DiverseBranchBlock, nn.BatchNorm2d)) for m in upstream_model.modules())
        up = upstream_model(x)
    assert rel_err(ours, ref) <= tol
    # upstream builds its average-pool and identity kernels in float32 (1/9 rounded), whatever the
    # model's dtype, so in float64 it is exact to float32 rounding of those constants only
    assert rel_err(up, ref) <= max(tol, 1e-7)


def test_benchmark_times_a_perturbed_model() -> None:
    net = _net()
    res = bench.run_benchmark(batch=2, repeats=1, warmup=0, merge_repeats=1, train_repeats=1, model=net,
                              input_size=8, threads=None)
    assert res["perturbed"] is True
    assert res["macs_plain"] == model_macs(net, (3, 8, 8))
    assert res["macs_ratio"] == pytest.approx(res["macs_expanded"] / res["macs_plain"])
    assert res["merge_over_upstream"] == pytest.approx(res["merge_ms"] / res["merge_upstream_ms"])
    assert res["float64_products_over_upstream"] == pytest.approx(res["float64_products_ms"] / res["merge_upstream_ms"])
    samples = res["samples_ms"]
    assert res["merge_ms"] == pytest.approx(min(samples["merge.ours"]), abs=1e-3)
    assert res["merge_upstream_ms"] == pytest.approx(min(samples["merge.upstream"]), abs=1e-3)
    assert len(samples["merge.ours"]) == len(samples["merge.upstream"]) == res["merge_repeats"]
    assert all(v <= 1e-5 for v in res["merge_rel_err"].values())
    assert set(res["infer_ms"]) == {"plain", "expanded", "merged"}
    assert res["overhead_per_mac"] == pytest.approx(res["step_ratio"] / res["macs_ratio"])
    assert "merge_ms" not in res["quoted_upstream"]  # the upstream merge time is measured, not quoted
    if res["malloc_tuned"]:
        assert set(res["train_step_ms"]) == {"plain", "expanded", "expanded_per_branch"}
    with pytest.raises(ValueError, match="batch"):
        bench.run_benchmark(batch=0, model=net)


def test_float64_products_are_the_merge_products() -> None:
    """The floor row times the products the merge computes (it splits them by output rows): one
    per 1x1_kxk branch, the composed kernel plus the bias row."""
    expanded = perturb_(reparam.expand(_net().double()), torch.Generator().manual_seed(2)).eval()
    products = bench.float64_products(expanded)
    expected = []
    for _, block in reparam.iter_blocks(expanded):
        for name in block.branch_names:
            br = block.branches[name]
            if isinstance(br, OneByOneKxKBranch):
                kind, left, w2, _, _ = br.merge_terms(block.geometry, torch.float64)
                assert kind == "gemm"  # a trained residual: the product is computed
                g, cg1, dg = left.shape
                o, _, kh, kw = w2.shape
                expected.append((g, cg1, (o // g) * kh * kw))
    got = [tuple(torch.bmm(left, right).shape) for left, right in products.operands]
    assert got == expected and len(got) >= 3
    assert all(left.dtype == right.dtype == torch.float64 for left, right in products.operands)
    products()


def test_perturbation_leaves_no_initial_value_behind() -> None:
    """What the benchmark times: no zero residual (the merge's shortcut), no zero-γ BN."""
    expanded = perturb_(reparam.expand(_net()), torch.Generator().manual_seed(1))
    residuals = [m.weight for m in expanded.modules() if isinstance(m, reparam.IdentityBasedConv1x1)]
    assert residuals and all(bool(r.ne(0).all()) for r in residuals)
    bns = [m for m in expanded.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(bool(bn.weight.ne(0).all()) and bool(bn.running_var.ne(1).all()) for bn in bns)



def test_interleaved_timing_rotates_the_order() -> None:
    """Every function takes every place in the round-robin: none always runs second."""
    from fedhetero.lab.bench_reparam import _interleaved

    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in ("a", "b", "c")}
    log: dict[str, list[float]] = {}
    best = _interleaved(fns, warmup=0, repeats=3, log=log, tag="t")
    assert set(best) == {"a", "b", "c"} and len(log["t.a"]) == 3
    rounds = [calls[i:i + 3] for i in range(0, 9, 3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def test_busy_machine_signs_from_the_samples() -> None:
    """The samples of an idle run (spreads of 0.6–2.4 %) raise no sign; those of a run during a
    burst of other work (the plain model 121–162 ms in the tuned pass against 56–60 before) raise
    both: the spread and the move between passes."""
    idle = {"plain": [58.7, 56.0, 55.8, 55.6, 56.2, 55.7, 56.2], "expanded": [174.8, 193.1, 170.3, 168.5, 166.8, 228.0, 166.3]}
    idle_found = {"plain": [58.1, 57.2, 55.3, 59.8, 63.6, 57.6, 55.1], "expanded": [173.6, 179.8, 217.1, 177.3, 176.2, 175.5, 166.3]}
    assert bench.busy_signs(idle, idle_found) == []
    assert bench.busy_signs(idle, None) == []
    burst = {"plain": [146.3, 120.8, 162.5], "expanded": [260.4, 207.0, 261.0]}
    found = {"plain": [183.9, 60.0, 58.7], "expanded": [281.4, 191.1, 196.9]}
    signs = bench.busy_signs(burst, found)
    assert len(signs) == 3
    assert any("plain training steps" in s for s in signs) and any("expanded training steps" in s for s in signs)
    assert any("between the two allocator passes" in s for s in signs)
    assert bench.busy_signs({"plain": [10.0], "expanded": [30.0]}, None) == []  # one repeat: no spread to judge


def test_busy_run_is_not_judged_against_the_target() -> None:
    """A result with busy signs prints "unsure" in the overhead row's met column and says why."""
    import io

    from rich.console import Console

    net = _net()
    res = bench.run_benchmark(batch=2, repeats=1, warmup=0, merge_repeats=1, train_repeats=2, model=net,
                              input_size=8, threads=None)
    assert isinstance(res["busy"], list)
    res["busy"] = ["plain training steps: median 21% above the best (idle: under 15%)"]
    out = io.StringIO()
    bench.print_table(res, console=Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    row = next(line for line in text.splitlines() if "overhead per MAC (time ratio" in line)
    assert "unsure" in row and " yes " not in row and " no " not in row
    assert "the machine looked busy" in text and "median 21% above the best" in text
