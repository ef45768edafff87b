"""Knowledge distillation across model sizes: FedDF, FedET, DS-FL and FedGen (the shared set-up in
``_common``)."""
