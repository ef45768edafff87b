"""One way to register a name (fedhetero.core.common.names.Registry): methods, back ends and
loggers share it; the zoo's register_model is a decorator too."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedhetero.core.common import config as C
from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.names import Registry
from fedhetero.core.method.registry import ALGORITHMS
from fedhetero.core.run import loggers as L


def test_methods_back_ends_and_loggers_are_registries_of_lazy_built_ins():
    import sys

    assert isinstance(ALGORITHMS, Registry) and isinstance(C.BACKENDS, Registry) and isinstance(C.LOGGERS, Registry)
    assert {"fedavg", "dynamicfl"} <= set(ALGORITHMS.names())
    assert C.BACKENDS.names() == ("local", "process") and set(C.LOGGERS.names()) >= {"tensorboard", "mlflow"}
    # listing names imported nothing; a lookup imports the entry
    assert C.BACKENDS.get("local").__name__ == "LocalBackend" and "fedhetero.backends.local" in sys.modules
    with pytest.raises(ConfigError, match=r"^engine\.backend: unknown back end 'nope'; available: local, process"):
        C.BACKENDS.get("nope")


@settings(max_examples=50, deadline=None)
@given(names=st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=6, unique=True))
def test_a_registry_keeps_its_names_in_order_and_refuses_a_taken_one(names):
    reg: Registry[object] = Registry("field.x", "thing", {"builtin": "math:pi"}, check=lambda o: None if callable(o) else "not callable")
    for n in names:
        if n == "builtin":
            continue
        reg.register(n)(len)
    added = [n for n in names if n != "builtin"]
    assert reg.names() == ("builtin", *added) and all(n in reg for n in added)
    assert reg.get("builtin") == pytest.approx(3.14159265)
    with pytest.raises(ValueError, match="already exists"):
        reg.add("builtin", len)
    if added:
        reg.add(added[0], len)  # the same object again is no conflict
        with pytest.raises(ValueError, match="already exists"):
            reg.add(added[0], abs)
        reg.remove(added[0])
        assert added[0] not in reg
    with pytest.raises(TypeError, match="not callable"):
        reg.add("zzzzz", 3)
    with pytest.raises(KeyError, match="unknown thing"):
        reg.get("qqqqq")


def test_a_logger_registered_by_decorator_is_accepted_by_the_config(tmp_path):
    @L.register_logger("quiet-test")
    class Quiet(L.Logger):
        pass

    try:
        assert from_dict({"loggers": ["quiet-test"]}).loggers == ("quiet-test",)
        assert L.logger_class("quiet-test") is Quiet
    finally:
        C.LOGGERS.remove("quiet-test")
    with pytest.raises(ConfigError, match="loggers"):
        from_dict({"loggers": ["quiet-test"]})


def test_a_zoo_model_registers_with_a_decorator():
    from torch import nn

    from fedhetero.models import build_model, list_models, register_model, unregister_model

    @register_model("tiny_test_net")
    class Tiny(nn.Module):
        def __init__(self, *, num_classes: int = 10, **_: object) -> None:
            super().__init__()
            self.fc = nn.Linear(4, num_classes)

    try:
        assert "tiny_test_net" in list_models()
        assert isinstance(build_model("tiny_test_net", num_classes=3), Tiny)
    finally:
        unregister_model("tiny_test_net")
