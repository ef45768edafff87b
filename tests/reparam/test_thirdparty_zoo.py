"""reparam on a zoo of timm and torchvision architectures (tiny variants, float64, random weights).

For every model: the expansion is bit-exact in train mode (same random numbers for dropout and
drop-path) and in eval mode, the deploy and host merges are exact (``≤ 1e-10`` scale-relative; the
host merge loads strictly into a freshly built model), every conv is either expanded or skipped with
a reason in ``reparam.structure(model)["skipped"]``, and weight-standardised convs refuse the host
target with ``NotMergeableError`` (see :mod:`reparam.hostforms`). Weights and BatchNorm statistics
are perturbed before and after expansion (:func:`reparam.testing.perturb_`), so no check is vacuous.

Run as a script, it prints the coverage table of ``docs/results.md`` ("reparam on timm and
torchvision models"): per family, the expanded / candidate (``1 < max(K) ≤ 5``) convs and the reasons
of the convs left plain::

    python tests/reparam/test_thirdparty_zoo.py
"""

from __future__ import annotations

import copy
import functools
import importlib
import sys
from collections import Counter, defaultdict
from typing import Any, Callable

import pytest
import torch
from torch import nn

import reparam
from reparam.errors import NotMergeableError
from reparam.testing import perturb_, rel_err

F64 = torch.float64
TOL = 1e-10


# ---------------------------------------------------------------------------------------------
# the zoo: (family, name, builder); every builder makes a tiny variant with 10 classes


def _require(module: str) -> Any:
    """Import ``timm`` / ``torchvision`` (through reparam's torchvision import repair), or skip."""
    try:
        if module == "torchvision":
            return reparam._compat.import_torchvision()
        reparam._compat.import_torchvision()
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        pytest.skip(f"{module} unavailable: {type(exc).__name__}: {exc}")


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        timm = _require("timm")
        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)

    build.__name__ = name
    return build


def _tv(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torchvision = _require("torchvision")
        return getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs)

    build.__name__ = name
    return build


def _tv_densenet() -> nn.Module:
    _require("torchvision")
    from torchvision.models import DenseNet

    return DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, bn_size=2, num_classes=10)


def _bit_resnetv2() -> nn.Module:
    """BiT ResNet-V2 (StdConv2d + GroupNormAct), one block per stage."""
    _require("timm")
    from timm.layers import StdConv2d
    from timm.models.resnetv2 import ResNetV2

    return ResNetV2(layers=[1, 1, 1, 1], channels=(128, 128, 256, 256), num_classes=10, stem_type="fixed",
                    conv_layer=functools.partial(StdConv2d, eps=1e-8))


def _bn_stdconv_resnetv2() -> nn.Module:
    """ResNet-V2 with StdConv2d and BatchNormAct2d (timm's ``resnetv2_*`` with ``conv_layer=StdConv2d``)."""
    _require("timm")
    from timm.layers import BatchNormAct2d, StdConv2d
    from timm.models.resnetv2 import ResNetV2

    return ResNetV2(layers=[1, 1, 1, 1], channels=(32, 48, 64, 96), num_classes=10, stem_type="fixed",
                    conv_layer=StdConv2d, norm_layer=BatchNormAct2d)


def _tv_resnet() -> nn.Module:
    _require("torchvision")
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _paired(path: str, conv: nn.Conv2d, bn: nn.Module | None) -> Any:
    """Plan for pre-activation DenseNet, whose 3×3 convs have no BatchNorm of their own (they expand
    through bias sinks, :func:`reparam.pairs.find_bias_sinks`): every conv paired with a BatchNorm,
    1×1 included, and every 3×3–5×5 conv, each requested explicitly (a failure raises)."""
    return "default" if bn is not None or 1 < max(conv.kernel_size) <= 5 else None


_NF_SMALL = {"depths": (1, 1, 1, 1), "channels": (32, 48, 64, 96)}
#: expand() options of the models whose default expansion finds (almost) nothing to expand
EXPAND_KWARGS: dict[str, dict[str, Any]] = {
    "densenet121": {"plan": _paired},
    "tv.densenet": {"plan": _paired},
    "resnetv2_bit (GroupNorm)": {"allow_new_bias": True},
}

