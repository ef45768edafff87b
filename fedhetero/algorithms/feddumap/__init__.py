"""FedDUMAP: training on server data (FedDU), adaptive server momentum (FedDUM), adaptive pruning
(FedAP) and their combinations, with the paper's baselines (``baselines``); the shared server-data
machinery is in ``_common``."""
