"""Optional integrations with other frameworks, one sub-package each, each behind its own extra.

:mod:`fedhetero.integrations.flower` (extra ``fedhetero[flower]``) runs fedhetero's client tasks on
Flower's simulation and deployment engines: it builds its back end inside its ServerApp and hands it
to the engine. Nothing in the core, the back ends or the methods imports an integration.
"""
