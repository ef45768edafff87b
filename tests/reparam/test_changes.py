"""StructureChange records and optimizer surgery: every structural change reports the parameters it
added, removed and overwrote, so optimizer state follows the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reparam.changes import StructureChange, apply_to_optimizer


def _params(n, shape=(3, 2)):
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=g)) for _ in range(n)]


def _loss(params):
    return sum((p**2).sum() for p in params)


def _step(opt, params):
    opt.zero_grad()
    _loss(params).backward()
    opt.step()


def _group_of(opt, p):
    for i, g in enumerate(opt.param_groups):
        if any(q is p for q in g["params"]):
            return i
    return None


def test_empty_and_extend_composition():
    a, b, c, d = _params(4)
    ch = StructureChange()
    assert ch.is_empty()
    assert ch.summary() == {"added": 0, "removed": 0, "overwritten": 0, "paths": []}
    ch.extend(StructureChange(added=[(a, c)], overwritten=[d], paths=["x"]))
    assert not ch.is_empty()
    other = StructureChange(removed=[a, b], overwritten=[c, d], paths=["x", "y"])
    out = ch.extend(other)
    assert out is ch
    # a was added then removed: cancels out entirely
    assert ch.added == []
    assert len(ch.removed) == 1 and ch.removed[0] is b
    assert len(ch.overwritten) == 2 and ch.overwritten[0] is d and ch.overwritten[1] is c
    assert ch.paths == ["x", "y"]
    # removing an overwritten parameter drops it from overwritten
    ch.extend(StructureChange(removed=[d]))
    assert [p is d for p in ch.overwritten] == [False]
    with pytest.raises(TypeError, match="other"):
        ch.extend([a])


def test_only_paths_is_empty():
    assert StructureChange(paths=["a"]).is_empty()


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_remove_add_overwrite(kind):
    p_dec, p_nodec, p_gone, p_over = _params(4)
    twin = nn.Parameter(p_gone.detach().clone())  # equal values, different identity
    groups = [
        {"params": [p_dec, p_gone, p_over, twin], "weight_decay": 1e-2, "lr": 0.1},
        {"params": [p_nodec], "weight_decay": 0.0, "lr": 0.05},
    ]
    if kind == "sgd":
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(groups, lr=0.1, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    all_p = [p_dec, p_nodec, p_gone, p_over, twin]
    _step(opt, all_p)
    sched.step()
    assert all(p in opt.state and len(opt.state[p]) > 0 for p in all_p)

    new_w, new_bn = _params(2)
    change = StructureChange(
        added=[(new_w, p_dec), (new_bn, p_nodec)], removed=[p_gone], overwritten=[p_over], paths=["b"]
    )
    apply_to_optimizer(opt, change)

    assert len(opt.param_groups) == 2
    assert len(sched.base_lrs) == 2
    assert _group_of(opt, p_gone) is None
    assert p_gone not in opt.state
    assert _group_of(opt, twin) == 0 and twin in opt.state  # removal is by identity
    assert _group_of(opt, new_w) == 0 and _group_of(opt, new_bn) == 1
    assert opt.param_groups[0]["params"][-1] is new_w
    assert new_w not in opt.state and new_bn not in opt.state
    assert p_over not in opt.state  # overwritten state dropped
    assert p_dec in opt.state  # untouched state kept
    # inherited hyper-parameters: the group's values apply
    assert opt.param_groups[0]["weight_decay"] == 1e-2
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[1]["lr"] == pytest.approx(0.025)

    # a step works, creates state for the new params and scheduler still schedules both groups
    live = [p_dec, p_nodec, p_over, twin, new_w, new_bn]
    before = new_bn.detach().clone()
    _step(opt, live)
    sched.step()
    assert new_w in opt.state and new_bn in opt.state
    assert not torch.equal(before, new_bn.detach())
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.025, 0.0125])
    if kind == "sgd":
        # first momentum buffer of the new param equals its first gradient (2 * value)
        assert torch.allclose(opt.state[new_bn]["momentum_buffer"], 2 * before)
        # SGD lr 0.025, no decay in group 1: value = before - 0.025 * 2 * before
        assert torch.allclose(new_bn.detach(), before * (1 - 0.05))
    else:
        assert float(opt.state[new_bn]["step"]) == 1.0


def test_keep_overwritten_state_and_idempotent():
    a, b = _params(2)
    opt = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    _step(opt, [a])
    ch = StructureChange(added=[(b, a)], overwritten=[a])
    apply_to_optimizer(opt, ch, reset_overwritten_state=False)
    assert a in opt.state
    apply_to_optimizer(opt, ch, reset_overwritten_state=False)
    assert len(opt.param_groups[0]["params"]) == 2  # not appended twice


def test_reference_removed_in_same_change_still_places_param():
    a, b, c = _params(3)
    opt = torch.optim.SGD([{"params": [c]}, {"params": [a], "lr": 0.3}], lr=0.1)
    apply_to_optimizer(opt, StructureChange(added=[(b, a)], removed=[a]))
    assert _group_of(opt, a) is None and _group_of(opt, b) == 1


def test_missing_reference_modes():
    a, b, frozen = _params(3)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [], "lr": 0.5}], lr=0.1)
    ch = StructureChange(added=[(b, frozen)])
    with pytest.raises(ValueError, match="missing_reference"):
        apply_to_optimizer(opt, ch)
    apply_to_optimizer(opt, ch, missing_reference="skip")
    assert _group_of(opt, b) is None
    apply_to_optimizer(opt, ch, missing_reference="first_group")
    assert _group_of(opt, b) == 0
    with pytest.raises(ValueError, match="missing_reference"):
        apply_to_optimizer(opt, ch, missing_reference="nope")


def test_bad_arguments():
    a, = _params(1)
    opt = torch.optim.SGD([a], lr=0.1)
    with pytest.raises(TypeError, match="optimizer"):
        apply_to_optimizer([a], StructureChange())
    with pytest.raises(TypeError, match="change"):
        apply_to_optimizer(opt, {"added": []})
