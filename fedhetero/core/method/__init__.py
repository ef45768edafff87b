"""The method SDK: the interface every method subclasses (:mod:`.algorithm`), method names and
classes (:mod:`.registry`) and the client runner that trains a round's clients from their
methods' local plans in batched cohorts (:mod:`.runner`)."""
