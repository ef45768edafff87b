"""Property tests: the invariants of :mod:`reparam.invariants` hold after every step of random
sequences of structural operations, chained as DynamicFL chains them.

Random small float64 CNNs (LeNet-5's layout: 2–3 convs, some followed by a BN and some not, with
or without bias, kernels 1/3/5 and rectangular ones, stride, padding, dense / grouped / depthwise
convs, optional max-pooling and BN-only identity branches) are expanded with a first-round plan
(:func:`reparam.planning.first_plan`, optionally followed by a nested fill) and then go through a
random sequence of operations:

* growth: ``add_branch`` (zero-γ or random-resolve), ``grow_nested``, ``add_nested_branch``,
  ``fill_to_budget`` and ``grow_to_budget`` (flat and ``grow_mode="nested"``);
* folds: ``remove_branch``, ``fold_all``, ``flatten_nested``, ``shrink_to_budget`` to a lower budget;
* DYMM with random saliency dicts (then a fill, as DynamicFL does);
* a budget change mid-sequence (shrink or grow, as DynamicFL's ``_adapt_budget``);
* save / restore through ``reparam.structure`` + ``reparam.build`` + ``load_state_dict`` (a new
  round: a new optimizer);
* REP from a random plain global model (``reparam.rep_to_local``; deploy or host form).

One SGD optimizer with momentum (one or two parameter groups) is built after the first plan and
only updated with ``apply_to_optimizer(opt, change)`` after each structural operation. After every
step the test checks: the structural operation kept the eval-mode function (eval-exact) and its
``StructureChange`` records it (every parameter whose value changed is listed as overwritten or
added, added ones are in the model, removed ones are not); invariant 1 (``check_optimizer``);
invariant 4 (the deploy merge of a copy equals the model; so does the tensor-only
``merge_state_dict`` upload, and for host-layout runs the ``target="host"`` merge loaded strictly
into a fresh host model); invariant 2 via one training step (every trainable parameter gets a
gradient; after ``opt.step`` momentum state is held only for parameters the optimizer holds, with
their shapes); and after each REP invariant 3 (the client model equals the global model, and
keeps its structure) and, for ``anchor_stats="rescale"``, invariant 5 (no anchor conv filter
grew). Blocks get ``max_depth`` 1, 2 or 3 (no nesting, one level, two levels).
Training steps, ``perturb_`` and ``randomize_bn_`` keep the function checks from being vacuous
(zero-γ branches become non-zero, BN statistics are random).

Runs are deterministic (``derandomize=True``) and short, without shrinking (a failure prints every
drawn operation). ``REPARAM_PROPERTY_SOAK=N`` runs N random examples per test instead.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import reparam
from reparam.kinds import applicability
from reparam.changes import StructureChange, apply_to_optimizer
from reparam.dymm import dymm, shrink_to_budget
from reparam.flops import model_macs
from reparam.geometry import ConvGeometry
from reparam.invariants import (
    anchor_filter_norms,
    check_anchor_scale,
    check_gradients,
    check_optimizer,
    check_same_function,
    function_error,
)
from reparam.kinds import get_kind, kind_names
from reparam.planning import fill_to_budget, first_plan, grow_to_budget
from reparam.testing import perturb_, randomize_bn_

from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

F64 = torch.float64
BATCH = 4
N_OUT = 3
#: eval-exact operations on float64 models: rounding only (see reparam.testing.default_rtol)
TOL = 1e-10

#: ``REPARAM_PROPERTY_SOAK=N``: a soak run of N random (not derandomized) examples per test
_SOAK = int(os.environ.get("REPARAM_PROPERTY_SOAK", "0") or 0)


def _settings(examples: int) -> settings:
    return settings(
        max_examples=_SOAK or examples,
        deadline=None,
        derandomize=not _SOAK,  # CI: the same examples every run
        database=None,
        print_blob=False,
        # no shrinking: a failing example is reported at once, in full (every drawn operation is
        # noted); shrinking these stateful sequences runs into Hypothesis' five-minute limit
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Layer:
    in_c: int
    out_c: int
    kernel: tuple[int, int]
    stride: int
    padding: tuple[int, int]
    groups: int
    bias: bool
    bn: bool
    residual: bool  # ``+ bn_id(x)``: a BN-only identity branch beside the conv (RepVGG)
    pool: bool  # 2×2 max-pooling after the activation

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # compact falsifying examples
        flags = [f for f in ("bias", "bn", "residual", "pool") if getattr(self, f)]
        p.text(f"Layer({self.in_c}->{self.out_c}, k={self.kernel}, s={self.stride}, p={self.padding}, "
               f"g={self.groups}{''.join(', ' + f for f in flags)})")


@dataclass(frozen=True)
class Arch:
    in_c: int
    hw: tuple[int, int]
    layers: tuple[Layer, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.in_c, *self.hw)


class Net(nn.Module):
    """``conv_i → [bn_i] → [+ id_i(x)] → relu → [maxpool]`` for every layer, then a linear head."""

    def __init__(self, arch: Arch) -> None:
        super().__init__()
        self.arch = arch
        h, w = arch.hw
        c = arch.in_c
        for i, L in enumerate(arch.layers):
            setattr(self, f"conv{i}", nn.Conv2d(L.in_c, L.out_c, L.kernel, stride=L.stride, padding=L.padding,
                                                groups=L.groups, bias=L.bias))
            if L.bn:
                setattr(self, f"bn{i}", nn.BatchNorm2d(L.out_c))
            if L.residual:
                setattr(self, f"id{i}", nn.BatchNorm2d(L.out_c))
            h = (h + 2 * L.padding[0] - L.kernel[0]) // L.stride + 1
            w = (w + 2 * L.padding[1] - L.kernel[1]) // L.stride + 1
            if L.pool:
                h, w = h // 2, w // 2
            c = L.out_c
        self.fc = nn.Linear(c * h * w, N_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, L in enumerate(self.arch.layers):
            y = getattr(self, f"conv{i}")(x)
            if L.bn:
                y = getattr(self, f"bn{i}")(y)
            if L.residual:
                y = y + getattr(self, f"id{i}")(x)
            x = torch.relu(y)
            if L.pool:
                x = nn.functional.max_pool2d(x, 2)
        return self.fc(x.flatten(1))


def _out(n: int, k: int, s: int, p: int) -> int:
    return (n + 2 * p - k) // s + 1


@st.composite
def architectures(draw: Any) -> Arch:
    c = draw(st.integers(1, 3))
    h, w = draw(st.integers(5, 9)), draw(st.integers(5, 9))
    hw = (h, w)
    layers = []
    for _ in range(draw(st.integers(2, 3))):
        kernel = draw(st.sampled_from([(3, 3), (3, 3), (5, 5), (1, 1), (1, 3), (3, 1), (5, 3)]))
        padding = (draw(st.integers(0, kernel[0] // 2)), draw(st.integers(0, kernel[1] // 2)))
        stride = draw(st.sampled_from([1, 1, 2]))
        oh, ow = _out(h, kernel[0], stride, padding[0]), _out(w, kernel[1], stride, padding[1])
        if oh < 1 or ow < 1:  # too small: keep the size (odd kernels) instead
            stride, padding = 1, (kernel[0] // 2, kernel[1] // 2)
            oh, ow = _out(h, kernel[0], 1, padding[0]), _out(w, kernel[1], 1, padding[1])
        grouping = draw(st.sampled_from(["dense", "dense", "grouped", "depthwise"]))
        divisors = [g for g in range(2, c + 1) if c % g == 0]
        if grouping == "depthwise" and c > 1:
            groups, out_c = c, c * draw(st.sampled_from([1, 1, 2]))
        elif grouping == "grouped" and divisors:
            groups = draw(st.sampled_from(divisors))
            out_c = groups * draw(st.integers(1, 2))
        else:
            groups, out_c = 1, draw(st.integers(1, 5))
        bn = draw(st.booleans())
        bias = draw(st.booleans())
        keeps = stride == 1 and out_c == c and all(k % 2 == 1 and p == k // 2 for k, p in zip(kernel, padding))
        residual = keeps and draw(st.booleans())
        pool = oh >= 4 and ow >= 4 and draw(st.booleans())
        layers.append(Layer(c, out_c, kernel, stride, padding, groups, bias, bn, residual, pool))
        c, h, w = out_c, oh, ow
        if pool:
            h, w = h // 2, w // 2
    return Arch(layers[0].in_c, hw, tuple(layers))


def make_host(arch: Arch, seed: int) -> Net:
    """A host model with random weights and BN statistics (float64, eval mode)."""
    torch.manual_seed(seed)
    model = Net(arch).double()
    perturb_(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def make_global(arch: Arch, form: str, seed: int) -> nn.Module:
    """A random global model: the host layout, or its deploy form (every conv biased, no BN)."""
    host = make_host(arch, seed)
    return host if form == "host" else reparam.merge(host, target="deploy")


# ------------------------------------------------------------------------------------- runs


NON_ANCHOR = tuple(k for k in kind_names() if not get_kind(k).anchor)


class Run:
    """One client model under a random operation sequence, with its optimizer and checks."""

    def __init__(self, arch: Arch, base_form: str, seed: int) -> None:
        self.arch = arch
        self.shape = arch.shape
        self.form = base_form  # the layout of the plain model the client expands (and of REP targets)
        self.base = make_global(arch, base_form, seed)
        self.gen = torch.Generator().manual_seed(seed + 2)
        self.x = torch.randn(BATCH, *self.shape, generator=self.gen, dtype=F64)
        self.w_loss = torch.randn(BATCH, N_OUT, generator=self.gen, dtype=F64)
        self.base_macs = model_macs(self.base, self.shape)
        self.steps = 0
        self.model: nn.Module = self.base
        self.opt: torch.optim.Optimizer | None = None
        self.budget = float(self.base_macs)
        self.macs_before = self.base_macs
        self.kinds: tuple[str, ...] | None = None
        # a conv without bias and BN gets a bias when expanded: the host layout then differs
        self.host_loadable = all(L.bias or L.bn for L in arch.layers)

    # -- checks
    def make_optimizer(self, two_groups: bool) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if two_groups:
            groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": 1e-4},
                      {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 0.02}]
            self.opt = torch.optim.SGD([g for g in groups if g["params"]], lr=0.05, momentum=0.9)
        else:
            self.opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)

    def eval_out(self, model: nn.Module | None = None) -> torch.Tensor:
        m = copy.deepcopy(self.model if model is None else model).eval()
        with torch.no_grad():
            return m(self.x)

    def check_step(self, what: str, before: torch.Tensor | None) -> None:
        """Invariants after a structural step ``what``; ``before``: the eval output before it
        (``None`` when the step is not meant to keep the function, i.e. REP)."""
        assert self.opt is not None
        self.steps += 1
        where = f"step {self.steps} ({what})"
        if before is not None:  # structural operations are eval-exact
            err = reparam.testing.rel_err(self.eval_out(), before)
            assert err <= TOL, f"{where}: the operation changed the eval-mode function (rel_err {err:.3g})"
        check_optimizer(self.model, self.opt, where=where)  # invariant 1
        merged = reparam.merge(copy.deepcopy(self.model).eval(), target="deploy")
        check_same_function(merged, self.model, self.x, dtype=F64, where=f"at upload, {where}")  # invariant 4
        assert not any(isinstance(m, reparam.DiverseBranchBlock) for m in merged.modules())
        # the same upload from tensors alone: structure spec + state dict
        spec = reparam.structure(self.model)
        deploy = reparam.build(copy.deepcopy(self.base), spec, form="deploy")
        deploy.load_state_dict(reparam.merge_state_dict(self.model.state_dict(), spec), strict=True)
        check_same_function(deploy, self.model, self.x, dtype=F64, where=f"merge_state_dict, {where}")
        if self.form == "host" and self.host_loadable:  # host layout: strict load into a fresh host model
            host = reparam.merge(copy.deepcopy(self.model).eval(), target="host")
            fresh = Net(self.arch).double()
            fresh.load_state_dict(host.state_dict(), strict=True)
            check_same_function(fresh, self.model, self.x, dtype=F64, where=f"host merge, {where}")
        self.train_step(where)

    def train_step(self, where: str) -> None:
        """Invariant 2: one SGD step; every trainable parameter gets a gradient, and momentum state
        belongs to held parameters only."""
        assert self.opt is not None
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        out = self.model(self.x)
        assert torch.isfinite(out).all(), f"{where}: non-finite train-mode output"
        loss = (torch.tanh(out) * self.w_loss).mean()  # bounded: a few steps never diverge
        loss.backward()
        check_gradients(self.model, where=where)
        self.opt.step()
        held = {id(p): p for g in self.opt.param_groups for p in g["params"]}
        for p, state in self.opt.state.items():
            assert id(p) in held, f"{where}: momentum state for a parameter the optimizer does not hold"
            buf = state.get("momentum_buffer")
            assert buf is None or buf.shape == p.shape, f"{where}: momentum buffer of the wrong shape"
        assert all(p in self.opt.state for p in held.values()), f"{where}: a held parameter was not stepped"
        check_optimizer(self.model, self.opt, where=f"{where}, after opt.step")
        self.model.eval()

    def snapshot(self) -> dict[int, tuple[str, torch.Tensor]]:
        return {id(p): (n, p.detach().clone()) for n, p in self.model.named_parameters()}

    def apply(self, change: StructureChange, snap: dict[int, tuple[str, torch.Tensor]], what: str) -> None:
        """Check that ``change`` records what the operation did (taking ``snap`` before it), then
        bring the optimizer up to date with it."""
        assert self.opt is not None
        assert isinstance(change, StructureChange)
        now = {id(p): p for p in self.model.parameters()}
        listed = {id(p) for p in change.overwritten} | {id(p) for p, _ in change.added}
        for i, (name, old) in snap.items():
            if i in now and i not in listed:
                assert torch.equal(now[i].detach(), old), f"{what}: {name} changed but is not listed as overwritten"
        assert all(id(p) in now for p, _ in change.added), f"{what}: an added parameter is not in the model"
        assert not any(id(p) in now for p in change.removed), f"{what}: a removed parameter is still in the model"
        apply_to_optimizer(self.opt, change)

    # -- model facts
    def blocks(self) -> list[tuple[str, reparam.DiverseBranchBlock]]:
        return [(p, b) for p, b in reparam.iter_blocks(self.model, nested=True) if not b.is_merged]

    def macs(self) -> int:
        return model_macs(self.model, self.shape)

    def scores(self, draw: Any, label: str) -> dict[tuple[str, str], float]:
        """A random saliency dict over the present branches (some left out, ties and signs)."""
        keys = [(p, n) for p, b in reparam.iter_blocks(self.model, nested=True) for n in b.branch_names]
        if not keys:
            return {}
        vals = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0, 3.0, 10.0, None]),
                             min_size=len(keys), max_size=len(keys)), label=label)
        return {k: v for k, v in zip(keys, vals) if v is not None}


def nested_geometry(block: reparam.DiverseBranchBlock, name: str) -> ConvGeometry:
    inner = block.nested_block(name)
    if inner is not None:
        return inner.geometry
    attr = get_kind(name).nested_conv
    assert attr is not None
    return ConvGeometry.from_conv(getattr(block.branches[name], attr))


def nested_kinds(block: reparam.DiverseBranchBlock, name: str) -> list[str]:
    """Kinds applicable inside branch ``name``'s K×K conv (its nested input-window policy)."""
    reasons = applicability(nested_geometry(block, name), crop=block.nested_crop(name))
    return [k for k in NON_ANCHOR if reasons[k] is None]


