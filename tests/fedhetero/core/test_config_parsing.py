"""Config parsing never changes a value silently, and every bad input is one line naming it.

* numbers and booleans are read as YAML 1.2 (core schema), in files and in ``--set`` values alike:
  ``010`` is 10 (YAML 1.1: 8), ``1:30`` and ``1_000`` are strings (YAML 1.1: 90 and 1000) and so a
  type error naming the field, ``yes``/``no``/``on``/``off`` are strings (YAML 1.1: booleans);
* ``<<`` merge keys load, explicit keys win over merged ones, duplicate explicit keys stay errors;
* a directory or a device given as the config file says what it is;
* a budget the method cannot meet is refused before the run, naming ``budget.tiers[i].ratio`` (or
  ``budget.min_ratio`` when falling budgets reach below the method's smallest model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from types import SimpleNamespace
from typing import Literal

import numpy as np
import pytest
import torch

from fedhetero.core.hetero import budget as budget_mod
from fedhetero.algorithms import build_algorithm
from fedhetero.cli import main
from fedhetero.core.common.config import from_dict, to_dict
from fedhetero.core.common.options import ConfigError, from_mapping
from fedhetero.core.common.configfile import apply_overrides, dump_config, load_config, parse_yaml
from fedhetero.core.local.context import ClientContext

# ---------------------------------------------------------------------------- helpers


def _one_line_error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("fedhetero: config error:"), err
    return err


def _write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------- A: YAML 1.2 numbers


@pytest.mark.parametrize(
    "text, value",
    [
        ("010", 10),  # YAML 1.1: octal 8
        ("007", 7),
        ("+12", 12),
        ("-0", 0),
        ("0o10", 8),
        ("0x10", 16),
        ("0xFf", 255),
        ("1e-3", 1e-3),  # YAML 1.1: the string '1e-3'
        ("1E3", 1000.0),
        ("-.5", -0.5),
        ("+.5e1", 5.0),
        ("1.", 1.0),
        ("true", True),
        ("True", True),
        ("TRUE", True),
        ("false", False),
        ("FALSE", False),
        ("null", None),
        ("Null", None),
        ("~", None),
        ("", None),
        # strings in YAML 1.2 (YAML 1.1: 90, 1000, 5, true/false, a date)
        ("1:30", "1:30"),
        ("1_000", "1_000"),
        ("0b101", "0b101"),
        ("-0x10", "-0x10"),
        ("yes", "yes"),
        ("No", "No"),
        ("on", "on"),
        ("OFF", "OFF"),
        ("y", "y"),
        ("tRUE", "tRUE"),
        ("nULL", "nULL"),
        ("2024-01-01", "2024-01-01"),
        ("=", "="),
    ],
)
def test_scalars_are_read_as_yaml_1_2(text, value):
    got = parse_yaml(text)
    assert got == value and type(got) is type(value)


def test_special_floats_are_read_and_refused_for_numeric_fields():
    assert parse_yaml(".inf") == float("inf") and parse_yaml("-.Inf") == float("-inf")
    assert np.isnan(parse_yaml(".NaN"))
    for bad in ("train.lr=.inf", "train.lr=-.INF", "train.lr=.nan", "data.alpha=1e400"):
        with pytest.raises(ConfigError, match=bad.split("=")[0] + ": expected a finite number"):
            load_config(None, [bad])
    for bad in ("train.rounds=.inf", "seed=.nan"):
        with pytest.raises(ConfigError, match=bad.split("=")[0] + ": expected an integer"):
            load_config(None, [bad])


def test_set_reads_numbers_as_yaml_1_2():
    cfg = load_config(None, ["seed=010", "train.rounds=010", "train.eval_every=0x2", "train.lr=1e-3"])
    assert cfg.seed == 10 and cfg.train.rounds == 10 and cfg.train.eval_every == 2
    assert cfg.train.lr == pytest.approx(1e-3)
    assert load_config(None, ["seed=0o10"]).seed == 8


def test_config_files_read_numbers_as_yaml_1_2(tmp_path):
    p = _write(tmp_path, "seed: 010\ntrain:\n  rounds: 012\n  lr: 5e-4\ndata:\n  augment: TRUE\n  data_dir: 2024-01-01\n")
    cfg = load_config(p)
    assert cfg.seed == 10 and cfg.train.rounds == 12 and cfg.train.lr == pytest.approx(5e-4)
    assert cfg.data.augment is True and cfg.data.data_dir == "2024-01-01"


@pytest.mark.parametrize(
    "override, field, hint",
    [
        ("train.rounds=1:30", "train.rounds", "base-60"),  # YAML 1.1: 90
        ("train.rounds=1_000", "train.rounds", "digit separators"),  # YAML 1.1: 1000
        ("train.lr=1_0.5", "train.lr", "digit separators"),
        ("seed=0b101", "seed", ""),  # YAML 1.1: 5
        ("train.rounds=3.0", "train.rounds", "whole number"),
        ("train.rounds=1e3", "train.rounds", "whole number"),
        ("threads=2.0", "threads", "whole number"),
        ("train.rounds=true", "train.rounds", ""),
        ("data.augment=yes", "data.augment", "true or false"),  # YAML 1.1: true
        ("data.augment=off", "data.augment", "true or false"),
        ("deterministic=1", "deterministic", "true or false"),
        ("model.name=1e3", "model.name", "quote it"),
        ("seed=123456789012345678901234567890", "seed", "out of range"),
        ("data.shards_per_client=99999999999999999999", "data.shards_per_client", "out of range"),
    ],
)
def test_yaml_1_1_forms_and_wrong_types_name_the_field(override, field, hint):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    msg = str(exc.value)
    assert msg.startswith(f"{field}:") and "\n" not in msg, msg
    assert hint in msg


def test_the_same_forms_in_a_file_name_the_field(tmp_path):
    for text, field in (("train:\n  rounds: 1:30\n", "train.rounds"), ("seed: 1_000\n", "seed"),
                        ("data:\n  augment: on\n", "data.augment")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.") + ": expected"):
            load_config(_write(tmp_path, text))


def test_words_yaml_1_1_read_as_booleans_stay_strings():
    assert load_config(None, ["data.data_dir=on"]).data.data_dir == "on"
    assert load_config(None, ["budget.tiers=[{name: no, ratio: 1, share: 1}]"]).budget.tiers[0].name == "no"
    with pytest.raises(ConfigError, match="device: expected 'cpu'"):
        load_config(None, ["device=off"])


def test_huge_numbers_and_numpy_values():
    with pytest.raises(ConfigError, match="data.alpha: expected a finite number") as exc:
        from_dict({"data": {"alpha": 10**400}})  # int -> float overflows
    assert len(str(exc.value)) < 200  # the number is shortened in the message
    cfg = from_dict({"seed": np.int64(3), "train": {"lr": np.float32(0.5)}})
    assert cfg.seed == 3 and type(cfg.seed) is int
    assert cfg.train.lr == 0.5 and type(cfg.train.lr) is float
    with pytest.raises(ConfigError, match="train.rounds: expected an integer"):
        from_dict({"train": {"rounds": np.bool_(True)}})


def test_values_that_would_fail_later_are_refused_up_front():
    # a worker count is a count of processes started at once
    with pytest.raises(ConfigError, match=r"^engine\.workers: must be in \[1, \d+\] or null .*, got 100000$"):
        load_config(None, ["engine.workers=100000"])
    with pytest.raises(ConfigError, match="^config: expected a mapping of RunConfig fields"):
        from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^train: expected a mapping of TrainConfig fields, got 3"):
        load_config(None, ["train=3"])


@dataclasses.dataclass
class _OneOrTwo:
    x: Literal[1, 2] = 2


def test_literal_values_match_by_type():
    assert from_mapping(_OneOrTwo, {"x": 1}, "").x == 1
    with pytest.raises(ConfigError, match="x: expected one of 1, 2, got True"):
        from_mapping(_OneOrTwo, {"x": True}, "")
    with pytest.raises(ConfigError, match="x: expected one of 1, 2, got 1.0"):
        from_mapping(_OneOrTwo, {"x": 1.0}, "")


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match=r"^budget\.tiers\[0\]: missing required key 'share'$"):
        from_dict({"budget": {"tiers": [{"name": "a", "ratio": 1}]}})
    with pytest.raises(ConfigError, match=r"^budget\.tiers\[0\]: missing required keys 'ratio', 'share'$"):
        from_dict({"budget": {"tiers": [{"name": "a"}]}})


def test_dump_quotes_strings_yaml_1_2_would_read_as_numbers(tmp_path):
    tiers = [{"name": "1e3", "ratio": 1, "share": 0.5}, {"name": "0o7", "ratio": 2, "share": 0.5}]
    cfg = from_dict({"budget": {"tiers": tiers}, "data": {"data_dir": "yes"}})
    text = dump_config(cfg)
    assert "name: '1e3'" in text and "name: '0o7'" in text and "data_dir: 'yes'" in text
    p = _write(tmp_path, text)
    assert load_config(p) == cfg


def test_overrides_copy_the_data_without_json():
    data = {"budget": {"tiers": ({"name": "a", "ratio": 1, "share": 1},)}, "train": {"rounds": 2}}
    out = apply_overrides(data, ["train.rounds=3"])
    assert data["train"]["rounds"] == 2 and out["train"]["rounds"] == 3  # the input is not changed
    assert out["budget"]["tiers"] == [{"name": "a", "ratio": 1, "share": 1}]
    # a shared subtree (a YAML alias) is copied once, not expanded
    shared = {"x": list(range(3))}
    loop = apply_overrides({"a": shared, "b": shared}, [])
    assert loop["a"] is loop["b"] and loop["a"] is not shared
    with pytest.raises(ConfigError, match="empty part"):
        apply_overrides({}, ["train..rounds=3"])
    with pytest.raises(ConfigError, match=r"^--set budget\.tiers: duplicate key 'name'"):
        apply_overrides({}, ["budget.tiers=[{name: a, name: b}]"])
    # text that is not YAML at all is taken as a string, as before
    assert apply_overrides({}, ["data.data_dir=[oops"])["data"]["data_dir"] == "[oops"


def test_set_values_are_not_reinterpreted_through_the_cli(tmp_path, capsys):
    err = _one_line_error(capsys, ["train", "--set", "train.rounds=1:30", "--out", str(tmp_path / "r"), "--quiet"])
    assert "train.rounds" in err and "'1:30'" in err
    assert not (tmp_path / "r").exists()


def test_invalid_yaml_is_one_line_with_its_position(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, "train:\n  rounds: [1, 2\n"))
    msg = str(exc.value)
    assert "not valid YAML" in msg and "line " in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="not valid YAML: '1_000' is not an integer in YAML 1.2"):
        load_config(_write(tmp_path, "seed: !!int 1_000\n"))


# ---------------------------------------------------------------------------- B: merge keys


def test_merge_keys_load_and_explicit_keys_win(tmp_path):
    text = (
        "budget:\n"
        "  tiers:\n"
        "    - &small {name: small, ratio: 1.0, share: 0.5}\n"
        "    - <<: *small\n"
        "      name: large\n"
        "      ratio: 3.0\n"
    )
    cfg = load_config(_write(tmp_path, text))
    assert [(t.name, t.ratio, t.share) for t in cfg.budget.tiers] == [("small", 1.0, 0.5), ("large", 3.0, 0.5)]


def test_merge_of_several_mappings_earlier_wins():
    got = parse_yaml("a: &a {x: 1, y: 2}\nb: &b {x: 5, z: 6}\nc:\n  <<: [*a, *b]\n  y: 9\n")
    assert got["c"] == {"x": 1, "y": 9, "z": 6}


def test_merge_keeps_duplicate_checks(tmp_path):
    with pytest.raises(ConfigError, match="duplicate key 'name' \\(line 6\\)"):
        load_config(_write(tmp_path, "budget:\n  tiers:\n    - &s {name: s, ratio: 1, share: 1}\n    - <<: *s\n      name: a\n      name: b\n"))
    with pytest.raises(ConfigError, match="duplicate key '<<'"):
        parse_yaml("a: &a {x: 1}\nb:\n  <<: *a\n  <<: *a\n")
    with pytest.raises(ConfigError, match="not valid YAML: expected a mapping or list of mappings for merging"):
        load_config(_write(tmp_path, "base: &b 3\ntrain:\n  <<: *b\n"))


# ---------------------------------------------------------------------------- C: what the path is


def test_config_path_that_is_not_a_file_says_what_it_is(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a config file"):
        load_config(tmp_path)
    if os.path.exists("/dev/null"):
        with pytest.raises(ConfigError, match=r"is not a regular file \(a character device\)"):
            load_config("/dev/null")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="symbolic link to a missing file"):
        load_config(link)


def test_cli_config_directory_and_device(tmp_path, capsys):
    err = _one_line_error(capsys, ["train", "--config", str(tmp_path), "--out", str(tmp_path / "r"), "--quiet"])
    assert "is a directory, not a config file" in err and "not found" not in err
    if os.path.exists("/dev/null"):
        err = _one_line_error(capsys, ["train", "--config", "/dev/null", "--out", str(tmp_path / "r"), "--quiet"])
        assert "/dev/null: is not a regular file" in err
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------- D: budgets

SHORT = ["--set", "train.rounds=1", "--set", "threads=1"]


@pytest.mark.parametrize("algorithm", ["dynamicfl", "heterofl"])
def test_cli_refuses_a_tier_the_method_cannot_meet(tmp_path, capsys, algorithm):
    out = tmp_path / "r"
    err = _one_line_error(capsys, [
        "train", *SHORT, "--set", f"algorithm.name={algorithm}",
        "--set", "budget.tiers=[{name: a, ratio: 1, share: 0.5}, {name: b, ratio: 0.01, share: 0.5}]",
        "--out", str(out), "--quiet",
    ])
    assert f"budget.tiers[1].ratio: {algorithm} cannot train within 0.01× the plain model" in err
    assert "its smallest model needs" in err and "Raise the ratio to at least" in err
    assert not out.exists()  # refused before the run made anything


def test_cli_runs_at_the_ratio_the_message_names(tmp_path, capsys):
    sets = [*SHORT, "--set", "algorithm.name=dynamicfl", "--set", "data.num_clients=4", "--set", "train.local_epochs=1"]
    err = _one_line_error(capsys, ["train", *sets, "--set", "budget.tiers=[{name: a, ratio: 0.01, share: 1}]",
                                   "--out", str(tmp_path / "r"), "--quiet"])
    ratio = err.rsplit("at least ", 1)[1].split()[0].rstrip(".")
    out = tmp_path / "ok"
    # train.rounds=01 is one round (YAML 1.2), not an octal surprise
    rc = main(["train", *sets, "--set", "train.rounds=01", "--set", f"budget.tiers=[{{name: a, ratio: {ratio}, share: 1}}]",
               "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["all_fit_budget"] and not summary.get("dropped_clients")


def test_cli_refuses_a_min_ratio_falling_budgets_would_reach(tmp_path, capsys):
    err = _one_line_error(capsys, [
        "train", *SHORT, "--set", "algorithm.name=dynamicfl", "--set", "budget.scenario=decreasing",
        "--set", "budget.change=0.5", "--set", "budget.min_ratio=0.01",
        "--set", "budget.tiers=[{name: a, ratio: 0.09, share: 1}]", "--out", str(tmp_path / "r"), "--quiet",
    ])
    assert "budget.min_ratio: dynamicfl cannot train within 0.045× the plain model" in err
    assert "Raise budget.min_ratio to at least" in err


# function level: every method with a floor

FLOORED = [
    ("dynamicfl", {}),
    ("heterofl", {}),
    ("fedrolex", {}),
    ("splitmix", {}),
    ("splitmix", {"atom_width": 0.5}),
    ("feddf", {}),
    ("fedet", {"rep_dim": 16}),
    ("dsfl", {}),
    ("fedavg_small", {}),
    ("dyninit", {"host": "dynamicfl"}),
]


def _cfg(algorithm: str, options: dict | None = None, **budget) -> object:
    return from_dict({
        "data": {"dataset": "synthetic", "num_clients": 4},
        "model": {"name": "lenet5", "width": 0.5},
        "train": {"rounds": 3},
        "budget": budget,
        "algorithm": {"name": algorithm, "options": options or {}},
    })


def _ctx(cfg) -> ClientContext:
    data = SimpleNamespace(input_shape=(3, 32, 32), num_classes=10, client_indices=[[0]] * cfg.data.num_clients)
    return ClientContext(cfg, data, torch.device("cpu"))


def _tiers(*ratios: float) -> list[dict]:
    return [{"name": f"t{i}", "ratio": r, "share": 1 / len(ratios)} for i, r in enumerate(ratios)]


@pytest.mark.parametrize("algorithm, options", FLOORED)
def test_every_floor_is_refused_below_and_accepted_at_the_suggested_ratio(algorithm, options):
    ctx = _ctx(_cfg(algorithm, options))
    floor = build_algorithm(_cfg(algorithm, options)).min_budget_macs(ctx)
    assert floor is not None and 0 < floor
    plain = ctx.plain_macs
    below = floor / plain * (1 - 1e-6)
    cfg = _cfg(algorithm, options, tiers=_tiers(1.0, below))
    with pytest.raises(ConfigError) as exc:
        budget_mod.check_budgets(cfg, build_algorithm(cfg), ctx)
    msg = str(exc.value)
    assert msg.startswith(f"budget.tiers[1].ratio: {algorithm} cannot train within") and "\n" not in msg
    suggested = float(msg.rsplit("at least ", 1)[1].split()[0].rstrip("."))
    assert suggested * plain >= floor > below * plain
    ok = _cfg(algorithm, options, tiers=_tiers(1.0, suggested))
    budget_mod.check_budgets(ok, build_algorithm(ok), ctx)  # no error


def test_dynamicfl_floor_is_the_smallest_pruning_plan():
    import reparam
    from fedhetero.algorithms.pruning.surgery import BudgetError, plan_for_budget

    cfg = _cfg("dynamicfl")
    ctx = _ctx(cfg)
    floor = build_algorithm(cfg).min_budget_macs(ctx)
    plain = reparam.merge(ctx.build_model().eval(), target="deploy")  # the plain architecture DynamicFL prunes
    spec = plan_for_budget(plain, ctx.input_shape, floor, criterion="magnitude")
    assert spec is not None
    with pytest.raises(BudgetError):
        plan_for_budget(plain, ctx.input_shape, floor - 1, criterion="magnitude")


@pytest.mark.parametrize("algorithm", ["heterofl", "feddf", "splitmix"])
def test_width_floor_is_the_narrowest_width_the_planner_finds(algorithm):
    from fedhetero.core.hetero.widths import WidthPlanner

    cfg = _cfg(algorithm)
    ctx = _ctx(cfg)
    floor = build_algorithm(cfg).min_budget_macs(ctx)
    planner = WidthPlanner(ctx)
    assert planner.try_width_for(floor) is not None
    assert planner.try_width_for(floor - 1) is None


def test_setup_itself_refuses_instead_of_the_planner_error():
    """The width methods' set-up would fail in the width planner first ("no width of the model fits
    the budget of ... MACs", naming no field): it refuses with the field-naming error instead."""
    from fedhetero.core.local.context import Context, RunContext

    cfg = _cfg("heterofl", tiers=_tiers(0.001))
    data = SimpleNamespace(input_shape=(3, 32, 32), num_classes=10, client_indices=[[0]] * 4)
    ctx = Context.__new__(Context)
    RunContext.__init__(ctx, cfg, data, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^budget\.tiers\[0\]\.ratio: heterofl cannot train"):
        build_algorithm(cfg).setup(ctx)


def test_methods_without_a_floor_accept_any_ratio():
    for algorithm, options in (("fedavg", {}), ("fedap", {}), ("fedavg_small", {"width": 0.25})):
        cfg = _cfg(algorithm, options, tiers=_tiers(0.001))
        algo = build_algorithm(cfg)
        ctx = _ctx(cfg)
        assert algo.min_budget_macs(ctx) is None
        budget_mod.check_budgets(cfg, algo, ctx)


def test_min_ratio_counts_the_rounds_budgets_can_fall():
    # the floor of DynamicFL's lenet5 at width 0.5 is about 0.26× the plain model
    short = _cfg("dynamicfl", scenario="decreasing", change=0.05, min_ratio=0.1)
    budget_mod.check_budgets(short, build_algorithm(short), _ctx(short))  # 0.95^3 of 1× never gets there
    for scenario in ("decreasing", "random"):
        long = from_dict({**_as_dict(short), "train": {"rounds": 200},
                          "budget": {"scenario": scenario, "change": 0.05, "min_ratio": 0.1}})
        with pytest.raises(ConfigError, match=r"^budget\.min_ratio: dynamicfl cannot train within 0\.1×"):
            budget_mod.check_budgets(long, build_algorithm(long), _ctx(long))
    # increasing budgets never fall; no change: nothing falls either
    for scenario, change in (("increasing", 0.05), ("decreasing", 0.0)):
        cfg = from_dict({**_as_dict(short), "train": {"rounds": 200},
                         "budget": {"scenario": scenario, "change": change, "min_ratio": 0.1}})
        budget_mod.check_budgets(cfg, build_algorithm(cfg), _ctx(cfg))


def _as_dict(cfg) -> dict:
    return to_dict(cfg)


@pytest.mark.parametrize("algorithm", ["heterofl", "fedrolex", "splitmix"])
def test_width_methods_follow_falling_budgets_below_their_floor(algorithm):
    """They stop local training at a budget below their smallest model (their protocol), so
    budget.min_ratio is not refused for them."""
    cfg = from_dict({**_as_dict(_cfg(algorithm)), "train": {"rounds": 500},
                     "budget": {"scenario": "decreasing", "change": 0.3, "min_ratio": 1e-6}})
    algo = build_algorithm(cfg)
    assert algo.trains_below_floor
    budget_mod.check_budgets(cfg, algo, _ctx(cfg))


def test_check_budgets_leaves_torch_rng_alone():
    cfg = _cfg("fedet", {"rep_dim": 16})
    ctx = _ctx(cfg)
    state = torch.get_rng_state()
    budget_mod.check_budgets(cfg, build_algorithm(cfg), ctx)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("floor, plain", [(26034, 416520), (36020, 416520), (1, 3), (5, 5), (7, 1), (123456789, 1000)])
def test_suggested_ratio_is_the_smallest_three_digit_ratio_that_fits(floor, plain):
    """The ratio a refusal tells the user to set (a method whose smallest model needs ``floor`` MACs,
    a plain model of ``plain`` MACs, a tier far below)."""
    cfg = from_dict({"budget": {"tiers": [{"name": "low", "ratio": 0.001, "share": 1}]}})
    method = SimpleNamespace(min_budget_macs=lambda ctx: floor)
    with pytest.raises(ConfigError) as err:
        budget_mod.check_budgets(cfg, method, SimpleNamespace(plain_macs=plain))
    r = float(re.search(r"Raise the ratio to at least ([0-9.e+]+?)(?: \(|\.$)", str(err.value)).group(1))
    assert r * plain >= floor
    digits = 2 - int(np.floor(np.log10(floor / plain)))
    assert (r - 10.0**-digits) * plain < floor
