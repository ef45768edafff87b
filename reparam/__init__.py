"""reparam: lossless Diverse Branch Block (DBB) structural re-parameterization for PyTorch.

Expand any conv(+BN) of any model into a multi-branch block for training and merge it back into one
plain conv. Expansion (zero-γ growth) is bit-exact in train and eval mode; merging, folding and
re-solving are exact in eval mode (they use BatchNorm running statistics).

Quick start::

    import reparam
    big = reparam.expand(model)                  # deep copy with blocks; same function
    ...train big...
    plain = reparam.merge(big.eval())            # one biased conv per block, BNs folded
    reparam.testing.assert_equivalent(big, plain, x)

Branch kinds live in a registry (:mod:`reparam.kinds`): a new kind is one
:class:`BranchKind` subclass plus :func:`register_kind`, and blocks, FLOPs and DYMM pick it up.

Depends on torch only (numpy and the standard library aside); importing it changes nothing outside
the package. For torchvision and timm, the project's pinned install needs
:func:`install_torchvision_fix`: its torchvision wheel was built against another torch build than
the installed CPU one, so its compiled detection operators fail to load and ``import
torchvision`` / ``import timm`` fail (classification models do not need those operators). Call it
once before they are imported (an import hook), or import through
:func:`reparam._compat.import_torchvision` / :func:`~reparam._compat.import_timm`. fedhetero's
entry points apply it themselves.
"""

from __future__ import annotations

from . import _compat as _compat  # the torchvision import repair, for applications to apply (nothing is installed)
from ._compat import install_torchvision_fix
from . import builtin_kinds, invariants, testing, transforms
from .block import ANCHOR_NORMS, DEFAULT_BRANCHES, DEPTHWISE_BRANCHES, DiverseBranchBlock
from .builtin_kinds import KINDS
from .kind_1x1_kxk import OneByOneKxKBranch
from .kind_avg import AvgBranch
from .kind_conv import CentredConvKind, ConvBNBranch
from .kind_identity import IdentityBranch
from .kinds import applicability
from .layers import FrozenIdentityBN, IdentityBasedConv1x1
from .changes import StructureChange, apply_to_optimizer
from ._tree import iter_blocks
from .expand_merge import SCRATCH_INIT, FoldedIdentity, expand, merge
from .pairs import ConvScan, find_conv_bn_pairs, find_identity_branches
from .rep import calibrate_anchors, match_filter_norms, rep_to_local
from .steps import branch_step_scales
from .spec import build, detect_form, merge_state_dict, strip_prefixes, structure
from .errors import AlignmentError, NotMergeableError, ReparamError, ReparamModeError
from .invariants import InvariantError
from .geometry import ConvGeometry
from . import kinds
from .kinds import BranchKind, get_kind, kind_names, kind_registered, register_kind, unregister_kind
from .testing import assert_equivalent, randomize_bn_, rel_err

__all__ = [
    "install_torchvision_fix",
    # errors
    "ReparamError",
    "AlignmentError",
    "NotMergeableError",
    "ReparamModeError",
    "InvariantError",
    "invariants",
    # geometry, transforms, branches
    "ConvGeometry",
    "transforms",
    "KINDS",
    "DEFAULT_BRANCHES",
    "DEPTHWISE_BRANCHES",
    "ANCHOR_NORMS",
    "applicability",
    "FrozenIdentityBN",
    "IdentityBasedConv1x1",
    "ConvBNBranch",
    "OneByOneKxKBranch",
    "AvgBranch",
    "IdentityBranch",
    # branch-kind registry: a new kind is a BranchKind subclass plus register_kind
    "kinds",
    "builtin_kinds",
    "BranchKind",
    "CentredConvKind",
    "register_kind",
    "unregister_kind",
    "get_kind",
    "kind_names",
    "kind_registered",
    # block and whole-model API
    "DiverseBranchBlock",
    "StructureChange",
    "apply_to_optimizer",
    "ConvScan",
    "find_conv_bn_pairs",
    "find_identity_branches",
    "FoldedIdentity",
    "expand",
    "SCRATCH_INIT",
    "merge",
    "structure",
    "build",
    "merge_state_dict",
    "detect_form",
    "strip_prefixes",
    "iter_blocks",
    "rep_to_local",
    "calibrate_anchors",
    "match_filter_norms",
    "branch_step_scales",
    # testing
    "testing",
    "assert_equivalent",
    "randomize_bn_",
    "rel_err",
]

# ---------------------------------------------------------------------------------------------
# Names of reparam.saliency / reparam.dymm / reparam.flops / reparam.changes are appended below
# this line (imports and __all__ additions).
# ---------------------------------------------------------------------------------------------

from . import dymm, flops, planning, saliency  # reparam.dymm.dymm(...) is the DYMM operation
from .dymm import DymmReport, classify_branches, plan_bottom_up, shrink_to_budget, update_optimizer
from .flops import block_macs, branch_macs, conv_macs, input_sizes, model_macs, train_macs
from .saliency import SaliencyMeter
from . import hostforms  # conv subclasses and norm+activation BatchNorms (timm's StdConv2d, BatchNormAct2d ...)
from .hostforms import NormActTail, SamePadConv2d, conv_form

__all__ += [
    "hostforms",
    "NormActTail",
    "SamePadConv2d",
    "conv_form",
    "dymm",
    "flops",
    "planning",
    "saliency",
    "conv_macs",
    "branch_macs",
    "block_macs",
    "input_sizes",
    "model_macs",
    "train_macs",
    "SaliencyMeter",
    "plan_bottom_up",
    "classify_branches",
    "shrink_to_budget",
    "DymmReport",
    "update_optimizer",
]
