"""The lab: benchmarks, ablations, result tables and the grid runner behind them.

Tools for measuring the project, run by ``fedhetero bench …``, ``fedhetero dynamicfl-ablation`` and
``fedhetero dyninit-table``. Nothing in the runtime (the round loop, back ends, methods, data, the
model zoo, ``reparam``) imports this package; the import contracts in ``pyproject.toml`` keep it so.
"""
