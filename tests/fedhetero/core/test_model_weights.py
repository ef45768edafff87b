"""Model-weights files (``model.weights``, loaded by the client context): a foreign or damaged file is
refused with one line that names it (never a raw torch/pickle exception), a partial state dict only
when ``model.weights_partial`` says so, and the setting is hashed only when set."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhetero.cli import main
from fedhetero.core.common.config import config_hash, from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.context import client_context


RUN = ["--set", "train.rounds=1", "--set", "threads=1", "--set", "data.num_clients=2", "--set", "data.min_partition_size=1"]


def run_cli(args: list[str], out: Path, capsys) -> tuple[int, str]:
    """Exit code and stderr (stripped) of ``fedhetero train ARGS``."""
    capsys.readouterr()
    rc = main(["train", *args, *RUN, "--out", str(out), "--quiet"])
    return rc, capsys.readouterr().err.strip()


def assert_one_line(err: str, *needles: str) -> None:
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fedhetero: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    for raw in ("Traceback", "list index out of range", "KeyError: 101", "invalid literal", "set FEDHETERO_DEBUG"):
        assert raw not in err, err


# ------------------------------------------------------------------------------------------------
# model.weights
# ------------------------------------------------------------------------------------------------
SYNTH = {"dataset": "synthetic", "num_clients": 2, "synthetic_size": 20, "min_partition_size": 1}


def weights_cfg(path: Path, partial: bool = False):
    return from_dict({"data": SYNTH, "model": {"name": "lenet5", "weights": str(path), "weights_partial": partial},
                      "train": {"rounds": 1}})


def lenet_state() -> dict[str, torch.Tensor]:
    from fedhetero import models

    torch.manual_seed(3)
    return models.build_model("lenet5", num_classes=10, in_channels=3, input_size=32).state_dict()


def _truncated_torch_file(path: Path) -> None:
    torch.save(lenet_state(), path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


FOREIGN_WEIGHTS = {
    "passwd": lambda p: p.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n"),
    "text": lambda p: p.write_text("hello weights\n"),
    "empty": lambda p: p.write_bytes(b""),
    "truncated": _truncated_torch_file,
    "numpy_inside": lambda p: torch.save({"conv1.conv.weight": np.zeros(3)}, p),
    "a_list": lambda p: torch.save([torch.zeros(2)], p),
    "nested": lambda p: torch.save({"model": {"w": torch.zeros(2)}, "epoch": 3}, p),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN_WEIGHTS))
def test_weights_file_that_is_no_state_dict_is_one_line(tmp_path, capsys, kind):
    path = tmp_path / f"{kind}.pt"
    FOREIGN_WEIGHTS[kind](path)
    with pytest.raises(ConfigError) as err:
        client_context(weights_cfg(path))
    msg = str(err.value)
    assert msg.startswith("model.weights: ") and str(path) in msg and "not a PyTorch state-dict file" in msg
    assert len(msg.splitlines()) == 1
    if kind in ("passwd", "text"):  # through the command line: exit 2, one line
        rc, err_line = run_cli(["--set", "data.dataset=synthetic", "--set", "data.synthetic_size=20",
                                "--set", f"model.weights={path}"], tmp_path / "run", capsys)
        assert rc == 2
        assert_one_line(err_line, "config error: model.weights", str(path), "not a PyTorch state-dict file")


def test_weights_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="model.weights: cannot read .*nothing.pt"):
        client_context(weights_cfg(tmp_path / "nothing.pt"))


def test_partial_weights_refused_with_count_unless_asked(tmp_path, capsys, caplog):
    state = lenet_state()
    path = tmp_path / "one.pt"
    torch.save({"conv1.conv.weight": state["conv1.conv.weight"]}, path)
    with pytest.raises(ConfigError) as err:
        client_context(weights_cfg(path))
    msg = str(err.value)
    # 16 tensors: lenet5's 18 state-dict entries less its two num_batches_tracked counters
    assert "holds 1 of the 16 tensors of the lenet5 model" in msg and str(path) in msg
    assert "model.weights_partial=true" in msg and "'conv1.bn.weight'" in msg
    rc, line = run_cli(["--set", "data.dataset=synthetic", "--set", "data.synthetic_size=20",
                        "--set", f"model.weights={path}"], tmp_path / "run", capsys)
    assert rc == 2
    assert_one_line(line, "model.weights", str(path), "1 of the 16 tensors")
    # asked for: the one tensor is loaded and the count reported
    with caplog.at_level(logging.WARNING, logger="fedhetero.core.local.context"):
        ctx = client_context(weights_cfg(path, partial=True))
        model = ctx.build_model()
    assert torch.equal(model.conv1.conv.weight.detach().cpu(), state["conv1.conv.weight"])
    assert not torch.equal(model.fc1.weight.detach().cpu(), state["fc1.weight"])
    reports = [r.getMessage() for r in caplog.records if "weights_partial" in r.getMessage()]
    assert len(reports) == 1 and "loaded 1 of the 16 tensors" in reports[0] and "other 15" in reports[0]


def test_complete_weights_load_and_unused_extra_entries_are_allowed(tmp_path):
    state = lenet_state()
    path = tmp_path / "full.pt"
    torch.save({**state, "head.weight": torch.zeros(1000, 84)}, path)  # e.g. a classifier the model lacks
    model = client_context(weights_cfg(path)).build_model()
    got = {k: v.cpu() for k, v in model.state_dict().items()}
    assert all(torch.equal(got[k], state[k]) for k in state)
    # a sub-model of another width cannot be described by the file: it is built, not refused
    assert client_context(weights_cfg(path)).build_model(width=0.5) is not None


def test_weights_matching_nothing_is_an_error_even_when_partial(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"backbone.conv1.weight": torch.zeros(3)}, path)
    for partial in (False, True):
        with pytest.raises(ConfigError, match=r"none of the 1 tensors of .*other\.pt matches") as err:
            client_context(weights_cfg(path, partial))
        assert "'backbone.conv1.weight'" in str(err.value) and "'conv1.conv.weight'" in str(err.value)


def test_weights_shape_mismatch_names_the_key_even_when_partial(tmp_path):
    state = lenet_state()
    state["fc3.weight"] = torch.zeros(100, 84)  # a 100-class head for a 10-class data set
    path = tmp_path / "wrong.pt"
    torch.save(state, path)
    for partial in (False, True):
        with pytest.raises(ConfigError) as err:
            client_context(weights_cfg(path, partial))
        assert "'fc3.weight'" in str(err.value) and "[100, 84]" in str(err.value) and "[10, 84]" in str(err.value)


def test_weights_partial_is_hashed_only_when_set(monkeypatch):
    import fedhetero.core.common.config as config_mod

    base = {"data": SYNTH, "model": {"name": "lenet5"}}
    off = from_dict(base)
    on = from_dict({**base, "model": {"name": "lenet5", "weights_partial": True}})
    assert off.model.weights_partial is False and "weights_partial" in config_mod.to_dict(off)["model"]
    assert config_hash(on) != config_hash(off)
    now = config_hash(off)
    # the hash of a config without the field (as run directories made before it recorded it)
    plain = config_mod.to_dict

    def without_field(cfg):
        data = plain(cfg)
        if isinstance(cfg, config_mod.RunConfig):
            data["model"].pop("weights_partial")
        return data

    monkeypatch.setattr(config_mod, "to_dict", without_field)
    assert config_hash(off) == now
    with pytest.raises(ConfigError, match="model.weights_partial"):
        from_dict({"model": {"weights_partial": "yes"}})


def test_model_weights_file_loads_into_backbone(tmp_path):
    from fedhetero import models

    torch.manual_seed(1)
    donor = models.build_model("resnet18_proj").backbone.state_dict()
    torch.save(donor, tmp_path / "w.pt")
    cfg = from_dict({"data": {"dataset": "synthetic", "num_clients": 2, "synthetic_size": 20},
                     "model": {"name": "resnet18_proj", "weights": str(tmp_path / "w.pt")}, "train": {"rounds": 1}})
    from fedhetero.core.local.context import client_context

    ctx = client_context(cfg)
    m = ctx.build_model()
    assert torch.equal(m.backbone.conv1.weight, donor["conv1.weight"])
    torch.save({"nothing": torch.zeros(3)}, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="model.weights"):
        client_context(from_dict({"data": {"dataset": "synthetic", "num_clients": 2, "synthetic_size": 20},
                                  "model": {"name": "resnet18_proj", "weights": str(tmp_path / "bad.pt")},
                                  "train": {"rounds": 1}}))
