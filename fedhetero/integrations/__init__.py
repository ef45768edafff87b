"""Optional integrations with other frameworks.

Each sub-package needs its own extra and is never imported by the core: :mod:`fedhetero.integrations.flower`
(extra ``fedhetero[flower]``) runs fedhetero's client tasks on Flower's simulation and deployment
engines.
"""
