"""One model holding ``C`` clients' models side by side along the channel axis.

The clients of a round train small models on small batches; one after another, a step of LeNet-5
on a CPU costs a few milliseconds, most of it per-operator overhead. :func:`stack_model` turns a
model into a *stacked* one that runs ``C`` copies with their own parameters as one network: the
input holds client ``c``'s batch in channels ``[c·Cin, (c+1)·Cin)``, and every layer keeps each
client's channels in its own block:

* a convolution becomes a grouped convolution (``groups × C``), its weight the clients' weights one
  after another;
* a linear layer becomes a batched matrix product over the clients' blocks of features (the
  model's own ``flatten`` keeps a client's features contiguous);
* BatchNorm normalises each client's channels by that client's batch statistics and keeps each
  client's running statistics; with padded rows (a client whose batch is shorter, or that has
  finished its steps) the statistics leave them out (:attr:`StackedBatchNorm2d.mask`);
* GroupNorm over ``g`` groups becomes GroupNorm over ``g·C`` groups (it normalises each sample on
  its own, so padding never enters it);
* dropout draws each client's mask from that client's own generator, shaped like its own
  batch (:class:`StackedDropout`): the masks one client's model would draw from torch's default
  generator seeded alike, bit for bit;
* activations, pooling, flattening and additions act elementwise or per channel, and stay, as do
  forward hooks on a layer (they must act elementwise too: the check below tells);
* the layers of ``reparam``'s Diverse Branch Blocks: an identity-based 1×1 conv (``R + I``) becomes
  a grouped one with each client's identity, a frozen identity norm one over every client's
  channels; the blocks themselves run branch by branch (:func:`stack_model` marks them, so that
  their fused training forwards, which compute BatchNorm statistics themselves over every row,
  padded ones included, stay out of a stacked model);

Each stacked parameter is the clients' parameters stacked and reshaped, so ``p.view(C, *shape)``
is client ``c``'s parameter at row ``c``: the cohort trainer reads and updates the clients through
those views. A model with a layer this module does not know, or whose forward mixes channels in
another way, is refused; :func:`stack_model` also checks the stacked forward against each client's
own model on a random batch before it hands the stacked model out.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reparam import DiverseBranchBlock
from reparam.layers import FrozenIdentityBN, IdentityBasedConv1x1

__all__ = [
    "StackedBatchNorm2d", "StackedConv2d", "StackedDropout", "StackedGroupNorm", "StackedIdentityConv1x1",
    "StackedLinear", "client_shapes", "load_clients", "stack_model", "stacked_dropouts", "stacked_layers", "views",
]


class StackedConv2d(nn.Module):
    """``C`` copies of a :class:`~torch.nn.Conv2d` as one grouped convolution."""

    def __init__(self, conv: nn.Conv2d, clients: int) -> None:
        super().__init__()
        self.clients = clients
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.groups = conv.groups * clients
        self.weight = nn.Parameter(conv.weight.detach().repeat(clients, 1, 1, 1))
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().repeat(clients))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class StackedIdentityConv1x1(nn.Module):
    """``C`` copies of an identity-based 1×1 conv (:class:`reparam.layers.IdentityBasedConv1x1`,
    effective weight ``R + I``) as one grouped convolution: each client's residual ``R`` trains,
    the identity is every client's own and fixed (a non-persistent buffer, as in the original)."""

    id_tensor: torch.Tensor

    def __init__(self, conv: IdentityBasedConv1x1, clients: int) -> None:
        super().__init__()
        self.clients = clients
        self.groups = conv.groups * clients
        self.weight = nn.Parameter(conv.weight.detach().repeat(clients, 1, 1, 1))
        self.register_buffer("id_tensor", conv.id_tensor.detach().repeat(clients, 1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight + self.id_tensor.to(self.weight.dtype), None, 1, 0, 1, self.groups)


def _frozen_norm(norm: FrozenIdentityBN, clients: int) -> FrozenIdentityBN:
    """``C`` copies of a frozen identity norm: one over every client's channels (it acts per
    channel, with fixed statistics)."""
    out = FrozenIdentityBN(norm.num_features * clients, norm.eps)
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(out, name).copy_(getattr(norm, name).repeat(clients))
    return out.to(norm.running_var.device, norm.running_var.dtype)


def _branch_by_branch(_module: nn.Module, _args: Any) -> None:
    """A forward pre-hook that does nothing: a block with a hook runs its branch modules one by
    one (its fused training forwards are for unhooked blocks only)."""
    return None


class StackedLinear(nn.Module):
    """``C`` copies of a :class:`~torch.nn.Linear`: input ``(B, C·in)``, output ``(B, C·out)``."""

    def __init__(self, linear: nn.Linear, clients: int) -> None:
        super().__init__()
        self.clients = clients
        self.weight = nn.Parameter(linear.weight.detach().unsqueeze(0).repeat(clients, 1, 1))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().unsqueeze(0).repeat(clients, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        xc = x.reshape(b, self.clients, -1).transpose(0, 1)  # (C, B, in)
        if self.bias is None:
            y = torch.bmm(xc, self.weight.transpose(1, 2))
        else:
            y = torch.baddbmm(self.bias.unsqueeze(1), xc, self.weight.transpose(1, 2))
        return y.transpose(0, 1).reshape(b, -1)


class StackedBatchNorm2d(nn.Module):
    """``C`` copies of a :class:`~torch.nn.BatchNorm2d`, each with its own batch and running
    statistics (or batch statistics only, in train and eval mode alike, for a BatchNorm that
    tracks none, as HeteroFL's clients train). :attr:`mask` (``(B, C)``, 1 for a real row) is set
    by the trainer before a step whose batches are padded; None means every row of every client
    is real. :attr:`idle` (``(C,)``, True for a client that has finished its steps) is set instead
    of a mask when the only padding is whole idle clients: the plain BatchNorm then runs over every
    client (an idle client's output is never used: its loss is weighted by zero and its update
    held) and the idle clients' running statistics are put back, about a third cheaper a step than
    the masked statistics."""

    def __init__(self, bn: nn.BatchNorm2d, clients: int) -> None:
        super().__init__()
        self.clients, self.channels = clients, bn.num_features
        self.eps, self.momentum = bn.eps, float(bn.momentum if bn.momentum is not None else 0.1)
        self.weight = nn.Parameter(bn.weight.detach().repeat(clients))
        self.bias = nn.Parameter(bn.bias.detach().repeat(clients))
        self.tracks = bn.track_running_stats
        self.running_mean: torch.Tensor | None
        self.running_var: torch.Tensor | None
        self.num_batches_tracked: torch.Tensor | None
        if self.tracks:
            assert bn.running_mean is not None and bn.running_var is not None and bn.num_batches_tracked is not None
            self.register_buffer("running_mean", bn.running_mean.detach().repeat(clients))
            self.register_buffer("running_var", bn.running_var.detach().repeat(clients))
            self.register_buffer("num_batches_tracked", bn.num_batches_tracked.detach().repeat(clients))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None
        self.mask: torch.Tensor | None = None
        self.idle: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rm, rv, w, b = self.running_mean, self.running_var, self.weight, self.bias
        if not self.training and self.tracks:
            return F.batch_norm(x, rm, rv, w, b, False, 0.0, self.eps)
        if self.mask is None or not self.training:
            if self.training and self.idle is not None and self.tracks:
                return self._with_idle(x, self.idle)
            if self.training and self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
            return F.batch_norm(x, rm, rv, w, b, True, self.momentum, self.eps)
        # the statistics over real rows only, in the (B, H, W, C·ch) layout a channels-last x has
        # in memory (reductions over a 5-d view of the channel axis ran about a third slower)
        c, ch = self.clients, self.channels
        bsz, hw = x.shape[0], x.shape[2] * x.shape[3]
        xl = x.permute(0, 2, 3, 1)
        per_row = self.mask.to(x.dtype)  # (B, C)
        weights = per_row.repeat_interleave(ch, dim=1).view(bsz, 1, 1, c * ch)
        n = (per_row.sum(0) * hw).repeat_interleave(ch)  # (C·ch,) values per channel
        safe = n.clamp_min(1.0)
        mean = (xl * weights).sum((0, 1, 2)) / safe
        centred = xl - mean
        var = (centred.square() * weights).sum((0, 1, 2)) / safe
        y = (centred * (torch.rsqrt(var + self.eps) * w) + b).permute(0, 3, 1, 2)
        if rm is None or rv is None or self.num_batches_tracked is None:
            return y
        with torch.no_grad():
            active = n > 0
            unbiased = var * (n / (n - 1.0).clamp_min(1.0))
            mom = self.momentum
            rm.copy_(torch.where(active, rm * (1 - mom) + mean.detach() * mom, rm))
            rv.copy_(torch.where(active, rv * (1 - mom) + unbiased.detach() * mom, rv))
            self.num_batches_tracked.add_((per_row.sum(0) > 0).to(self.num_batches_tracked.dtype))
        return y

    def _with_idle(self, x: torch.Tensor, idle: torch.Tensor) -> torch.Tensor:
        """The plain batch statistics, with the ``idle`` clients' running statistics and batch
        counts put back."""
        rm, rv, n = self.running_mean, self.running_var, self.num_batches_tracked
        assert rm is not None and rv is not None and n is not None
        held = idle.repeat_interleave(self.channels)  # (C·ch,)
        # copies take the update (autograd keeps them for the backward, so they stay untouched)
        new_mean, new_var = rm.clone(), rv.clone()
        y = F.batch_norm(x, new_mean, new_var, self.weight, self.bias, True, self.momentum, self.eps)
        with torch.no_grad():
            rm.copy_(torch.where(held, rm, new_mean))
            rv.copy_(torch.where(held, rv, new_var))
            n.add_((~idle).to(n.dtype))
        return y


class StackedGroupNorm(nn.Module):
    """``C`` copies of a :class:`~torch.nn.GroupNorm` (per-sample statistics: padding never
    enters them)."""

    def __init__(self, gn: nn.GroupNorm, clients: int) -> None:
        super().__init__()
        self.groups, self.eps = gn.num_groups * clients, gn.eps
        self.weight = None if gn.weight is None else nn.Parameter(gn.weight.detach().repeat(clients))
        self.bias = None if gn.bias is None else nn.Parameter(gn.bias.detach().repeat(clients))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.groups, self.weight, self.bias, self.eps)


class StackedDropout(nn.Module):
    """``C`` copies of a :class:`~torch.nn.Dropout`. In training, client ``c``'s rows ``[0, n_c)``
    (:attr:`rows`; the rest are padding) are multiplied by ``bernoulli(1 − p) / (1 − p)`` drawn
    from :attr:`generators` ``[c]`` in the shape of that client's own batch — what
    :func:`torch.nn.functional.dropout` draws from torch's default generator in the same state —
    and padded rows by 0. Every dropout of a stacked model shares one list of generators (a
    client's model draws all its masks from one generator, in forward order). Without generators
    (the trainer sets them) it refuses to train."""

    def __init__(self, drop: nn.Dropout, clients: int) -> None:
        super().__init__()
        self.p, self.clients = float(drop.p), clients
        self.generators: list[torch.Generator] | None = None
        self.rows: list[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.generators is None or self.rows is None:
            raise RuntimeError("StackedDropout: the trainer sets each client's generator and rows before a step")
        keep = 1.0 - self.p
        xs = x.unflatten(1, (self.clients, -1))  # (B, C, …)
        noise = torch.zeros_like(xs, memory_format=torch.contiguous_format)
        for c, (gen, n) in enumerate(zip(self.generators, self.rows)):
            if n:
                draw = torch.empty((n, *xs.shape[2:]), dtype=x.dtype, device=gen.device).bernoulli_(keep, generator=gen)
                noise[:n, c] = draw.div_(keep).to(x.device)
        return (xs * noise).flatten(1, 2)


#: layers with parameters or buffers the stacking knows; every other such layer is refused
def _stacked(module: nn.Module, clients: int) -> nn.Module | None:
    if type(module) is nn.Dropout:
        return StackedDropout(module, clients)
    if type(module) is nn.Conv2d and module.padding_mode == "zeros":
        return StackedConv2d(module, clients)
    if type(module) is nn.Linear:
        return StackedLinear(module, clients)
    if type(module) is nn.BatchNorm2d and module.affine and (module.momentum is not None or not module.track_running_stats):
        return StackedBatchNorm2d(module, clients)
    if type(module) is nn.GroupNorm and module.affine:
        return StackedGroupNorm(module, clients)
    if type(module) is IdentityBasedConv1x1 and module.padding_mode == "zeros":
        return StackedIdentityConv1x1(module, clients)
    if type(module) is FrozenIdentityBN:
        return _frozen_norm(module, clients)
    return None


def stacked_layers(model: nn.Module) -> list[StackedBatchNorm2d]:
    """The stacked BatchNorms of a stacked model (the trainer sets their masks)."""
    return [m for m in model.modules() if isinstance(m, StackedBatchNorm2d)]


def stacked_dropouts(model: nn.Module) -> list[StackedDropout]:
    """The stacked dropouts of a stacked model (the trainer sets their generators and rows)."""
    return [m for m in model.modules() if isinstance(m, StackedDropout)]


def _replace(module: nn.Module, clients: int) -> bool:
    for name, child in module.named_children():
        new = _stacked(child, clients)
        if new is not None:
            # forward hooks stay (a scaler's elementwise factor); the forward check catches others
            new._forward_hooks.update(child._forward_hooks)
            setattr(module, name, new)
            continue
        if any(True for _ in child.parameters(recurse=False)) or any(True for _ in child.buffers(recurse=False)):
            # a layer with state the stacking does not know
            return False
        if not _replace(child, clients):
            return False
    return True


def stack_model(model: nn.Module, clients: int, in_shape: tuple[int, ...], *, check: bool = True) -> nn.Module | None:
    """A stacked copy of ``model`` for ``clients`` clients (see the module docstring), or None
    when a layer or the forward cannot be stacked. ``in_shape``: one sample's shape ``(Cin, H, W)``.

    Before it is returned, the stacked model runs a random batch against each client's own model
    (distinct parameters per client, in train mode and eval mode, in float64): a forward that
    mixes clients' channels is caught here instead of training wrong. ``check=False`` skips that
    run, for an architecture already checked at another number of clients (the stacking is the
    same layer by layer whatever the number)."""
    stacked = copy.deepcopy(model)
    if any(True for _ in stacked.parameters(recurse=False)) or any(True for _ in stacked.buffers(recurse=False)):
        return None
    if not _replace(stacked, clients):
        return None
    for m in stacked.modules():
        if isinstance(m, DiverseBranchBlock):
            m.register_forward_pre_hook(_branch_by_branch)
    if check and not _agrees(model, stacked, clients, in_shape):
        return None
    return stacked


def load_clients(stacked: nn.Module, states: list[dict[str, torch.Tensor]]) -> None:
    """Put each client's state (keys of the original model) into the stacked model."""
    own = stacked.state_dict()
    with torch.no_grad():
        for key, target in own.items():
            value = torch.stack([s[key].to(target.device, target.dtype) for s in states])
            target.copy_(value.reshape(target.shape))


def _agrees(model: nn.Module, stacked: nn.Module, clients: int, in_shape: tuple[int, ...]) -> bool:
    # on the CPU whatever the model's device: the check's random tensors come from CPU generators
    gen = torch.Generator().manual_seed(0)
    ref = copy.deepcopy(model).to("cpu", torch.float64)
    probe = copy.deepcopy(stacked).to("cpu", torch.float64)
    states = []
    for _ in range(clients):
        s = {k: (v + 0.1 * torch.randn(v.shape, generator=gen, dtype=torch.float64)) if v.is_floating_point() else v
             for k, v in ref.state_dict().items()}
        states.append({k: v.abs() + 0.5 if k.endswith("running_var") else v for k, v in s.items()})
    # each client's dropouts draw, in forward order, from one generator seeded 1000 + c, as its
    # own model draws from torch's default generator seeded alike
    gens = [torch.Generator().manual_seed(1000 + c) for c in range(clients)]
    for d in stacked_dropouts(probe):
        d.generators, d.rows = gens, [3] * clients
    try:
        x = torch.randn(3, clients, *in_shape, generator=gen, dtype=torch.float64)
        for train in (True, False):
            load_clients(probe, states)
            probe.train(train)
            got = probe(x.flatten(1, 2)).reshape(3, clients, -1)
            for c in range(clients):
                ref.load_state_dict(states[c])
                ref.train(train)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(1000 + c)
                    want = ref(x[:, c]).reshape(3, -1)
                if got.shape[2] != want.shape[1] or not torch.allclose(got[:, c], want, rtol=1e-9, atol=1e-9):
                    return False
    except (RuntimeError, ValueError, IndexError, TypeError, AttributeError):
        return False  # a layer that cannot run on the stacked channels
    return True


def client_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each state entry's shape in one client's model (keys of the original model)."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def views(stacked: nn.Module, shapes: dict[str, tuple[int, ...]], clients: int) -> dict[str, Any]:
    """Each state entry of the stacked model as ``(C, *client shape)`` views."""
    return {k: v.view(clients, *shapes[k]) for k, v in stacked.state_dict(keep_vars=True).items()}
