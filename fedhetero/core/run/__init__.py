"""Running a job: the round loop and checkpoints (:mod:`.engine`), resuming (:mod:`.resume`), the
back-end interface (:mod:`.backend`), the run's outputs (metrics rows :mod:`.metrics`, the
summary :mod:`.summary`, the progress shown :mod:`.progress`, experiment :mod:`.loggers`, the
final :mod:`.reports`, the model :mod:`.export`), comparisons of methods (:mod:`.compare`), the Python
API (:mod:`.api`) and the allocator tuning of the trainer's process (:mod:`.allocator`).
The top room of the core: it imports the others, none imports it."""
