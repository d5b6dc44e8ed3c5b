"""Ahead-of-time compilation of Triton kernels for the H200 (sm_90) on a machine without a GPU.

The interpreter does not catch what only the GPU compiler rejects (dot shapes, layouts, shared
memory); compiling for sm_90 here does, and reports registers, spills and shared memory.
"""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget


def compile_sm90(kernel, pointers: dict, constexprs: dict, floats=(), num_warps=4, num_stages=2,
                 divisible=None):
    """Compile ``kernel`` for sm_90; ``pointers`` maps pointer args to Triton dtypes ("*fp16").

    As a real launch would, pointers and the args named in ``divisible`` (default: every
    ``stride_*`` argument) are marked divisible by 16.
    """
    jit = kernel
    signature = {}
    attrs = {}
    for i, p in enumerate(jit.params):
        if p.name in pointers or (p.name.startswith("stride_") if divisible is None else p.name in divisible):
            attrs[(i,)] = [["tt.divisibility", 16]]
    for p in jit.params:
        name = p.name
        if p.is_constexpr:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled, resource_usage(compiled)


def resource_usage(compiled) -> dict:
    """Registers, stack, local memory (spills) and shared memory of a compiled kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    usage = {k: int(v) for k, v in zip(("regs", "stack", "shared_static", "local"), m.groups())} if m else {}
    usage["shared"] = compiled.metadata.shared
    usage["mma"] = "wgmma" if "wgmma" in compiled.asm["ptx"] else ("mma" if "mma.sync" in compiled.asm["ptx"] else "none")
    return usage
