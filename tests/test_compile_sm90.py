"""The kernels compile for the H200 (sm_90) at their production settings, on any machine.

The Triton interpreter runs the kernels' arithmetic but not the GPU compiler, which alone rejects
some programs (dot shapes, layouts, shared memory over the limit). ``tests/sm90.py`` compiles them ahead
of time; it runs in a subprocess because the kernels must be defined without the interpreter.
"""

import os
import subprocess
import sys


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "sm90.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "grouped fp16/fp16 G=6" in proc.stdout and "merge and planner kernels: compiled" in proc.stdout
    assert "arguments of 1: compiled" in proc.stdout
    assert "top-k 32768:" in proc.stdout and "cache write u8:" in proc.stdout
    assert "gluon prototype (plain, lazy):" in proc.stdout
    assert "gluon warp-specialized prototype (V in 3, 2 buffers):" in proc.stdout
