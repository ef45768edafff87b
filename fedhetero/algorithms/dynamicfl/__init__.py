"""DynamicFL: each client's model grown or shrunk to its budget by structural re-parameterisation
(Diverse Branch Blocks, DYMM), merged back to the global model's structure for aggregation."""
