"""What every room uses: the one way to register a name (:mod:`.names`), declaring and checking
options (:mod:`.options`), the run config's sections and validation (:mod:`.config`), config
files and ``--set`` overrides (:mod:`.configfile`), the console every command prints through
(:mod:`.console`) and run-directory integrity (:mod:`.rundir`)."""
