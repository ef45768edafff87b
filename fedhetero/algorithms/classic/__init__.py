"""FedAvg and the optimisation baselines: FedProx, SCAFFOLD, FedDyn, FedNova, MOON, FedACG and
FedEnsemble (control variates and split averages in ``_common``)."""
