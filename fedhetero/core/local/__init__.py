"""Local training: the contexts a method codes against (:mod:`.context`: the run's, a client's and
the server's), the shared local trainer (:mod:`.trainer`), local training as a value and its
objectives (:mod:`.objective`), the classifier's input features (:mod:`.features`) and a round's
clients trained side by side (:mod:`.stacking`, :mod:`.cohort`) by the client runner
(:mod:`.runner`), from their methods' local plans."""
