"""The shared argument checks and helpers of ``qsa.utils``."""

import argparse

import numpy as np
import pytest
import torch

import qsa
import qsa.utils


@pytest.mark.parametrize("x", [torch.tensor(1 + 2j), torch.tensor([0.5j], dtype=torch.complex64)])
def test_as_finite_float_refuses_complex_tensors(x):
    with pytest.raises(TypeError, match="k_scale"):
        qsa.utils.as_finite_float("k_scale", x)


@pytest.mark.parametrize("x", [10**400, -(10**400)], ids=["10**400", "-10**400"])
def test_float_checks_refuse_ints_too_large_for_a_float(x):
    with pytest.raises(ValueError, match="k_scale must be finite"):
        qsa.utils.as_finite_float("k_scale", x)
    with pytest.raises(ValueError, match="v_scale must be finite"):
        qsa.utils.check_positive_float("v_scale", x)


def test_check_bool_takes_python_and_numpy_bools_only():
    assert qsa.utils.check_bool("flag", True) is True
    assert qsa.utils.check_bool("flag", np.bool_(False)) is False
    for bad, name in ((1, "int"), (np.int64(0), "numpy.int64"), ("yes", "str"), (None, "NoneType"),
                      (torch.tensor(True), "torch.Tensor")):
        with pytest.raises(TypeError, match=f"flag must be a bool, got {name}$"):
            qsa.utils.check_bool("flag", bad)


def test_type_names_say_where_a_type_comes_from():
    assert qsa.utils.type_name(1.5) == "float"
    assert qsa.utils.type_name(np.float32(1)) == "numpy.float32"
    with pytest.raises(TypeError, match="x must be an int, got numpy.float64"):
        qsa.utils.check_int("x", np.float64(2))


def test_float_checks_still_take_numbers():
    assert qsa.utils.as_finite_float("x", 2) == 2.0
    assert qsa.utils.as_finite_float("x", torch.tensor(0.5)) == 0.5
    assert qsa.utils.as_finite_float("x", 10**300) == 1e300
    qsa.utils.check_positive_float("x", 10**300)
    with pytest.raises(ValueError, match="x must be finite"):
        qsa.utils.as_finite_float("x", float("inf"))
    with pytest.raises(TypeError, match="x"):
        qsa.utils.as_finite_float("x", 1j)


@pytest.mark.parametrize("n,want", [(-3, 1), (0, 1), (1, 1), (2, 2), (3, 4), (16, 16), (17, 32),
                                    (np.int64(5), 8)])
def test_next_pow2(n, want):
    assert qsa.utils.next_pow2(n) == want


@pytest.mark.parametrize("n", [2.5, 3.0, True, "4", None])
def test_next_pow2_refuses_non_integers(n):
    with pytest.raises(TypeError, match="n must be an int"):
        qsa.utils.next_pow2(n)


@pytest.mark.parametrize("t", [torch.empty(0, 1).expand(0, 5), torch.empty(3, 0, 4).as_strided((3, 0, 4), (0, 0, 0)),
                               torch.empty(0)])
def test_overlaps_itself_empty_tensor(t):
    assert t.numel() == 0
    assert not qsa.utils.overlaps_itself(t)


def test_overlaps_itself():
    assert qsa.utils.overlaps_itself(torch.empty(1, 5).expand(3, 5))
    assert not qsa.utils.overlaps_itself(torch.empty(3, 5))
    assert not qsa.utils.overlaps_itself(torch.empty(4, 6)[:, ::2])


def test_check_tensor_device_compares_like_same_device():
    t = torch.zeros(2)
    for device in ("cpu", "cpu:0", torch.device("cpu", 0), torch.device("cpu")):
        qsa.utils.check_tensor("x", t, device=device)
    with pytest.raises(ValueError, match="x must be on meta"):
        qsa.utils.check_tensor("x", t, device="meta")


def test_int_in_range():
    parse = qsa.utils.int_in_range(1, 4)
    assert parse("1") == 1 and parse("4") == 4
    for text in ("0", "5", "x", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"\[1, 4\]"):
            parse(text)


def test_seed_range_is_what_torch_generators_take():
    for seed in (qsa.utils.SEED_MIN, qsa.utils.SEED_MAX, qsa.utils.SEED_MAX + 1):  # + 1: the first layer's seed
        torch.Generator().manual_seed(seed)