ZOO: list[tuple[str, str, Callable[[], nn.Module]]] = [
    ("EfficientNet", "efficientnet_b0", _timm("efficientnet_b0")),
    ("EfficientNet", "tinynet_e", _timm("tinynet_e")),
    ("EfficientNet", "efficientnet_lite0", _timm("efficientnet_lite0")),
    ("EfficientNet", "tv.efficientnet_b0", _tv("efficientnet_b0")),
    ("EfficientNet (TF 'same')", "tf_efficientnet_b0", _timm("tf_efficientnet_b0")),
    ("EfficientNet (TF 'same')", "tf_efficientnet_lite0", _timm("tf_efficientnet_lite0")),
    ("MobileNetV2", "mobilenetv2_035", _timm("mobilenetv2_035")),
    ("MobileNetV2", "tv.mobilenet_v2", _tv("mobilenet_v2", width_mult=0.35)),
    ("MobileNetV3", "mobilenetv3_small_050", _timm("mobilenetv3_small_050")),
    ("MobileNetV3", "tf_mobilenetv3_small_minimal_100", _timm("tf_mobilenetv3_small_minimal_100")),
    ("MobileNetV3", "tv.mobilenet_v3_small", _tv("mobilenet_v3_small", width_mult=0.5)),
    ("RegNet", "regnetx_002", _timm("regnetx_002")),
    ("RegNet", "regnety_002", _timm("regnety_002")),
    ("RegNet", "tv.regnet_x_400mf", _tv("regnet_x_400mf")),
    ("MixNet", "mixnet_s", _timm("mixnet_s")),
    ("MixNet", "tf_mixnet_s", _timm("tf_mixnet_s")),
    ("LCNet", "lcnet_035", _timm("lcnet_035")),
    ("LCNet", "lcnet_050", _timm("lcnet_050")),
    ("DPN", "dpn48b", _timm("dpn48b", k_sec=(1, 1, 1, 1))),
    ("DPN", "dpn68", _timm("dpn68", k_sec=(1, 1, 1, 1))),
    ("CSPNet / CSPDarknet", "cs3darknet_focus_s", _timm("cs3darknet_focus_s")),
    ("CSPNet / CSPDarknet", "cs3darknet_s", _timm("cs3darknet_s")),
    ("VoVNet", "ese_vovnet19b_slim_dw", _timm("ese_vovnet19b_slim_dw")),
    ("VoVNet", "ese_vovnet19b_slim", _timm("ese_vovnet19b_slim")),
    ("MobileViT", "mobilevit_xxs", _timm("mobilevit_xxs")),
    ("MobileViT", "mobilevitv2_050", _timm("mobilevitv2_050")),
    ("ResNet", "resnet10t", _timm("resnet10t")),
    ("ResNet", "test_resnet", _timm("test_resnet")),
    ("ResNet", "tv.resnet (BasicBlock, 1-1-1-1)", _tv_resnet),
    ("ResNet-D", "resnet18d", _timm("resnet18d", layers=(1, 1, 1, 1))),
    ("ResNeXt", "resnext50_32x4d", _timm("resnext50_32x4d", layers=(1, 1, 1, 1))),
    ("ResNeXt", "seresnext26t_32x4d", _timm("seresnext26t_32x4d", layers=(1, 1, 1, 1))),
    ("DenseNet", "densenet121", _timm("densenet121", growth_rate=8, block_config=(2, 2, 2, 2))),
    ("DenseNet", "tv.densenet", _tv_densenet),
    ("NFNet (ScaledStdConv)", "test_nfnet", _timm("test_nfnet")),
    ("NFNet (ScaledStdConv)", "nf_regnet_b0", _timm("nf_regnet_b0", **_NF_SMALL)),
    ("NFNet (ScaledStdConv)", "dm_nfnet_f0", _timm("dm_nfnet_f0", depths=(1, 1, 1, 1), channels=(64, 128, 128, 256),
                                                    group_size=32)),
    ("ResNetV2 (StdConv)", "resnetv2_bit (GroupNorm)", _bit_resnetv2),
    ("ResNetV2 (StdConv)", "resnetv2 (StdConv + BatchNormAct2d)", _bn_stdconv_resnetv2),
    ("ConvNeXt", "convnext_atto", _timm("convnext_atto")),
    ("ConvNeXt", "test_convnext3", _timm("test_convnext3")),
    ("GhostNet", "ghostnet_050", _timm("ghostnet_050")),
    ("RepVGG / MobileOne", "repvgg_a0", _timm("repvgg_a0")),
    ("RepVGG / MobileOne", "mobileone_s0", _timm("mobileone_s0")),
    ("Other", "mnasnet_small", _timm("mnasnet_small")),
    ("Other", "tv.shufflenet_v2_x0_5", _tv("shufflenet_v2_x0_5")),
    ("Other", "test_byobnet", _timm("test_byobnet")),
]

INPUT = 48


def _candidates(model: nn.Module) -> list[str]:
    """Paths of the convs the default plan considers (``1 < max(K) ≤ 5``)."""
    return [p for p, m in model.named_modules() if isinstance(m, nn.Conv2d) and 1 < max(m.kernel_size) <= 5]


def _convs(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(m, nn.Conv2d)]


