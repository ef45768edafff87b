"""The method SDK: the interface every method subclasses (:mod:`.algorithm`), method names and
classes (:mod:`.registry`). The client runner that trains a round's local plans in batched
cohorts is :mod:`fedhetero.core.local.runner`, next to the cohort code."""
