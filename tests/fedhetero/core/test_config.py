"""Config validation and defaults: every bad field gives one clear error naming it; YAML number forms
and duplicate keys; the defaults that fix the numbers (threads) and the checkpoints."""

import pytest

from fedhetero.core.common.config import config_hash, from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import apply_overrides, dump_config, load_config


def test_defaults_are_the_embedded_job():
    cfg = from_dict({})
    assert cfg.data.dataset == "digits"
    assert cfg.data.partition == "dirichlet" and cfg.data.alpha == 0.5
    assert [t.ratio for t in cfg.budget.tiers] == [1.0, 2.0, 3.0]
    assert cfg.algorithm.name == "dynamicfl"


@pytest.mark.parametrize(
    "data, field",
    [
        ({"train": {"bogus": 1}}, "train.bogus"),
        ({"nonsense": 1}, "nonsense"),
        ({"train": {"rounds": "ten"}}, "train.rounds"),
        ({"train": {"rounds": 2.5}}, "train.rounds"),
        ({"train": {"sample_rate": 0}}, "train.sample_rate"),
        ({"train": {"sample_rate": 1.5}}, "train.sample_rate"),
        ({"data": {"alpha": -1}}, "data.alpha"),
        ({"data": {"dataset": "imagenet21k"}}, "data.dataset"),
        ({"data": {"num_clients": 0}}, "data.num_clients"),
        ({"train": {"lr": 0}}, "train.lr"),
        ({"deterministic": "yes"}, "deterministic"),
        ({"budget": {"tiers": [{"name": "a", "ratio": 1, "share": 0.5}, {"name": "b", "ratio": 2, "share": 0.2}]}}, "budget.tiers"),
        ({"budget": {"tiers": [{"name": "a", "ratio": -1, "share": 1.0}]}}, "budget.tiers[0].ratio"),
        ({"budget": {"tiers": [{"name": "a", "ratio": 1}]}}, "budget.tiers[0]"),
        ({"budget": {"scenario": "sometimes"}}, "budget.scenario"),
    ],
)
def test_bad_values_name_the_field(data, field):
    with pytest.raises(ConfigError) as exc:
        from_dict(data)
    assert field in str(exc.value)
    assert "\n" not in str(exc.value)  # one line, not a traceback dump


def test_tier_shares_message_lists_the_shares():
    with pytest.raises(ConfigError, match="sum to 1"):
        from_dict({"budget": {"tiers": [{"name": "a", "ratio": 1, "share": 0.7}, {"name": "b", "ratio": 2, "share": 0.7}]}})


def test_overrides_parse_yaml_scalars():
    d = apply_overrides({}, ["train.rounds=7", "data.alpha=0.1", "train.aggregation=uniform", "data.data_dir=null"])
    cfg = from_dict(d)
    assert cfg.train.rounds == 7 and cfg.data.alpha == 0.1
    assert cfg.train.aggregation == "uniform" and cfg.data.data_dir is None
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, ["train.rounds"])


def test_yaml_round_trip_and_hash(tmp_path):
    cfg = from_dict({"train": {"rounds": 3}, "algorithm": {"name": "fedavg"}})
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    back = load_config(p)
    assert back == cfg
    assert config_hash(back) == config_hash(cfg)
    assert config_hash(from_dict({"train": {"rounds": 4}})) != config_hash(cfg)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level"):
        load_config(bad)


def test_checkpoint_every_round_by_default():
    assert from_dict({}).train.checkpoint_every == 1


def test_threads_are_part_of_the_config():
    cfg = from_dict({})
    assert cfg.threads == 1  # a fixed default: the same config means the same numbers


def test_yaml_number_forms_and_duplicate_keys(tmp_path):
    assert load_config(None, ["train.lr=1e-3"]).train.lr == pytest.approx(1e-3)
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 1e-3\n")
    assert load_config(p).train.lr == pytest.approx(1e-3)
    p.write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(p)
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ConfigError, match="not a text file"):
        load_config(p)