# ------------------------------------------------------------------------------------- operations


def op_add_branch(run: Run, draw: Any) -> StructureChange | None:
    blocks = dict(run.blocks())
    cands = [(p, k) for p, b in blocks.items() for k in b.applicable() if k not in b.branch_names]
    if not cands:
        return None
    path, kind = draw(st.sampled_from(cands), label="block, kind")
    block = blocks[path]
    init = draw(st.sampled_from(["zero_gamma", "random_resolve"]), label="init")
    note(f"add_branch {path} {kind} init={init}")
    return block.add_branch(kind, init=init, generator=run.gen)


def op_grow_nested(run: Run, draw: Any) -> StructureChange | None:
    blocks = dict(run.blocks())
    cands = [(p, n) for p, b in blocks.items() for n in b.nestable()]
    if not cands:
        return None
    path, name = draw(st.sampled_from(cands), label="block, branch")
    block = blocks[path]
    fits = nested_kinds(block, name)
    branches: Any = draw(st.one_of(st.just([]), st.just(None), st.lists(st.sampled_from(fits), unique=True)
                                   if fits else st.just([])), label="nested branches")
    note(f"grow_nested {path} {name} branches={branches}")
    return block.grow_nested(name, branches, generator=run.gen)


def op_add_nested_branch(run: Run, draw: Any) -> StructureChange | None:
    blocks = dict(run.blocks())
    cands = []
    for p, b in blocks.items():
        for n in b.branch_names:
            inner = b.nested_block(n)
            if inner is None and n not in b.nestable():
                continue
            present = set(inner.branch_names) if inner is not None else set()
            cands += [(p, n, k) for k in nested_kinds(b, n) if k not in present]
    if not cands:
        return None
    path, name, kind = draw(st.sampled_from(cands), label="block, branch, kind")
    block = blocks[path]
    init = draw(st.sampled_from(["zero_gamma", "random_resolve"]), label="init")
    note(f"add_nested_branch {path} {name} {kind} init={init}")
    return block.add_nested_branch(name, kind, init=init, generator=run.gen)


