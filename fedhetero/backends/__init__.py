"""Back ends that run client tasks: ``local`` (this process, the reference) and ``process`` (a pool
of worker processes, with its wire format). Each is named in :data:`fedhetero.core.run.backend.BACKENDS`
and built by :func:`fedhetero.core.run.backend.make_backend`."""