def _build(builder: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return builder().to(F64)


def _has_standardized_block(model: nn.Module) -> bool:
    return any(blk.host_form is not None and blk.host_form.standardized for _, blk in reparam.iter_blocks(model))


# ---------------------------------------------------------------------------------------------
# the test


@pytest.mark.parametrize(("name", "builder"), [(n, b) for _, n, b in ZOO], ids=[n for _, n, _ in ZOO])
def test_zoo_model_expands_and_merges_exactly(name: str, builder: Callable[[], nn.Module]) -> None:
    gen = torch.Generator().manual_seed(0)
    model = perturb_(_build(builder), gen)
    x = torch.randn(2, 3, INPUT, INPUT, generator=gen, dtype=F64)

    options = EXPAND_KWARGS.get(name, {})
    expanded = reparam.expand(model, **options)
    spec = reparam.structure(expanded)
    blocks = dict(reparam.iter_blocks(expanded))
    assert blocks, "no conv was expanded"
    # every conv of the host model is a block now or is reported with a reason
    for path in _convs(model):
        assert path in blocks or spec["skipped"].get(path), f"{path}: neither expanded nor skipped with a reason"

    # expansion: bit-exact in train mode (same random numbers) and in eval mode
    for train in (True, False):
        a, b = copy.deepcopy(model).train(train), copy.deepcopy(expanded).train(train)
        torch.manual_seed(1)
        ya = a(x)
        torch.manual_seed(1)
        yb = b(x)
        assert torch.equal(ya, yb), f"train={train}: expansion not bit-exact (rel_err {rel_err(yb, ya):.2e})"
        if train:  # the host BNs of the blocks updated their statistics exactly as before
            for (na, ta), (nb, tb) in zip(_running_stats(a), _running_stats(b)):
                assert torch.equal(ta, tb), f"{na} / {nb}: running statistics differ"

    # merges: exact in eval mode once every parameter and statistic has moved
    perturb_(expanded, gen).eval()
    y = expanded(x)
    deploy = reparam.merge(expanded, target="deploy")
    assert not list(reparam.iter_blocks(deploy))
    assert rel_err(deploy(x), y) <= TOL
    if _has_standardized_block(expanded):
        with pytest.raises(NotMergeableError, match="weight-standardised"):
            reparam.merge(expanded, target="host")
        return
    host = reparam.merge(expanded, target="host")
    assert rel_err(host(x), y) <= TOL
    if options.get("allow_new_bias"):
        return  # the new biases are extra host keys by design
    fresh = _build(builder)
    fresh.load_state_dict(host.state_dict(), strict=True)
    assert [type(m) for m in fresh.modules()] == [type(m) for m in host.modules()]
    assert rel_err(fresh.eval()(x), y) <= TOL


def _running_stats(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The host BatchNorms' running statistics, keyed by the BN object (blocks keep host BNs)."""
    out = []
    seen = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None and id(m) not in seen:
            seen.add(id(m))
            if "branches." in name and not name.endswith("branches.kxk.bn"):
                continue  # new branch BNs have no host counterpart
            out.append((name, m.running_mean))
    return out


# ---------------------------------------------------------------------------------------------
# coverage report (python tests/reparam/test_thirdparty_zoo.py)


def coverage() -> tuple[dict[str, list[int]], dict[str, Counter]]:
    """Per family: [models, candidates, expanded by default, expanded with allow_new_bias=True];
    per family: Counter of the default expansion's skip reasons (candidates only)."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    reasons: dict[str, Counter] = defaultdict(Counter)
    for family, _, builder in ZOO:
        model = _build(builder)
        expanded = reparam.expand(model)
        blocks = dict(reparam.iter_blocks(expanded))
        skipped = reparam.structure(expanded)["skipped"]
        with_bias = dict(reparam.iter_blocks(reparam.expand(model, allow_new_bias=True)))
        cands = _candidates(model)
        c = counts[family]
        c[0] += 1
        c[1] += len(cands)
        c[2] += sum(p in blocks for p in cands)
        c[3] += sum(p in with_bias for p in cands)
        for p in cands:
            if p not in blocks:
                reasons[family][_short(skipped.get(p, "(no reason)"))] += 1
    return dict(counts), dict(reasons)


def _short(reason: str) -> str:
    return reason.split(";")[0].split(": it is not")[0][:140]


def main() -> None:
    counts, reasons = coverage()
    print("| family | models | 3×3–5×5 convs | expanded | coverage | with `allow_new_bias=True` |")
    print("|---|---:|---:|---:|---:|---:|")
    tot = [0, 0, 0, 0]
    for family, row in counts.items():
        tot = [t + v for t, v in zip(tot, row)]
        m, c, e, b = row
        print(f"| {family} | {m} | {c} | {e} | {100 * e / max(c, 1):.0f} % | {100 * b / max(c, 1):.0f} % |")
    m, c, e, b = tot
    print(f"| **all** | {m} | {c} | {e} | **{100 * e / max(c, 1):.1f} %** | {100 * b / max(c, 1):.1f} % |")
    print()
    print("Candidate convs left plain, by reason:")
    print()
    for family, cnt in reasons.items():
        for reason, n in cnt.most_common():
            print(f"- {family} ({n}): {reason}")


if __name__ == "__main__":
    sys.exit(main())
