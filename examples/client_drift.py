"""How far a round of local training moves each tier's clients, from a finished run's end
(docs/results.md, "DynamicFL at the DynamicFL paper's protocol").

    python examples/client_drift.py runs/dynamicfl-paper/methods/beta0.5/dynamicfl/s0 --clients 6

One more round, run outside the run directory (nothing in it changes): the first ``--clients``
clients of every tier train from the run's final global model (``final_model.pt``) and, for a
method with client state, their newest stored state, as they would if sampled next. For each
tier it prints the relative change of every weight tensor of the uploads with BatchNorm folded
into the convs (``|W_client - W_global| / |W_global|``, mean over the tier's clients, so a plain
global model and a model with BatchNorm compare alike), the uploads' mean test accuracy, and the
test accuracy of their mean as the server's default aggregation weighs them (``train.aggregation``);
then the accuracy of the mean of every tier's uploads.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import reparam
from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.common.configfile import load_config
from fedhetero.core.local.context import client_context
from fedhetero.core.run.engine import Engine
from fedhetero.core.exchange.store import ClientStateStore
from fedhetero.core.exchange.types import ClientResult


def drift(run_dir: Path, clients_per_tier: int) -> dict:
    """The measurement for ``run_dir``: ``{"global_accuracy", "tiers": {tier: {...}}, "all_tiers_mean_accuracy"}``."""
    if not (run_dir / "final_model.pt").is_file():
        raise SystemExit(f"{run_dir}: no final_model.pt (is the run finished?)")
    cfg = load_config(run_dir / "config.yaml")
    engine = Engine(cfg, Path(tempfile.gettempdir()) / "client-drift-unused", progress=False)
    engine.setup()  # builds the data, the context and the method; writes nothing
    rnd = cfg.train.rounds + 1
    engine.ctx.round = rnd
    algo = engine.algorithm
    final = torch.load(run_dir / "final_model.pt", weights_only=True, map_location="cpu")
    try:
        algo.global_model.load_state_dict(final)
    except RuntimeError:
        raise SystemExit(f"{cfg.algorithm.name}: final_model.pt is not the state of its global model; this script "
                         "compares uploads of the whole global model") from None
    client = client_context(cfg, engine.data)
    client_half = type(algo)(algo.options)  # as in a worker process: nothing of the server's instance
    store = ClientStateStore(run_dir / "client_state")
    scratch = copy.deepcopy(algo.global_model)

    def model_of(state: dict[str, torch.Tensor]) -> torch.nn.Module:
        scratch.load_state_dict(state)
        return scratch.eval()

    def mean_of(results: list[ClientResult]) -> dict[str, torch.Tensor]:  # the server's default aggregation
        return weighted_average([r.state for r in results], engine.ctx.aggregation_weights(results))

    def folded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in reparam.merge(model_of(state), target="deploy").state_dict().items()}

    def accuracy(state: dict[str, torch.Tensor]) -> float:
        return 100 * engine.ctx.evaluate(model_of(state))["accuracy"]

    ref = folded(final)
    weights = [k for k, v in ref.items() if v.is_floating_point() and v.dim() > 1]
    by_tier: dict[str, list] = {}
    for cid in range(cfg.data.num_clients):
        info = engine.client_info(cid, rnd)
        by_tier.setdefault(info.tier, []).append(info)
    out: dict = {"global_accuracy": accuracy(final), "tiers": {}}
    every: list[ClientResult] = []
    for tier, infos in by_tier.items():
        uploads = []
        for task in algo.configure(engine.ctx, infos[:clients_per_tier]):
            with client.client_scope(task):
                uploads.append(client_half.client_update(client, task, store.get(task.cid)))
        moved = [folded(u.state) for u in uploads]
        out["tiers"][tier] = {
            "clients": len(uploads),
            "relative_change": {k: statistics.mean(float((m[k] - ref[k]).norm() / ref[k].norm()) for m in moved) for k in weights},
            "upload_accuracy": statistics.mean(accuracy(u.state) for u in uploads),
            "mean_upload_accuracy": accuracy(mean_of(uploads)),
        }
        every += uploads
    out["all_tiers_mean_accuracy"] = accuracy(mean_of(every))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished run directory (fedhetero train --out …)")
    parser.add_argument("--clients", type=int, default=6, help="clients per tier (default: 6)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    res = drift(args.run_dir, args.clients)
    print(f"global model: {res['global_accuracy']:.2f} % test accuracy")
    for tier, row in res["tiers"].items():
        change = "  ".join(f"{k.rsplit('.', 1)[0]} {v:.3f}" for k, v in row["relative_change"].items())
        print(f"{tier} ({row['clients']} clients): {change}  |  uploads {row['upload_accuracy']:.1f} %, "
              f"their mean {row['mean_upload_accuracy']:.2f} %")
    print(f"mean of every tier's uploads: {res['all_tiers_mean_accuracy']:.2f} %")
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
