"""A parameter spec that no call could satisfy (or that would accept the wrong values) is
refused where it is written, or at registration, never at the first call."""

import pickle

import pytest

from quack import registry
from quack.errors import ParamError
from quack.params import Bool, Choice, Config, Dtype, Float, Int, Tuple
from quack.runtime.jit import jit_cache


@pytest.mark.parametrize(
    "make, exc, words",
    [
        # a str: `value in "ab"` accepted "a", "b", "ab" and ""
        (
            lambda: Choice("ab"),
            TypeError,
            "Choice(...): choices='ab' is not allowed; choices must be a tuple of strings",
        ),
        (lambda: Choice(()), ValueError, "Choice(...): choices=() allows no value"),
        (
            lambda: Choice(("a", 1)),
            TypeError,
            "Choice(...): choice 1 is not allowed; choices must all be strings",
        ),
        (
            lambda: Int(min=10, max=1),
            ValueError,
            "Int(...): min=10 is greater than max=1, so no value is allowed",
        ),
        (lambda: Int(choices=()), ValueError, "Int(...): choices=() allows no value"),
        (
            lambda: Int(choices=64),
            TypeError,
            "Int(...): choices=64 is not allowed; choices must be a tuple of integers",
        ),
        (lambda: Int(choices=(True, 2)), TypeError, "Int(...): choice True is not allowed"),
        (
            lambda: Int(min=32, choices=(16, 64)),
            ValueError,
            "Int(...): choice 16 is outside [min, max] = [32, None]",
        ),
        # a str bound: a bare "'<' not supported between instances of 'int' and 'str'" at call time
        (lambda: Int(min="a"), TypeError, "Int(...): min='a' is not allowed; min must be an integer or None"),
        (lambda: Int(max=1.5), TypeError, "Int(...): max=1.5 is not allowed; max must be an integer or None"),
        (lambda: Float(min=1.0, max=0.0), ValueError, "Float(...): min=1.0 is greater than max=0.0"),
        (
            lambda: Float(max=float("nan")),
            ValueError,
            "Float(...): max=nan is not allowed; max must be finite",
        ),
        (
            lambda: Float(min="0"),
            TypeError,
            "Float(...): min='0' is not allowed; min must be a finite number",
        ),
        (lambda: Tuple(Int(min=3, max=2)), ValueError, "Int(...): min=3 is greater than max=2"),
        (lambda: Dtype(choices="float32"), TypeError, "Dtype(choices=...) needs a non-empty tuple"),
    ],
)
def test_bad_spec_is_refused_where_it_is_written(make, exc, words):
    with pytest.raises(exc) as ei:
        make()
    assert words in str(ei.value)


def test_good_specs_still_work():
    assert Choice(["a", "b"]) == Choice(("a", "b"))  # a list is taken, stored as a tuple
    assert Choice(("ab",)).check("m", "ab") == "ab"
    with pytest.raises(ParamError, match="parameter 'm': 'a' is not allowed"):
        Choice(("ab",)).check("m", "a")
    assert Int(min=1, max=1).check("n", 1) == 1
    assert Int(min=0, max=8, choices=(0, 8)).check("n", 8) == 8
    assert Float(min=0, max=1).check("x", 0.5) == 0.5
    assert Bool().check("b", True) is True
    for spec in (Int(min=1, max=4), Float(min=0.0), Choice(("a",)), Int(choices=(1, 2))):
        assert pickle.loads(pickle.dumps(spec)) == spec  # specs travel to workers


@pytest.mark.parametrize("params", [[Int()], None, ("n", Int())])
def test_params_not_a_dict_names_the_argument(params):
    # was: AttributeError: 'list' object has no attribute 'items'
    with pytest.raises(TypeError) as ei:
        jit_cache("test_specs_notdict", params=params)(lambda n=1: None)
    assert str(ei.value).startswith("kernel test_specs_notdict: params= must be a dict of parameter name")
    assert "test_specs_notdict" not in registry.all_specs()


def test_parameter_name_must_be_an_identifier():
    with pytest.raises(TypeError, match=r"kernel test_specs_name: parameter name 1 must be a str"):
        registry.register("test_specs_name", lambda n=1: None, {1: Int()})


@pytest.mark.parametrize(
    "spec, default, words",
    [
        (Int(max=10), 5000, "parameter 'n': 5000 is not allowed; expected an integer in [-inf, 10]"),
        (Choice(("a", "b")), "c", "parameter 'n': 'c' is not allowed; expected one of 'a', 'b'"),
        (Dtype(), "float64", "parameter 'n': 'float64' is not allowed"),
        (Bool(), 0, "parameter 'n': 0 is not allowed; expected a boolean"),
    ],
)
def test_default_outside_its_spec_is_refused_at_registration(spec, default, words):
    def compile_fn(n=default):
        raise AssertionError("never compiled")

    with pytest.raises(ParamError) as ei:
        jit_cache("test_specs_default", params={"n": spec})(compile_fn)
    e = ei.value
    assert (e.kernel, e.param) == ("test_specs_default", "n")
    assert str(e).startswith("kernel test_specs_default: the compile function's default for " + words)
    assert "change the default or widen the parameter's spec" in str(e)
    assert "test_specs_default" not in registry.all_specs()
    assert pickle.loads(pickle.dumps(e)).param == "n"


def test_a_derived_config_default_of_none_still_registers():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class C:
        s: int = 1

    spec = registry.register(
        "test_specs_derived",
        lambda n=4, c=None: None,
        {"n": Int(min=1), "c": Config(C, derive=lambda p, a: C())},
    )
    assert spec.defaults == {"n": 4, "c": None}


def test_every_shipped_and_test_kernel_still_registers():
    registry.load_packages(["quack_kernels"])
    import relkernels  # noqa: F401
    import toykernels  # noqa: F401

    names = registry.all_specs()
    assert any(n.startswith("toy_") for n in names) and any(n.startswith("rmsnorm") for n in names)
