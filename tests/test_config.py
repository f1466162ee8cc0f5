"""The RECOMPUTE switch, recompute_scope, and the decorator's own contract."""

import inspect
import subprocess
import sys

import pytest

import keras_recompute
from keras_recompute import is_enabled, recompute_grad, recompute_scope


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "On"])
def test_true_values(monkeypatch, value):
    monkeypatch.setenv("RECOMPUTE", value)
    assert is_enabled() is True


@pytest.mark.parametrize("value", ["0", "false", "No", " OFF ", "", "  "])
def test_false_values(monkeypatch, value):
    monkeypatch.setenv("RECOMPUTE", value)
    assert is_enabled() is False


def test_unset_is_off():
    assert is_enabled() is False


@pytest.mark.parametrize("value", ["2", "enable", "y", "truee"])
def test_bad_value_names_variable_and_value(monkeypatch, value):
    monkeypatch.setenv("RECOMPUTE", value)
    with pytest.raises(ValueError, match=rf"RECOMPUTE={value!r}"):
        is_enabled()


def test_bad_value_raises_when_a_decorated_call_runs(monkeypatch):
    decorated = recompute_grad(lambda x: x)
    monkeypatch.setenv("RECOMPUTE", "maybe")
    with pytest.raises(ValueError, match="keras_recompute: .*RECOMPUTE='maybe'"):
        decorated(1)


def test_switch_is_read_at_call_time_not_import(monkeypatch):
    seen = []
    import keras_recompute._decorator as decorator_module

    monkeypatch.setattr(
        decorator_module, "_dispatch", lambda context, args, kwargs: lambda fn, a, k, context, check, policy: seen.append("recompute")
    )
    decorated = recompute_grad(lambda x: seen.append("plain"))
    decorated(0)
    monkeypatch.setenv("RECOMPUTE", "1")
    decorated(0)
    monkeypatch.setenv("RECOMPUTE", "0")
    decorated(0)
    assert seen == ["plain", "recompute", "plain"]


def test_scope_overrides_environment_and_nests(monkeypatch):
    monkeypatch.setenv("RECOMPUTE", "1")
    with recompute_scope(False):
        assert not is_enabled()
        with recompute_scope(True):
            assert is_enabled()
        assert not is_enabled()
    assert is_enabled()


def test_scope_rejects_non_bool():
    with pytest.raises(TypeError, match="recompute_scope.*received 'yes'"):
        with recompute_scope("yes"):
            pass


def test_enabled_option_fixes_the_choice(monkeypatch):
    import keras_recompute._decorator as decorator_module

    monkeypatch.setattr(
        decorator_module, "_dispatch", lambda context, args, kwargs: lambda fn, a, k, context, check, policy: "recompute"
    )
    always = recompute_grad(enabled=True)(lambda: "plain")
    never = recompute_grad(enabled=False)(lambda: "plain")
    assert always() == "recompute"
    with recompute_scope(True):
        assert never() == "plain"


def test_off_calls_the_original_function_directly():
    calls = []

    def fn(x, *, scale=1):
        calls.append((x, scale))
        return x * scale

    decorated = recompute_grad(fn)
    assert decorated(3, scale=2) == 6
    assert calls == [(3, 2)]
    assert decorated.__wrapped__ is fn
    assert inspect.signature(decorated) == inspect.signature(fn)
    assert decorated.__name__ == "fn"


def test_decorator_argument_errors():
    with pytest.raises(TypeError, match=r"recompute_grad\(enabled=True\)"):
        recompute_grad(True)
    with pytest.raises(TypeError, match="enabled=.*received 'yes'"):
        recompute_grad(enabled="yes")
    with pytest.raises(TypeError, match="received 3 of type int"):
        recompute_grad(3)


def test_a_decorated_class_is_refused_with_where_the_decorator_goes():
    """`@recompute_grad` over a class would wrap its constructor: the layers it makes would never recompute."""

    class Block:
        def call(self, inputs):
            return inputs

    for decorate in (recompute_grad, recompute_grad(policy="save_dots")):
        with pytest.raises(TypeError, match=r"not a class; received the class Block\. Put @recompute_grad on its call"):
            decorate(Block)
    assert recompute_grad(Block.call).__wrapped__ is Block.call  # its call method is what to decorate


def test_public_surface():
    assert set(keras_recompute.__all__) >= {
        "recompute_grad",
        "recompute_model",
        "recompute_scope",
        "is_enabled",
        "RecomputeError",
    }


def test_import_imports_no_framework():
    code = (
        "import sys, keras_recompute\n"
        "loaded = [m for m in ('tensorflow', 'keras', 'tf_keras', 'jax', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "f = keras_recompute.recompute_grad(lambda x: x + 1)\n"
        "assert f(1) == 2\n"
        "loaded = [m for m in ('tensorflow', 'keras', 'tf_keras', 'jax', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_keras_adapters_import_only_what_lies_below_them():
    """The Keras flavours' adapters (docs/design.md, "Shape") import only each other and the modules below them,
    anywhere in their source (a function's own import included): `_context` and the backends import them, never
    the other way (`_tf_keras` once imported `_context` for one helper, now in `_patch`)."""
    import ast
    import os

    package = os.path.dirname(keras_recompute.__file__)
    adapters = {"_keras3", "_tf_keras", "_keras2", "_tf_keras_builtin"}
    below = {"keras_recompute._errors", "keras_recompute._patch", "keras_recompute.backends._tf_private"}
    allowed = below | {"keras_recompute.backends." + name for name in adapters}
    for name in sorted(adapters) + ["_tf_private"]:
        with open(os.path.join(package, "backends", name + ".py"), encoding="utf-8") as source:
            tree = ast.parse(source.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from keras_recompute.backends import _keras2` names the module imported.
                imported |= {node.module + "." + alias.name if node.module in ("keras_recompute", "keras_recompute.backends")
                             else node.module for alias in node.names}
        ours = {module for module in imported if module.split(".")[0] == "keras_recompute"}
        assert ours <= (below if name == "_tf_private" else allowed), (name, sorted(ours - allowed))
