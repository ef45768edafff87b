"""The core, in rooms, each importing only the rooms below it (checked by import-linter):

* :mod:`.run` — the round loop, back ends, the run's outputs, comparisons, the Python API;
* :mod:`.method` — the method SDK: ``Algorithm`` and method names;
* :mod:`.local` — local training: the contexts, the trainer, local plans and objectives, cohorts
  and the client runner that trains a round's plans in them;
* :mod:`.exchange` — what travels between server and clients, averaging, the client-state store;
* :mod:`.hetero` — MACs, budgets, widths, sub-models, device sessions and time;
* :mod:`.common` — the config, the console, run-directory integrity.

It imports no method, back end, integration, lab module or command (docs/architecture.md)."""
