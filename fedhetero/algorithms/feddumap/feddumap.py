"""FedDUMAP and FedDUAP: dynamic server update (+ decoupled momentum) + adaptive pruning.

The FedDUMAP paper's ablation variants all share one per-round procedure and differ only in:

========== ====================== ============== =============== =======
variant    device optimiser       server update  server momentum pruning
========== ====================== ============== =============== =======
FedDU      SGD                    FedDU          no              no
FedDUM     SGDM, reset per round  FedDU          yes             no
FedAP      SGD                    none           no              yes
FedDUAP    SGD                    FedDU          no              yes
FedDUMAP   SGDM, reset per round  FedDU          yes             yes
========== ====================== ============== =============== =======

FedDUMAP (the journal method): devices run Formula 11, the server averages (Formula 12, first
part), applies the FedDU step (Formulas 4–7, interpolated), then momentum over the pseudo-gradient
(Formulas 12 and 8); after ``prune_round`` (30) rounds FedAP (Algorithm 3, Formula 15) prunes the
global model once and slices the server momentum buffer with the same channel indices. FedDUAP is
the conference version (reference 35): FedDU + FedAP without momentum.

Recorded per round in every client's ``metrics``: ``lr``, the FedDU quantities (``feddu_alpha`` …),
``server_momentum_norm`` (FedDUMAP), ``prune_p_star`` and ``prune_rate/<group>`` after pruning;
``macs`` and ``params`` of the model each client trained.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhetero.algorithms.feddumap.fedap import PruneOptions, PruningMixin
from fedhetero.algorithms.feddumap.feddu import FedDU, FedDUOptions
from fedhetero.algorithms.feddumap.feddum import FedDUM, FedDUMOptions
from fedhetero.algorithms.pruning.surgery import slice_tensors
from fedhetero.core.hetero.submodel import SubmodelSpec

__all__ = ["FedDUAPOptions", "FedDUMAPOptions", "FedDUAP", "FedDUMAP"]


@dataclass(frozen=True)
class FedDUAPOptions(PruneOptions, FedDUOptions):
    """FedDU options plus FedAP's."""


@dataclass(frozen=True)
class FedDUMAPOptions(PruneOptions, FedDUMOptions):
    """FedDUM options (β = β' = 0.9, η_s = 1) plus FedAP's."""


class FedDUAP(PruningMixin, FedDU):
    """FedDUAP (IJCAI 2022): FedDU (Algorithm 1) + FedAP (Algorithm 3) once after ``prune_round``."""

    name = "fedduap"
    summary = (
        "FedDU plus FedAP: the global model is pruned once, structurally and with adaptive per-layer rates, "
        "after prune_round rounds (the conference method)."
    )
    paper = "Zhang et al., IJCAI 2022"
    Options = FedDUAPOptions


class FedDUMAP(PruningMixin, FedDUM):
    """FedDUMAP: FedDUM (Algorithm 2: Formulas 11, 12, 8 on top of FedDU's Formulas 4–7) + FedAP
    (Algorithm 3, Formula 15) once after ``prune_round``; the server momentum is sliced with the
    pruned channels' indices."""

    name = "feddumap"
    summary = (
        "FedDUM plus FedAP's one-shot adaptive structured pruning after prune_round rounds, with the server "
        "momentum sliced like the model (the journal method)."
    )
    paper = "Liu, Jia, Zhang, Yun, Wang et al., ACM TIST (FedDUMAP; journal version of FedDUAP, Zhang et al., IJCAI 2022)"
    Options = FedDUMAPOptions

    def _on_pruned(self, spec: SubmodelSpec) -> None:
        super()._on_pruned(spec)
        if self.server_momentum_buffer:
            self.server_momentum_buffer = slice_tensors(self.server_momentum_buffer, spec)
