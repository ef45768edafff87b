"""What every room uses: the one way to register a name (:mod:`.names`), the run config with its
validation (:mod:`.config`), the console every command prints through (:mod:`.console`) and
run-directory integrity (:mod:`.rundir`)."""
