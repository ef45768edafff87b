"""The one config path: constraints declared on the fields (``option``) and checked the same way for
config sections and method options, names read from their registries, and the config hash's
declared "added later" rule, which gives every config the hash the five special cases gave."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
import random
import subprocess
import sys
import typing
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedhetero.algorithms import BUILTIN
from fedhetero.core.run import backend as backend_mod
from fedhetero.core.common import config as C
from fedhetero.core.common import options as O
from fedhetero.core.common.config import config_hash, config_hashes, from_dict, to_dict, validate
from fedhetero.core.common.options import OPTIONS_PATH, ConfigError, MethodOptions, check_fields, from_mapping, option, require

# ---------------------------------------------------------------------------- every declared rule

SECTIONS: list[tuple[type, str, dict[str, Any]]] = [
    (C.DataConfig, "data", {}),
    (C.ModelConfig, "model", {}),
    (C.TrainConfig, "train", {}),
    (C.TierConfig, "budget.tiers[0]", {"name": "a", "ratio": 1.0, "share": 1.0}),
    (C.BudgetConfig, "budget", {}),
    (C.FaultConfig, "engine.inject_faults", {}),
    (C.EngineConfig, "engine", {}),
    (C.SessionsConfig, "sessions", {}),
    (C.RunConfig, "", {}),
]


def _options_classes() -> list[type]:
    out: dict[str, type] = {}
    for target in BUILTIN.values():
        module, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module), attr).Options
        if issubclass(cls, MethodOptions):
            out[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [out[k] for k in sorted(out)]


OPTIONS = _options_classes()
#: companion values a cross-field check needs when one field sits at its bound
COMPANIONS = {("DynamicFLOptions", "small_q"): {"large_q": 1.0}, ("DynamicFLOptions", "large_q"): {"small_q": 0.0}}


def _is_int(cls: type, name: str) -> bool:
    hint = typing.get_type_hints(cls)[name]
    return int in (hint, *typing.get_args(hint))


def _just(x: float, direction: float, integer: bool) -> float:
    """The next representable value after ``x`` towards ``direction`` (the next integer for ints)."""
    if integer:
        return int(x) + (1 if direction > x else -1)
    return math.nextafter(float(x), direction)


def _cases() -> list[tuple[type, str, dict[str, Any], str, Any, bool]]:
    """(class, prefix, base mapping, field, value, accepted) for every declared rule: each bound
    accepted at the bound (or just inside an open one) and refused just outside; each name accepted
    and an unknown one refused."""
    cases = []
    for cls, prefix, base in [*SECTIONS, *((o, OPTIONS_PATH, {}) for o in OPTIONS)]:
        for f in dataclasses.fields(cls):
            rule = O._declared(cls, f.name, O._RULE)
            if rule is None:
                continue
            extra = {**base, **COMPANIONS.get((cls.__name__, f.name), {})}
            if rule.choices is not None:
                names = rule.names()
                assert names, (cls, f.name)
                hint = typing.get_type_hints(cls)[f.name]
                tuple_valued = any(typing.get_origin(t) is tuple for t in (hint, *typing.get_args(hint)))
                if tuple_valued:
                    cases.append((cls, prefix, extra, f.name, list(names), True))
                    cases.append((cls, prefix, extra, f.name, [names[-1], "no-such-name"], False))
                else:
                    cases += [(cls, prefix, extra, f.name, n, True) for n in names]
                    bogus: Any = "no-such-name" if isinstance(names[0], str) else max(names) + 1
                    cases.append((cls, prefix, extra, f.name, bogus, False))
                continue
            integer = _is_int(cls, f.name)
            for bound, closed, outward in ((rule.ge, True, -math.inf), (rule.gt, False, -math.inf),
                                           (rule.le, True, math.inf), (rule.lt, False, math.inf)):
                if bound is None:
                    continue
                inward = -outward
                at = bound if closed else _just(bound, inward, integer)
                outside = _just(bound, outward, integer) if closed else bound
                number = int if integer else float
                cases.append((cls, prefix, extra, f.name, number(at), True))
                cases.append((cls, prefix, extra, f.name, number(outside), False))
    return cases


CASES = _cases()


def test_every_section_and_every_method_declares_its_rules():
    classes = {c[0] for c in CASES}
    assert {s[0] for s in SECTIONS} <= classes
    assert len(OPTIONS) >= 25 and set(OPTIONS) - classes <= {O.MethodOptions}
    assert len(CASES) > 250


@pytest.mark.parametrize(
    "cls, prefix, base, name, value, accepted",
    CASES,
    ids=[f"{c[0].__name__}.{c[3]}={c[4]!r}:{'ok' if c[5] else 'bad'}" for c in CASES],
)
def test_a_declared_rule_accepts_at_its_bound_and_refuses_just_outside(cls, prefix, base, name, value, accepted):
    path = f"{prefix}.{name}" if prefix else name
    data = {**base, name: value}
    if accepted:
        obj = from_mapping(cls, data, prefix)
        assert getattr(obj, name) == (tuple(value) if isinstance(value, list) else value)
        return
    with pytest.raises(ConfigError) as exc:
        from_mapping(cls, data, prefix)
    msg = str(exc.value)
    assert msg.startswith(path), msg
    assert "\n" not in msg
    if not (isinstance(value, int) and abs(value) >= 2**63):  # beyond 64 bits the type check speaks first
        assert ": must be " in msg and msg.endswith(f", got {value!r}" if not isinstance(value, list) else "'no-such-name'"), msg


@pytest.mark.parametrize("cls", OPTIONS, ids=lambda c: c.__name__)
def test_options_made_in_code_are_checked_like_a_config(cls):
    cls()  # the defaults satisfy every rule
    for c in CASES:
        if c[0] is cls and not c[5]:
            with pytest.raises(ConfigError, match=rf"^{OPTIONS_PATH}\.{c[3]}"):
                cls(**{c[3]: tuple(c[4]) if isinstance(c[4], list) else c[4]})


def test_defaults_satisfy_every_rule_and_validate_checks_code_built_configs():
    cfg = C.RunConfig()
    check_fields(cfg, "")
    validate(cfg)
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, rounds=0))
    with pytest.raises(ConfigError, match=r"^train\.rounds: must be in \[1, 1000000\], got 0$"):
        validate(bad)
    tiers = (C.TierConfig("a", -1.0, 1.0),)
    with pytest.raises(ConfigError, match=r"^budget\.tiers\[0\]\.ratio: must be > 0, got -1\.0$"):
        validate(dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget, tiers=tiers)))


def test_one_message_style():
    with pytest.raises(ConfigError, match=r"^train\.clip_grad_norm: must be > 0 or null \(null: no clipping\), got 0\.0$"):
        from_dict({"train": {"clip_grad_norm": 0}})
    with pytest.raises(ConfigError, match=r"^seed: must be in \[0, 2\^63\), got -1$"):
        from_dict({"seed": -1})
    with pytest.raises(ConfigError, match=r"^algorithm\.options\.device_momentum: must be in \[0, 1\) \(β'\), got 1\.0$"):
        from_mapping(_options("FedDUMOptions"), {"device_momentum": 1.0}, OPTIONS_PATH)
    with pytest.raises(ConfigError, match=r"^x\.y: no good$"):
        require(False, "x.y", "no good")
    require(True, "x.y", "never raised")


def _options(name: str) -> type:
    return next(o for o in OPTIONS if o.__name__ == name)


def test_a_subclass_that_changes_a_default_keeps_the_rule():
    sm = _options("FedDUServerMOptions")
    assert sm().device_momentum == 0.0
    with pytest.raises(ConfigError, match=r"^algorithm\.options\.device_momentum: must be in \[0, 1\)"):
        sm(device_momentum=1.0)


def test_nested_options_are_named_where_they_are():
    cfg = from_dict({"algorithm": {"name": "dyninit", "options": {"host": "dynamicfl", "host_options": {"small_q": 0.9, "large_q": 0.5}}},
                     "sessions": {"count": 3, "rounds": 2}, "train": {"rounds": 6}})
    from fedhetero.core.method.registry import build_algorithm

    with pytest.raises(ConfigError, match=r"^algorithm\.options\.host_options\.small_q: must be <= large_q=0\.5"):
        build_algorithm(cfg)


@dataclasses.dataclass(frozen=True)
class _Probe(MethodOptions):
    k: int = option(3, ge=1, le=5)
    p: float | None = option(None, gt=0, lt=1, note="a probability")
    name: str = option("a", choices=("a", "b"))


@settings(max_examples=300, deadline=None)
@given(
    lo=st.one_of(st.none(), st.floats(-1e6, 1e6)),
    hi=st.one_of(st.none(), st.floats(-1e6, 1e6)),
    closed_lo=st.booleans(),
    closed_hi=st.booleans(),
    value=st.floats(allow_nan=True, allow_infinity=True),
)
def test_a_rule_holds_exactly_where_its_description_says(lo, hi, closed_lo, closed_hi, value):
    assume(lo is not None or hi is not None)  # option() makes a rule only from a bound or choices
    rule = O._Rule(ge=lo if closed_lo else None, gt=None if closed_lo else lo,
                   le=hi if closed_hi else None, lt=None if closed_hi else hi)
    inside = not math.isnan(value) and (
        (lo is None or (value >= lo if closed_lo else value > lo)) and (hi is None or (value <= hi if closed_hi else value < hi))
    )
    assert rule.holds(value) == inside
    if lo is not None or hi is not None:
        text = rule.describe()
        assert text.startswith(("in [", "in (", ">= ", "> ", "<= ", "< ")), text


@settings(max_examples=200, deadline=None)
@given(k=st.integers(-10, 10), p=st.one_of(st.none(), st.floats(-2, 2)), name=st.sampled_from(["a", "b", "c", ""]))
def test_options_made_in_code_raise_exactly_when_a_rule_fails(k, p, name):
    ok = 1 <= k <= 5 and (p is None or 0 < p < 1) and name in ("a", "b")
    try:
        _Probe(k=k, p=p, name=name)
    except ConfigError as exc:
        assert not ok and str(exc).startswith("algorithm.options.")
        if p is not None and not 0 < p < 1 and 1 <= k <= 5:
            assert str(exc) == f"algorithm.options.p: must be in (0, 1) or null (a probability), got {p!r}"
    else:
        assert ok


def test_option_refuses_contradictory_declarations():
    with pytest.raises(TypeError):
        option(1, ge=0, choices=(1, 2))
    with pytest.raises(TypeError):
        option(1, ge=0, gt=0)


# ---------------------------------------------------------------------------- names from one registry


def test_names_come_from_their_registries():
    from fedhetero.data import DATASETS, PARTITIONS
    from fedhetero.models import list_models
    from reparam.kinds import kind_names

    rules = {(cls, f.name): O._declared(cls, f.name, O._RULE) for cls, _, _ in SECTIONS for f in dataclasses.fields(cls)}
    assert rules[(C.DataConfig, "dataset")].names() == tuple(DATASETS)
    assert rules[(C.DataConfig, "partition")].names() == tuple(PARTITIONS)
    assert rules[(C.ModelConfig, "name")].names() == tuple(list_models())
    assert rules[(C.EngineConfig, "backend")].names() == backend_mod.backend_names()
    assert O._declared(_options("DynamicFLOptions"), "branches", O._RULE).names() == tuple(kind_names())
    # the back-end and budget modules use the very tables the config checks against
    assert backend_mod.BACKENDS is C.BACKENDS and backend_mod.EXTERNAL_BACKENDS is C.EXTERNAL_BACKENDS
    from fedhetero.core.hetero import budget

    assert budget.SCENARIOS is C.SCENARIOS == typing.get_args(typing.get_type_hints(C.BudgetConfig)["scenario"])


def test_a_registered_back_end_is_accepted_by_the_config():
    with pytest.raises(ConfigError, match=r"^engine\.backend: must be one of 'local', 'process', 'flower'"):
        from_dict({"engine": {"backend": "mine"}})
    backend_mod.register_backend("mine", "somewhere:Backend")
    try:
        assert from_dict({"engine": {"backend": "mine"}}).engine.backend == "mine"
    finally:
        C.BACKENDS.remove("mine")


def test_pathological_partition_runs_from_a_config_with_shards_per_client_classes():
    from fedhetero.core.local.context import build_data

    cfg = from_dict({"data": {"dataset": "synthetic", "synthetic_size": 200, "num_clients": 6, "min_partition_size": 2,
                              "partition": "pathological", "shards_per_client": 3}})
    fd = build_data(cfg)
    assert fd.info["classes_per_client"] == 3
    labels = fd.train.labels_np
    assert [len(set(labels[idx].tolist())) for idx in fd.client_indices] == [3] * 6


def test_the_config_module_does_not_import_torch():
    code = "import sys, fedhetero.core.common.configfile as c; c.parse_yaml('a: 1'); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------- the config hash

_UNHASHED_BEFORE = {"engine": ("backend", "workers")}


def _reference_hash(cfg, unhashed=C.RESUMABLE) -> str:
    """config.py's _hash before the added-later rule was declared on the fields (copied verbatim)."""
    data = to_dict(cfg)
    for section, keys in unhashed.items():
        for key in keys:
            data.get(section, {}).pop(key, None)
    data.pop("loggers", None)  # added later and never hashed: loggers change no number
    # fields added later are hashed only when set, so runs made before them can still be resumed
    if not cfg.sessions.count:
        data.pop("sessions", None)
    if cfg.data.group_overlap == 0.0:
        data["data"].pop("group_overlap", None)
    if cfg.data.val_fraction == 0.0:
        data["data"].pop("val_fraction", None)
    # engine.vectorize: its default became null (auto); false, the old default, is hashed now
    # (config_hashes also accepts the hash without it, see test_vectorize_false_resumes_old_runs)
    if cfg.engine.vectorize is None:
        data["engine"].pop("vectorize", None)
    if cfg.engine.min_cohort == 4:
        data["engine"].pop("min_cohort", None)
    if cfg.engine.cohort_memory_mb == 2048.0:
        data["engine"].pop("cohort_memory_mb", None)
    if cfg.model.weights is None:
        data["model"].pop("weights", None)
    if not cfg.model.weights_partial:
        data["model"].pop("weights_partial", None)
    if cfg.train.lr_decay == 0.99:
        data["train"].pop("lr_decay", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _random_config(rng: random.Random) -> dict[str, Any]:
    pick = rng.choice
    count = pick([0, 0, 1, 2, 3])
    s_rounds = rng.randint(1, 6)
    n = pick([2, 4, 6, 10])
    cfg: dict[str, Any] = {
        "seed": rng.randint(0, 2**40),
        "threads": pick([None, 1, 2]),
        "dtype": pick(["float32", "float64"]),
        "data": {
            "dataset": pick(["digits", "synthetic", "cifar10", "femnist"]),
            "partition": pick(["dirichlet", "iid", "shards", "pathological", "session_groups"]),
            "num_clients": n,
            "alpha": pick([0.1, 0.5, 3.0]),
            "group_overlap": pick([0.0, 0.0, -0.0, 0.25, 0.5]),
            "val_fraction": pick([0.0, 0.0, 0.1, 0.5]),
            "server_fraction": pick([0.0, 0.1]),
            "augment": pick([True, False]),
        },
        "model": {
            "name": pick(["lenet5", "resnet18", "logreg"]),
            "width": pick([0.25, 1.0]),
            "weights": pick([None, None, "w.pt", ""]),
            "weights_partial": pick([False, False, True]),
        },
        "train": {
            "rounds": count * s_rounds if count else rng.randint(1, 50),
            "lr": pick([0.01, 0.05, 0.1]),
            "local_steps": pick([None, 5]),
            "lr_schedule": pick(["constant", "cosine"]),
        },
        "budget": {"scenario": pick(["static", "random"]), "change": pick([0.0, 0.05])},
        "algorithm": pick([{"name": "fedavg"}, {"name": "fedprox", "options": {"mu": pick([0.0, 0.1])}}]),
        "engine": {
            "backend": pick(["local", "process", "flower"]),
            "workers": pick([None, 2]),
            "client_timeout_s": pick([None, 30.0]),
            "min_clients": pick([1, 2]),
            "vectorize": pick([None, None, False, True]),
            "inject_faults": {"rate": pick([0.0, 0.5]), "kinds": pick([["raise"], ["raise", "nan"]])},
        },
        "sessions": {"count": count, "rounds": s_rounds, "transition_window": pick([1, 10]),
                     "eval_on_session_classes": pick([True, False])},
    }
    for key in rng.sample(["threads", "dtype", "budget", "sessions", "engine"], rng.randint(0, 3)):
        cfg.pop(key)  # a key left out takes its default
    return cfg


def test_config_hash_is_the_hash_the_special_cases_gave():
    rng = random.Random(1234)
    seen = set()
    for _ in range(400):
        cfg = from_dict(_random_config(rng))
        assert config_hash(cfg) == _reference_hash(cfg)
        accepted = {_reference_hash(cfg), _reference_hash(cfg, _UNHASHED_BEFORE)}
        if cfg.engine.vectorize is False:  # and the hashes from when false was the default
            accepted |= {_reference_hash(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, vectorize=None)), u)
                         for u in (C.RESUMABLE, _UNHASHED_BEFORE)}
        assert config_hashes(cfg) == accepted
        seen.add(config_hash(cfg))
    assert len(seen) > 390  # the configs differ