def op_fold(run: Run, draw: Any) -> StructureChange | None:
    blocks = dict(run.blocks())
    cands: list[tuple[str, str, str]] = []
    for p, b in blocks.items():
        cands += [("remove_branch", p, n) for n in b.branch_names if n != "kxk"]
        if len(b.branch_names) > 1:
            cands.append(("fold_all", p, ""))
        cands += [("flatten_nested", p, n) for n in b.branch_names if b.nested_block(n) is not None]
    if not cands:
        return None
    what, path, name = draw(st.sampled_from(cands), label="fold")
    block = blocks[path]
    note(f"{what} {path} {name}")
    if what == "remove_branch":
        return block.remove_branch(name)
    if what == "fold_all":
        return block.fold_all()
    return block.flatten_nested(name)


def _anchors_only_macs(run: Run) -> int:
    return model_macs(reparam.merge(copy.deepcopy(run.model).eval(), target="deploy"), run.shape)


def op_shrink(run: Run, draw: Any) -> StructureChange | None:
    current, floor = run.macs(), _anchors_only_macs(run)
    if current <= floor:
        return None
    frac = draw(st.sampled_from([0.0, 0.3, 0.6, 0.9]), label="shrink to")
    run.budget = float(floor + frac * (current - floor))
    s_local = run.scores(draw, "S_l")
    note(f"shrink_to_budget {run.budget:.0f} (from {current}, anchors only {floor}) S_l={s_local}")
    report = shrink_to_budget(run.model, s_local, run.budget, run.shape)
    assert report.fits and report.macs_after == run.macs() <= run.budget
    return report.change


