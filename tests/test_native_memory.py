"""native_memory: freed native memory handed back to the system (glibc), measured in fresh interpreters."""

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import torch
from inferlab.api import memory_mib
from inferlab.native_memory import large_frees_returned

def resident_after_frees():
    before, _ = memory_mib()
    for _ in range(4):  # glibc's sliding threshold rises past 24 MiB at the first free; the next ones come from its heap
        block = torch.ones(6 << 20)  # 24 MiB, every page written
        del block
    return memory_mib()[0] - before

if {inside}:
    with large_frees_returned():
        print(resident_after_frees())
else:
    print(resident_after_frees())
"""


def kept_mib(inside: bool) -> float:
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(inside=inside)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return float(result.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator and its mallopt")
def test_large_frees_leave_nothing_resident_inside_the_block():
    assert kept_mib(inside=False) >= 20  # what loading's temporaries did before: the last one stays in the heap
    assert kept_mib(inside=True) < 4
