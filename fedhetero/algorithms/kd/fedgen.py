"""FedGen: data-free knowledge distillation with a server-side generator (Zhu, Hong, Zhou; ICML 2021).

The global model is trained and averaged as in FedAvg. Besides it the server keeps a lightweight
conditional generator ``G(y, ε)`` that maps a label and uniform noise to a point in the model's
feature space (the input of the final classifier, see :mod:`fedhetero.core.local.features`):
``[ε, onehot(y)] → Linear → BatchNorm → ReLU → Linear → z``.

**Server, after the clients of round t returned** (ensemble distillation into the generator):
with the label counts the clients report, a label is *qualified* when some sampled client holds
more than one sample of it, and client k's weight for label y is ``a_{y,k} = n_{k,y} / Σ_j n_{j,y}``.
For ``gen_steps`` Adam steps on batches of qualified labels ``y`` (drawn uniformly) and noise ε,
the generator minimises

    Σ_k mean_i( a_{y_i,k} · CE(h_k(G(y_i, ε_i)), y_i) ) + η · exp(−mean_{i,j} d_ε(i,j)·d_z(i,j)),

where ``h_k`` is client k's uploaded classifier (its last linear layer), ``d_z`` the mean absolute
and ``d_ε`` the mean squared difference between two samples' outputs and noises (the diversity
term, which keeps G from collapsing). Adam's learning rate decays by ``gen_lr_decay`` after each
round; its state persists across rounds and resumes. Then the uploads are averaged.

**Clients, from round 2 on** (the generator is sent as a state dict with the qualified labels),
the local loss on a batch (x, y) is

    CE(f(x), y) + α_t·(B_g/B)·CE(h(G(ŷ, ε')), ŷ) + β_t·KL( softmax(h(G(y, ε))) ‖ softmax(f(x)) ),

with ``h`` the client's own classifier, ŷ a batch of ``B_g`` qualified labels drawn uniformly, the
target of the KL term detached, the generator in eval mode and without gradients, and
``α_t = α·decay^(t−1)``, ``β_t = β·decay^(t−1)``. Round 1 trains with plain cross-entropy (there
is no trained generator yet). Noise and label draws come from generators seeded by (round, client)
on the clients and by the round on the server, never from torch's global stream.

Defaults follow the authors' MNIST configuration where it carries over: hidden width 256, noise
dimension 32, diversity weight η = 1, 50 generator steps per round, Adam weight decay 0.01, the
generator batch equal to the local batch size, α and β decaying by 0.98 per round; the generator
learning rate is 1e-4 with decay 0.98 per round (the FedGen setting of the DynaComm paper's
comparison). The authors weight the client terms with α = β = 10, tuned for plain SGD at learning
rate 0.01; with this toolkit's default trainer (lr 0.05, momentum 0.9) that multiplies the
effective step about elevenfold and training collapses (digits, 10 clients, 3 rounds: accuracy
0.16 against FedAvg's 0.66), so the defaults here are α = β = 1 (0.67 on that run; 0.84 against
FedAvg's 0.79 after 6 rounds). Pass 10 to reproduce the authors' setting with their optimiser.

The generator's output size is the model's feature size (it must feed the classifier), so it is
not an option; for a model without hidden layers (logistic regression) the generator produces
inputs. α = β = 0 trains FedAvg's models bit for bit (the generator is still trained and sent).

Communication: clients download the model plus the generator (from round 2) and upload the model
plus their label counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.local.features import classifier_of
from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.objective import Batch, LocalObjective, LocalPlan
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context

__all__ = ["FedGen", "FedGenOptions", "Generator", "diversity_loss"]


@dataclass(frozen=True)
class FedGenOptions(MethodOptions):
    alpha: float = option(1.0, ge=0)  # α: weight of the clients' cross-entropy on generated features
    beta: float = option(1.0, ge=0)  # β: weight of the clients' KL term towards the generated-feature prediction
    reg_decay: float = option(0.98, gt=0, le=1)  # α and β are multiplied by this every round
    hidden_dim: int = option(256, ge=1)  # generator's hidden width
    noise_dim: int = option(32, ge=1)  # generator's noise size
    gen_steps: int = option(50, ge=0)  # generator (Adam) steps per round on the server
    gen_lr: float = option(1e-4, gt=0)
    gen_lr_decay: float = option(0.98, gt=0, le=1)  # per round (exponential schedule)
    gen_weight_decay: float = option(0.01, ge=0)
    # server and client batches of generated features (None: train.batch_size)
    gen_batch_size: int | None = option(None, ge=2)
    diversity: float = option(1.0, ge=0)  # η: weight of the generator's diversity term


class Generator(nn.Module):
    """``[ε, onehot(y)] → Linear(hidden) → BatchNorm1d → ReLU → Linear(feature_dim)``."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.hidden = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU())
        self.out = nn.Linear(hidden_dim, feature_dim)

    def forward(self, y: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(y, self.num_classes).to(eps.dtype)
        return self.out(self.hidden(torch.cat([eps, onehot], dim=1)))


def diversity_loss(eps: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``exp(−mean_{i,j} d_ε(i,j)·d_z(i,j))`` with ``d_z`` the mean absolute difference of two
    outputs and ``d_ε`` the mean squared difference of their noises."""
    z = z.flatten(1)
    d_z = (z.unsqueeze(0) - z.unsqueeze(1)).abs().mean(2)
    d_eps = (eps.unsqueeze(0) - eps.unsqueeze(1)).pow(2).mean(2)
    return torch.exp(-(d_eps * d_z).mean())


def _label_draw(labels: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    return labels[torch.randint(len(labels), (n,), generator=gen)]


class FedGen(Algorithm):
    """FedAvg plus a server-trained feature generator that regularises local training."""

    name = "fedgen"
    summary = (
        "FedAvg plus a conditional feature generator, trained on the server from the clients' classifiers, "
        "that regularises local training (data-free distillation)."
    )
    paper = "Zhu, Hong, Zhou; ICML 2021"
    Options = FedGenOptions
    # plus the generator's Adam moments, which :meth:`state_dict` adds in a format of its own
    state_fields = ("global_model", "generator", "gen_rounds", "labels")

    # ---------------------------------------------------------------- server half
    def setup(self, ctx: "Context") -> None:
        self.global_model = ctx.build_model()  # first, so the model is FedAvg's initial model
        self.head_key, head = classifier_of(self.global_model, ctx.num_classes)
        o = self.options
        self.generator = Generator(o.noise_dim, ctx.num_classes, o.hidden_dim, head.in_features).to(ctx.device, ctx.dtype)
        self.gen_optimizer = torch.optim.Adam(self.generator.parameters(), lr=o.gen_lr, weight_decay=o.gen_weight_decay)
        self.gen_rounds = 0  # rounds the generator has been trained in
        self.labels = torch.zeros(0, dtype=torch.long)  # labels the generator was trained for

    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        assert self.global_model is not None
        payload: dict[str, Any] = {"state": dict(self.global_model.state_dict())}
        if self.gen_rounds > 0 and len(self.labels):
            payload["generator"] = dict(self.generator.state_dict())
            payload["labels"] = self.labels
        return [self.task(ctx, c, payload) for c in clients]

    def aggregate(self, ctx: "Context", results: list[ClientResult]) -> None:
        assert self.global_model is not None
        if not results:
            return
        with ctx.timer("generator"):
            self.train_generator(ctx, results)
        self.global_model.load_state_dict(weighted_average([r.state for r in results], ctx.aggregation_weights(results)))

    def _gen_batch(self, ctx: "Context") -> int:
        return int(self.options.gen_batch_size or ctx.cfg.train.batch_size)

    def train_generator(self, ctx: "Context", results: list[ClientResult]) -> None:
        """Ensemble distillation of the returned classifiers into the generator (module docstring)."""
        o = self.options
        counts = torch.stack([r.payload["label_counts"].to(torch.float64) for r in results])  # (K, C)
        qualified = torch.nonzero(counts.max(0).values > 1).flatten()
        if len(qualified) == 0 or o.gen_steps == 0:
            return
        share = counts / counts.sum(0).clamp_min(1.0)  # a_{y,k}, stored as (K, C)
        share = share.to(ctx.device, ctx.dtype)
        heads = [(r.state[f"{self.head_key}.weight"].to(ctx.device), r.state[f"{self.head_key}.bias"].to(ctx.device)) for r in results]
        gen = ctx.torch_generator("algorithm", ctx.round, 1)
        batch = max(self._gen_batch(ctx), 2)
        labels = qualified.to(torch.long)
        for group in self.gen_optimizer.param_groups:
            group["lr"] = o.gen_lr * o.gen_lr_decay**self.gen_rounds
        self.generator.train()
        for _ in range(o.gen_steps):
            y = _label_draw(labels, batch, gen)
            eps = torch.rand(batch, o.noise_dim, generator=gen).to(ctx.device, ctx.dtype)
            y = y.to(ctx.device)
            z = self.generator(y, eps)
            teacher = z.new_zeros(())
            for k, (w, b) in enumerate(heads):
                ce = F.cross_entropy(F.linear(z, w, b), y, reduction="none")
                teacher = teacher + (ce * share[k, y]).mean()
            loss = teacher + o.diversity * diversity_loss(eps, z)
            self.gen_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.gen_optimizer.step()
        self.generator.eval()
        self.gen_rounds += 1
        self.labels = labels.cpu()

    # The Adam moments are saved by hand, as lists per moment in the generator's parameter order
    # (the optimizer's own state dict would be another format).
    def state_dict(self) -> dict[str, Any]:
        params = list(self.generator.parameters())
        adam = [self.gen_optimizer.state.get(p, {}) for p in params]
        return {
            **super().state_dict(),
            # Adam's moments, one entry per generator parameter (empty before the first step)
            "adam": {
                name: [s[name] for s in adam] if all(name in s for s in adam) else []
                for name in ("step", "exp_avg", "exp_avg_sq")
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.gen_rounds = int(self.gen_rounds)
        self.labels = self.labels.to(torch.long)
        adam = state["adam"]
        params = list(self.generator.parameters())
        if adam["step"]:
            if not len(adam["step"]) == len(adam["exp_avg"]) == len(adam["exp_avg_sq"]) == len(params):
                raise ValueError("fedgen: the saved Adam state does not fit the generator")
            opt_state = self.gen_optimizer.state_dict()
            opt_state["state"] = {
                i: {"step": adam["step"][i], "exp_avg": adam["exp_avg"][i], "exp_avg_sq": adam["exp_avg_sq"][i]}
                for i in range(len(params))
            }
            self.gen_optimizer.load_state_dict(opt_state)

    # ---------------------------------------------------------------- client half
    # The default client half: from round 2 the generator's terms are the local objective (so
    # the clients of a round train as one cohort), and the label counts go up with the model.
    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        out = super().upload(ctx, task, model, result)
        counts = torch.as_tensor(ctx.data.train.label_histogram(ctx.data.client_indices[task.cid]), dtype=torch.long)
        out.payload["label_counts"] = counts
        out.bytes_up += int(counts.numel() * counts.element_size())
        return out

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan:
        """From round 2 (the generator is in the payload): the generated-feature cross-entropy
        through the client's own classifier and the KL towards its prediction on features
        generated for the batch's labels (module docstring). Noise and labels are drawn from the
        client's own generator, step by step, in the order: the batch's noise, the drawn labels,
        their noise."""
        if "generator" not in task.payload:
            return LocalPlan(ctx.configured_sgd())
        o = self.options
        head_key, head = classifier_of(self.client_model(ctx, task), ctx.num_classes)
        feature_dim = head.in_features
        generator = ctx.reusable(
            ("fedgen", "generator", o.noise_dim, o.hidden_dim, feature_dim),
            lambda: Generator(o.noise_dim, ctx.num_classes, o.hidden_dim, feature_dim).to(ctx.device, ctx.dtype),
        )
        generator.load_state_dict(task.payload["generator"])  # the round's, the same for every client
        generator.eval()
        labels = task.payload["labels"].to(torch.long)
        decay = o.reg_decay ** (int(task.round) - 1)
        alpha, beta = o.alpha * decay, o.beta * decay
        gen_batch = int(o.gen_batch_size or ctx.cfg.train.batch_size)
        ratio = gen_batch / ctx.cfg.train.batch_size
        device, dtype = ctx.device, ctx.dtype

        def draws(rng: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            eps = torch.rand(rows, o.noise_dim, generator=rng).to(device, dtype)
            y_hat = _label_draw(labels, gen_batch, rng).to(device)
            eps_hat = torch.rand(gen_batch, o.noise_dim, generator=rng).to(device, dtype)
            return eps, y_hat, eps_hat

        def generated(y: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:  # G on any leading axes
            return generator(y.reshape(-1), eps.reshape(-1, o.noise_dim)).reshape(*y.shape, feature_dim)

        def loss(batch: Batch) -> torch.Tensor:
            eps, y_hat, eps_hat = batch.each(draws, padded=(True, False, False))
            assert batch.labels is not None
            with torch.no_grad():
                z_y = generated(batch.labels, eps)
                z_hat = generated(y_hat, eps_hat)
                target = torch.softmax(batch.linear(head_key, z_y), dim=-1)
            logp = torch.log_softmax(batch.out, dim=-1)
            latent = batch.mean(F.kl_div(logp, target, reduction="none").sum(-1))
            logits = batch.linear(head_key, z_hat)
            teacher = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_hat.reshape(-1),
                                      reduction="none").reshape(y_hat.shape).mean(-1)
            batch.record("teacher_loss", teacher)
            batch.record("latent_loss", latent)
            return alpha * ratio * teacher + beta * latent

        return LocalPlan(ctx.configured_sgd(), objective=LocalObjective(loss=loss, own=ctx.torch_generator("algorithm", task.round, task.cid)))