def _grow_options(run: Run, draw: Any) -> dict[str, Any]:
    return {
        "grow_mode": draw(st.sampled_from(["block", "nested"]), label="grow_mode"),
        "init": draw(st.sampled_from(["zero_gamma", "random_resolve"]), label="init"),
    }


def op_grow_budget(run: Run, draw: Any) -> StructureChange | None:
    ratio = draw(st.sampled_from([1.2, 1.6, 2.5, 4.0]), label="grow budget by")
    before = run.macs()
    run.budget = max(run.budget, float(before)) * ratio
    opts = _grow_options(run, draw)
    scores = run.scores(draw, "scores")
    note(f"grow_to_budget {run.budget:.0f} (from {before}) {opts} scores={scores}")
    change = grow_to_budget(run.model, scores, run.budget, run.shape, kinds=run.kinds, **opts)
    assert run.macs() <= run.budget
    return change


def op_fill(run: Run, draw: Any) -> StructureChange | None:
    opts = _grow_options(run, draw)
    note(f"fill_to_budget {run.budget:.0f} {opts}")
    change = fill_to_budget(run.model, run.budget, run.shape, kinds=run.kinds, **opts)
    assert run.macs() <= max(run.budget, run.macs_before)
    return change


def op_dymm(run: Run, draw: Any) -> StructureChange | None:
    s_local, s_global = run.scores(draw, "S_l"), run.scores(draw, "S_g")
    opts = _grow_options(run, draw)
    cap = draw(st.sampled_from([None, None, 1]), label="max_new_per_round")
    regrow = draw(st.booleans(), label="regrow_folded")
    fill = draw(st.booleans(), label="fill after dymm")
    note(f"dymm budget={run.budget:.0f} {opts} cap={cap} regrow={regrow} fill={fill} S_l={s_local} S_g={s_global}")
    report = dymm(run.model, s_local, s_global, run.budget, run.shape, max_new_per_round=cap, pool=run.kinds,
                  regrow_folded=regrow, **opts)
    change = report.change
    assert report.macs_after == run.macs()
    if report.fits:
        assert report.macs_after <= run.budget
    if fill:
        change = change.extend(fill_to_budget(run.model, run.budget, run.shape, current_macs=report.macs_after,
                                              kinds=run.kinds, **opts))
    return change


