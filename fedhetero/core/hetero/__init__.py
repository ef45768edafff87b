"""Heterogeneity: MACs, budget tiers and scenarios (:mod:`.budget`), width planning
(:mod:`.widths`), sub-model extraction and aggregation (:mod:`.submodel`), device sessions
(:mod:`.sessions`) and the simulated device time (:mod:`.timemodel`)."""