def test_config_hash_of_configs_made_in_code():
    """Values no YAML file would hold (a sessions section with count 0 but other settings, -0.0)."""
    base = C.RunConfig()
    variants = [
        dataclasses.replace(base, sessions=C.SessionsConfig(count=0, rounds=7, devices=((0,),))),
        dataclasses.replace(base, sessions=C.SessionsConfig(count=2, rounds=15)),
        dataclasses.replace(base, data=dataclasses.replace(base.data, group_overlap=-0.0, val_fraction=0.2)),
        dataclasses.replace(base, model=dataclasses.replace(base.model, weights="", weights_partial=True)),
        dataclasses.replace(base, engine=dataclasses.replace(base.engine, vectorize=True, backend="process")),
    ]
    for cfg in variants:
        assert config_hash(cfg) == _reference_hash(cfg)
    assert config_hash(variants[0]) == config_hash(base)  # count 0: no sessions, whatever else is set


def test_the_default_config_keeps_the_hash_its_run_directories_recorded():
    assert config_hash(from_dict({})) == "74188c554e6e08cfab2ad6caadc748a2434cf7cdf1c5fa20f091e6049f44e97d"


def test_vectorize_false_resumes_old_runs():
    """Run directories made while ``engine.vectorize: false`` was the default (and so left out of
    the hash) still resume with it set to false."""
    import hashlib
    import json

    cfg = dataclasses.replace(C.RunConfig(), engine=dataclasses.replace(C.RunConfig().engine, vectorize=False))
    data = C.to_dict(cfg)
    data.pop("loggers", None)
    data.pop("sessions", None)
    for key in (*C.RESUMABLE["engine"], "vectorize", "min_cohort", "cohort_memory_mb"):
        data["engine"].pop(key, None)
    for key in ("group_overlap", "val_fraction"):
        data["data"].pop(key, None)
    for key in ("weights", "weights_partial"):
        data["model"].pop(key, None)
    data["train"].pop("lr_decay", None)
    old = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    assert old != C.config_hash(cfg)
    assert old in C.config_hashes(cfg)
    assert old == C.config_hash(C.RunConfig())  # what the old default hashed to
