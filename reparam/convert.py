"""Whole-model operations, re-exported from the modules that implement them.

This module used to hold four jobs; each now lives in a module named after it, and every name
importable from here before still is:

* :mod:`reparam.pairs` — finding conv → BN pairs and BN-only identity branches;
* :mod:`reparam.expand_merge` — :func:`expand` and :func:`merge` of whole models;
* :mod:`reparam.spec` — structure specs and state dicts (:func:`structure`, :func:`build`,
  :func:`merge_state_dict`, :func:`detect_form`, :func:`strip_prefixes`);
* :mod:`reparam.rep` — DynamicFL's :func:`rep_to_local`.
"""

from __future__ import annotations

from ._tree import iter_blocks
from .expand_merge import FoldedIdentity, expand, merge
from .pairs import ConvScan, find_conv_bn_pairs, find_identity_branches
from .rep import rep_to_local
from .spec import SPEC_FORMAT, SPEC_VERSION, build, detect_form, merge_state_dict, strip_prefixes, structure

__all__ = [
    "SPEC_FORMAT",
    "SPEC_VERSION",
    "ConvScan",
    "find_conv_bn_pairs",
    "find_identity_branches",
    "FoldedIdentity",
    "expand",
    "merge",
    "structure",
    "build",
    "merge_state_dict",
    "detect_form",
    "strip_prefixes",
    "iter_blocks",
    "rep_to_local",
]