def op_budget_change(run: Run, draw: Any) -> StructureChange | None:
    """DynamicFL's mid-round budget change: shrink when the model exceeds the new budget, else grow."""
    floor = _anchors_only_macs(run)
    current = run.macs()
    ratio = draw(st.sampled_from([0.5, 0.8, 1.0, 1.3, 2.0]), label="new budget / current")
    run.budget = max(float(floor), ratio * current)
    scores = run.scores(draw, "scores")
    note(f"budget change to {run.budget:.0f} (model {current}, anchors only {floor})")
    if current > run.budget:
        report = shrink_to_budget(run.model, scores, run.budget, run.shape)
        assert report.fits
        return report.change
    opts = _grow_options(run, draw)
    return grow_to_budget(run.model, scores, run.budget, run.shape, kinds=run.kinds, **opts)


OPS = {
    "add_branch": op_add_branch,
    "grow_nested": op_grow_nested,
    "add_nested_branch": op_add_nested_branch,
    "fold": op_fold,
    "shrink": op_shrink,
    "grow_budget": op_grow_budget,
    "fill": op_fill,
    "dymm": op_dymm,
    "budget_change": op_budget_change,
}


def do_restore(run: Run, draw: Any) -> None:
    """Save / restore through the structure spec (a new round: a new optimizer)."""
    spec = reparam.structure(run.model)
    state = {k: v.clone() for k, v in run.model.state_dict().items()}
    before = run.eval_out()
    note("restore through reparam.structure + reparam.build")
    model = reparam.build(copy.deepcopy(run.base), spec)
    model.load_state_dict(state, strict=True)
    run.model = model.eval()
    assert torch.equal(run.eval_out(), before)
    assert reparam.structure(run.model) == spec
    run.make_optimizer(draw(st.booleans(), label="two groups"))
    run.check_step("restore", before)


