"""The methods, in one folder per family; each family owns its helpers.

* ``classic/`` — FedAvg and the optimisation baselines (FedProx, SCAFFOLD, FedDyn, FedNova, MOON,
  FedACG, FedEnsemble);
* ``width/`` — width-sliced sub-models (HeteroFL, FedRolex, SplitMix);
* ``kd/`` — knowledge distillation (FedDF, FedET, DS-FL, FedGen);
* ``feddumap/`` — server data, adaptive momentum and adaptive pruning (FedDU, FedDUM, FedDUMAP,
  FedAP) with their baselines;
* ``dynamicfl/``, ``dynacomm/`` (with its selectors), ``dyninit/`` — one method each;
* ``pruning/`` and ``features`` — structural tools several families share.

:data:`BUILTIN` names every built-in method; :func:`fedhetero.core.method.registry.get_algorithm` loads
one on demand. A method of your own subclasses :class:`Algorithm` and needs nothing but the names
this package exports (see the guide).
"""

from __future__ import annotations

from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import ConfigError, MethodOptions, option, require
from fedhetero.core.local.objective import Batch, LocalObjective, LocalPhase, LocalPlan, LocalSGD
from fedhetero.core.local.segments import LocalSegment, SegmentRule, run_segments
from fedhetero.core.method.registry import build_algorithm, get_algorithm, list_algorithms, register
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask, payload_bytes, state_bytes

__all__ = [
    "Algorithm",
    "BUILTIN",
    "Batch",
    "ClientInfo",
    "ClientResult",
    "ClientTask",
    "ConfigError",
    "LocalObjective",
    "LocalPhase",
    "LocalPlan",
    "LocalSGD",
    "LocalSegment",
    "MethodOptions",
    "build_algorithm",
    "get_algorithm",
    "list_algorithms",
    "option",
    "payload_bytes",
    "register",
    "require",
    "run_segments",
    "SegmentRule",
    "state_bytes",
    "weighted_average",
]

_P = __name__

#: name -> ``"module:Class"`` of every built-in method
BUILTIN: dict[str, str] = {
    "fedavg": f"{_P}.classic.fedavg:FedAvg",
    "fedavg_small": f"{_P}.classic.fedavg:FedAvgSmall",
    "fedprox": f"{_P}.classic.fedprox:FedProx",
    "scaffold": f"{_P}.classic.scaffold:Scaffold",
    "feddyn": f"{_P}.classic.feddyn:FedDyn",
    "fednova": f"{_P}.classic.fednova:FedNova",
    "moon": f"{_P}.classic.moon:Moon",
    "fedacg": f"{_P}.classic.fedacg:FedACG",
    "fedensemble": f"{_P}.classic.fedensemble:FedEnsemble",
    "heterofl": f"{_P}.width.heterofl:HeteroFL",
    "fedrolex": f"{_P}.width.fedrolex:FedRolex",
    "splitmix": f"{_P}.width.splitmix:SplitMix",
    "feddf": f"{_P}.kd.feddf:FedDF",
    "fedet": f"{_P}.kd.fedet:FedET",
    "dsfl": f"{_P}.kd.dsfl:DSFL",
    "fedgen": f"{_P}.kd.fedgen:FedGen",
    "feddu": f"{_P}.feddumap.feddu:FedDU",
    "feddu_static": f"{_P}.feddumap.feddu:FedDUStatic",
    "feddum": f"{_P}.feddumap.feddum:FedDUM",
    "fedduap": f"{_P}.feddumap.feddumap:FedDUAP",
    "feddumap": f"{_P}.feddumap.feddumap:FedDUMAP",
    "fedap": f"{_P}.feddumap.fedap:FedAP",
    "data_sharing": f"{_P}.feddumap.baselines:DataSharing",
    "hybrid_fl": f"{_P}.feddumap.baselines:HybridFL",
    "feddu_sm": f"{_P}.feddumap.baselines:FedDUServerM",
    "feddu_dm": f"{_P}.feddumap.baselines:FedDUDeviceM",
    "feddu_da": f"{_P}.feddumap.baselines:FedDUDA",
    "hrank_fl": f"{_P}.feddumap.baselines:HRankFL",
    "imc": f"{_P}.feddumap.baselines:IMC",
    "dynamicfl": f"{_P}.dynamicfl.algorithm:DynamicFL",
    "dynacomm": f"{_P}.dynacomm.algorithm:DynaComm",
    "dyninit": f"{_P}.dyninit.algorithm:DynInit",
}
