"""The core: the method interface, the round loop, contexts, config, state store, run directory,
export and reports. It imports no method, back end, integration, lab module or command
(docs/architecture.md lists its modules in order)."""