def do_rep(run: Run, draw: Any) -> None:
    """REP(global, local) from a random plain global model; invariant 3."""
    seed = draw(st.integers(0, 2**16), label="global seed")
    form = "deploy" if run.form == "deploy" else draw(st.sampled_from(["host", "deploy"]), label="global form")
    stats = draw(st.sampled_from(["keep", "rescale", "identity", "adopt"]), label="anchor_stats")
    g = make_global(run.arch, form, seed)
    note(f"rep_to_local global form={form} seed={seed} anchor_stats={stats}")
    run.model.eval()
    assert function_error(run.model, g, run.x) > 1e-6  # the check below is not vacuous
    spec = reparam.structure(run.model)
    snap = run.snapshot()
    norms = anchor_filter_norms(run.model)
    change = reparam.rep_to_local(g, run.model, anchor_stats=stats)
    assert not change.added and not change.removed
    assert reparam.structure(run.model) == spec  # REP keeps the local structure
    if stats == "rescale":  # invariant 5: no anchor filter grows, so REP cannot compound their scale
        assert set(anchor_filter_norms(run.model)) == set(norms)
        check_anchor_scale(norms, run.model, rtol=1e-9, where=f"by REP (step {run.steps + 1})")
        if draw(st.booleans(), label="calibrate"):
            change.extend(calibrate_from_global(run, g, norms))
    run.apply(change, snap, "rep")
    check_same_function(run.model, g, run.x, dtype=F64, where=f"after REP (step {run.steps + 1})")  # invariant 3
    run.check_step("rep", None)


