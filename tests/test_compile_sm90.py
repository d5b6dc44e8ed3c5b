"""The kernels compile for the H200 (sm_90) at their production settings, on any machine.

The Triton interpreter runs the kernels' arithmetic but not the GPU compiler, which alone rejects
some programs (dot shapes, layouts, shared memory over the limit). ``tests/sm90.py`` compiles them ahead
of time, a section per test; each runs in a subprocess because the kernels must be defined without the
interpreter, and the test waits for it however long the compiler takes. The grouped, single-row and
selection/cache sections run by default; the others take minutes on a CPU and are marked ``lab``
(``python -m pytest -m lab``).
"""

import os
import subprocess
import sys

import pytest

import sm90

LAB = {"single-row-wide", "invariant-fp16", "invariant-u8", "merge-planner", "arguments-of-one", "gluon"}
EXPECT = {  # lines each section prints, besides "section NAME: compiled"
    "grouped": ["grouped fp16/fp16 G=6:", "grouped bf16/bf16 G=12:", "grouped fp16/u8 G=24:"],
    "single-row": ["xqa fp16:", "xqa-direct u8:", "splitk fp16:", "splitk-few u8:"],
    "single-row-wide": ["xqa-direct-64 fp16:", "xqa-direct-128 u8:", "xqa-direct-unresolved u8:"],
    "invariant-fp16": ["invariant fp16 W=2051:", "invariant fp16 W=4096:"],
    "invariant-u8": ["invariant u8 W=2051:", "invariant u8 W=4096:"],
    "merge-planner": ["merge and planner kernels: compiled"],
    "arguments-of-one": ["arguments of 1: compiled"],
    "selection-cache": ["scores keys=True:", "top-k ", "store compressed:", "store compressed fused:", "cache write u8:"],
    "gluon": ["gluon prototype (plain, lazy):", "gluon warp-specialized prototype (V in 3, 2 buffers):"],
}


def test_every_section_is_checked():
    assert set(EXPECT) == set(sm90.SECTIONS) and LAB < set(sm90.SECTIONS)


@pytest.mark.parametrize("section", [pytest.param(s, marks=pytest.mark.lab) if s in LAB else s
                                     for s in sm90.SECTIONS])
def test_kernels_compile_for_sm90(section):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, sm90.__file__, section], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for line in EXPECT[section] + [f"section {section}: compiled"]:
        assert line in proc.stdout, (line, proc.stdout[-2000:])
