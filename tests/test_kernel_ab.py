"""bench/kernel_ab.py: another copy of the kernels built beside this checkout's in one process, both timed in turns on
the same products, which are compared to the bit."""

import shutil

import pytest

from inferlab.bench import kernel_ab as ab
from inferlab.kernels.build import CSRC, cpu_gemv_available


@pytest.mark.full  # compiles a copy of gemv.cpp: ~25 s of both cores where nothing else runs
def test_a_copy_with_other_activation_codes_differs_only_where_they_are_read(tmp_path):
    if not cpu_gemv_available():
        pytest.skip("no CPU kernels on this machine")
    other = tmp_path / "csrc"
    shutil.copytree(CSRC, other)
    gemv = other / "gemv.h"
    codes = "constexpr float kInt16Max = 16383;"
    assert codes in gemv.read_text()
    gemv.write_text(gemv.read_text().replace(codes, "constexpr float kInt16Max = 16000;"))  # int8/int4 activations
    results = ab.compare(other, ["fp32", "int8"], [1, 3], rounds=2)
    assert [(c.format, c.rows, c.same) for c in results] == [
        ("fp32", 1, True),
        ("fp32", 3, True),
        ("int8", 1, False),
        ("int8", 3, False),
    ]
    assert all(c.ratio > 0 and min(c.gflops) > 0 for c in results)