def calibrate_from_global(run: Run, g: nn.Module, norms: dict[str, torch.Tensor]) -> StructureChange:
    """DynamicFL's calibrated REP: the anchors' statistics measured on the client's batches, the
    blocks' inputs taken from the global model's forward (the same function). It gives the model
    the client model's own forward gives, to rounding, and grows no anchor filter."""
    note("calibrate_anchors, the inputs from the global model")
    batches = [run.x[: BATCH // 2], run.x[BATCH // 2:]]
    alone = copy.deepcopy(run.model)
    reparam.calibrate_anchors(alone, batches)
    change = reparam.calibrate_anchors(run.model, batches, source=g)
    for k, v in alone.state_dict().items():
        w = run.model.state_dict()[k]
        if v.is_floating_point():
            assert torch.allclose(w, v, rtol=1e-7, atol=1e-9 * (1.0 + float(v.abs().max()))), k
        else:
            assert torch.equal(w, v), k
    check_anchor_scale(norms, run.model, rtol=1e-9, where=f"by calibration (step {run.steps + 1})")
    return change


def first_round(run: Run, draw: Any) -> None:
    """DynamicFL's first round: first plan (+ nested fill), then the optimizer."""
    ratio = draw(st.sampled_from([1.0, 1.5, 2.0, 3.0, 4.0]), label="budget ratio")
    run.budget = ratio * run.base_macs
    run.kinds = draw(st.one_of(st.none(), st.lists(st.sampled_from(NON_ANCHOR), min_size=1, unique=True)
                               .map(tuple)), label="branch kinds")
    fill = draw(st.booleans(), label="plan fill")
    anchor_norm = draw(st.sampled_from(["batchnorm", "frozen_identity", "calibrated"]), label="anchor_norm")
    init = draw(st.sampled_from(["zero_gamma", "zero_gamma", "random_resolve"]), label="expand init")
    plan = first_plan(run.base, run.budget, run.shape, fill=fill, kinds=run.kinds)
    note(f"first plan: budget {run.budget:.0f} ({ratio}x) kinds={run.kinds} anchor_norm={anchor_norm} init={init} "
         f"plan={plan}")
    y = run.eval_out(run.base)
    run.model = reparam.expand(run.base, plan=plan, anchor_norm=anchor_norm, calibration_input=run.x, init=init,
                               allow_new_bias=True).eval()
    y_expanded = run.eval_out()
    assert reparam.testing.rel_err(y_expanded, y) <= TOL  # bit-exact, or eval-exact (calibrated, random_resolve)
    run.macs_before = run.macs()
    max_depth = draw(st.sampled_from([2, 2, 1, 3]), label="max_depth")  # 1: no nesting; 3: two levels
    for _, block in reparam.iter_blocks(run.model):
        block.max_depth = max_depth
    if draw(st.booleans(), label="nested fill"):
        note("nested fill_to_budget")
        fill_to_budget(run.model, run.budget, run.shape, grow_mode="nested", kinds=run.kinds)
        assert torch.equal(run.eval_out(), y_expanded)  # zero-γ growth: bit-exact
    if run.macs_before <= run.budget:
        assert run.macs() <= run.budget
    run.macs_before = run.macs()
    # trained a while: every branch non-zero, random statistics
    perturb_(run.model, run.gen)
    run.make_optimizer(draw(st.booleans(), label="two groups"))
    run.check_step("first plan", None)


# ------------------------------------------------------------------------------------- the tests


@_settings(40)
@given(arch=architectures(), base_form=st.sampled_from(["deploy", "deploy", "host"]), seed=st.integers(0, 2**16),
       data=st.data())
def test_invariants_hold_along_random_operation_sequences(arch: Arch, base_form: str, seed: int, data: Any) -> None:
    run = Run(arch, base_form, seed)
    draw = data.draw
    first_round(run, draw)
    n_steps = draw(st.integers(3, 7), label="steps")
    names = list(OPS) + ["restore", "rep", "perturb"]
    for _ in range(n_steps):
        what = draw(st.sampled_from(names), label="op")
        run.macs_before = run.macs()
        if what == "restore":
            do_restore(run, draw)
            continue
        if what == "rep":
            do_rep(run, draw)
            continue
        if what == "perturb":  # "trained a while" without the optimizer: statistics (and weights) move
            how = draw(st.sampled_from([perturb_, randomize_bn_]), label="perturbation")
            note(how.__name__)
            how(run.model, run.gen)
            run.check_step("perturb", run.eval_out())
            continue
        run.model.eval()
        before = run.eval_out()
        snap = run.snapshot()
        change = OPS[what](run, draw)
        if change is None:
            note(f"{what}: nothing to do")
            event(f"{what}: nothing to do")
            continue
        event(what if change.added or change.removed else f"{what}: no parameter added or removed")
        run.apply(change, snap, what)
        run.check_step(what, before)


@_settings(12)
@given(arch=architectures(), seed=st.integers(0, 2**16), data=st.data())
def test_calibrated_rep_takes_the_blocks_inputs_from_the_global_model(arch: Arch, seed: int, data: Any) -> None:
    """REP with ``rescale`` then :func:`reparam.calibrate_anchors` with the global model as the
    source of the blocks' inputs (DynamicFL's default REP): eval-exact, the invariants hold, and
    the model equals the one calibrated from its own forward."""
    run = Run(arch, "deploy", seed)
    draw = data.draw
    first_round(run, draw)
    g = make_global(run.arch, "deploy", draw(st.integers(0, 2**16), label="global seed"))
    run.model.eval()
    snap = run.snapshot()
    norms = anchor_filter_norms(run.model)
    change = reparam.rep_to_local(g, run.model, anchor_stats="rescale")
    change.extend(calibrate_from_global(run, g, norms))
    run.apply(change, snap, "rep")
    check_same_function(run.model, g, run.x, dtype=F64, where="after calibrated REP")
    run.check_step("rep", None)


@_settings(15)
@given(arch=architectures(), seed=st.integers(0, 2**16), data=st.data())
def test_nested_growth_chains_reach_the_optimizer(arch: Arch, seed: int, data: Any) -> None:
    """Nested growth in every nestable conv (bias-free ones included), then a branch beside it, one
    or two levels deep (``max_depth=3``), in one change and in separate ones; then the nested
    blocks are flattened back: every new parameter reaches the optimizer and trains, every removed
    one leaves it."""
    draw = data.draw
    run = Run(arch, draw(st.sampled_from(["deploy", "host"]), label="base form"), seed)
    plan = {p: ("kxk",) + tuple(k for k in NON_ANCHOR if k in fits) for p, fits in
            ((p, reparam.dymm.applicable_kinds(c)) for p, c in reparam.planning.expandable_convs(run.base))}
    anchor_norm = draw(st.sampled_from(["batchnorm", "frozen_identity"]), label="anchor_norm")
    run.model = reparam.expand(run.base, plan=plan, anchor_norm=anchor_norm, allow_new_bias=True).eval()
    max_depth = draw(st.sampled_from([2, 3]), label="max_depth")
    for _, block in reparam.iter_blocks(run.model):
        block.max_depth = max_depth
    perturb_(run.model, run.gen)
    run.make_optimizer(draw(st.booleans(), label="two groups"))
    run.check_step("expand", None)
    combined = draw(st.booleans(), label="one change")
    pending = StructureChange()
    start = run.eval_out()
    start_snap = run.snapshot()
    for _level in range(max_depth - 1):  # the second pass nests inside the blocks the first made
        for path, block in list(reparam.iter_blocks(run.model, nested=True)):
            for name in block.nestable():
                fits = nested_kinds(block, name)
                if not fits:
                    continue
                kind = draw(st.sampled_from(fits), label=f"{path} {name}")
                steps = ["add_nested_branch"]
                if draw(st.booleans(), label="wrap first"):  # grow_nested alone, then a branch beside the anchor
                    steps = ["grow_nested", "add_branch"]
                for what in steps:
                    before = run.eval_out()
                    snap = run.snapshot()
                    note(f"{what} {path} {name} {kind}")
                    if what == "add_nested_branch":
                        change = block.add_nested_branch(name, kind, generator=run.gen)
                    elif what == "grow_nested":
                        change = block.grow_nested(name, [], generator=run.gen)
                    else:
                        inner = block.nested_block(name)
                        assert inner is not None
                        change = inner.add_branch(kind, generator=run.gen)
                    if combined:
                        pending.extend(change)
                    else:
                        run.apply(change, snap, what)
                        run.check_step(what, before)
    if combined and not pending.is_empty():
        run.apply(pending, start_snap, "nested growth, one change")
        run.check_step("nested growth, one change", start)
    # flatten back, outermost level first (a nested block's own nested blocks go with it)
    for path, block in list(reparam.iter_blocks(run.model)):
        for name in block.branch_names:
            if block.nested_block(name) is None or not draw(st.booleans(), label=f"flatten {path} {name}"):
                continue
            before = run.eval_out()
            snap = run.snapshot()
            note(f"flatten_nested {path} {name}")
            change = block.flatten_nested(name)
            run.apply(change, snap, "flatten_nested")
            run.check_step("flatten_nested", before)


# ------------------------------------------------------------------------------------- regressions


@pytest.mark.parametrize("name", ["kxk", "1x1_kxk"])
def test_flatten_nested_of_a_nested_block_whose_anchor_is_nested_too(name: str) -> None:
    """Regression: flattening a nested block whose own anchor conv is nested (``max_depth=3``)
    builds a new conv; its parameters were reported as overwritten instead of added, so they never
    reached the optimizer (invariant 1: missing) and never trained."""
    torch.manual_seed(0)
    block = reparam.DiverseBranchBlock.from_conv(nn.Conv2d(2, 2, 3, padding=1).double(), None, ["1x1", "1x1_kxk"],
                                                 max_depth=3)
    opt = torch.optim.SGD(block.parameters(), lr=0.05, momentum=0.9)
    apply_to_optimizer(opt, block.grow_nested(name, ["1x1_avg"]))
    inner = block.nested_block(name)
    assert inner is not None and inner.nestable() == ["kxk"]
    apply_to_optimizer(opt, inner.grow_nested("kxk", ["1x1_avg"]))
    check_optimizer(block, opt)
    perturb_(block, torch.Generator().manual_seed(1))
    x = torch.randn(2, 2, 5, 5, dtype=F64)
    block.eval()
    with torch.no_grad():
        y = block(x)
    change = block.flatten_nested(name)
    with torch.no_grad():
        assert reparam.testing.rel_err(block(x), y) <= TOL
    host = getattr(block.branches[name], get_kind(name).nested_conv or "")
    assert type(host) is nn.Conv2d
    assert {id(p) for p, _ in change.added} == {id(p) for p in host.parameters()}
    assert not change.overwritten
    apply_to_optimizer(opt, change)
    check_optimizer(block, opt)
    block.train()
    (block(x) ** 2).mean().backward()
    check_gradients(block)
    opt.step()
    assert all(p in opt.state for p in host.parameters())  # the new conv trains
    check_optimizer(block, opt)
