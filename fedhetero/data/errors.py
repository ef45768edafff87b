"""Errors raised by :mod:`fedhetero.data`."""

from __future__ import annotations

__all__ = ["DataConfigError", "DatasetFormatError", "DatasetNotFoundError"]


class DataConfigError(ValueError):
    """A data, partition or split argument is invalid.

    The message names the argument and the accepted values.
    """


class DatasetFormatError(ValueError):
    """A dataset file exists but does not hold what its format prescribes (keys, shapes, types)."""


class DatasetNotFoundError(FileNotFoundError):
    """The files of a dataset are not where the loader looked.

    The message names every missing file, the directory searched, how to point the loader
    elsewhere (``--set data.data_dir=DIR`` on the command line, ``data.data_dir`` in a config) and where the
    files can be downloaded.
    """
