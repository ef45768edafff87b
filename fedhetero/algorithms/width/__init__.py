"""Width-sliced sub-models: HeteroFL, FedRolex and SplitMix."""
