"""Compile the three kernels ahead of time for a CUDA arch, without a GPU (run as a script).

The interpreter runs kernels as Python and accepts things the compiler rejects (type mismatches,
shared-memory overflow), so the CPU tests also compile the bf16 kernels, with the tiles the host
code picks on a GPU, for sm_80 and sm_90 (triton ships ptxas). Prints `name arch shared_bytes`.
Must run without TRITON_INTERPRET (kernels must be JITFunctions).
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron_mecefo.kernels import triton_lowrank as tk  # noqa: E402


def _compile(fn, arch: int, pointer_types: dict[str, str], constexprs: dict, cfg) -> int:
    names = fn.arg_names
    signature = {name: pointer_types.get(name, "i32") for name in names}
    for name in constexprs:  # tiles, flags, and the unit strides Triton specializes at launch
        signature[name] = "constexpr"
    src = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
    )
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
    return kernel.metadata.shared


def main() -> None:
    import torch

    dtype = torch.bfloat16
    for arch in [int(a) for a in sys.argv[1:]] or [90]:
        cfg = tk._default_tiles(dtype, "forward")
        shared = _compile(
            tk._linear_with_projection_kernel,
            arch,
            {n: "*bf16" for n in ("x_ptr", "w_ptr", "v_ptr", "y_ptr", "p_ptr")},
            dict(
                ACC_DTYPE=tl.float32,
                BLOCK_B=cfg.block_m,
                BLOCK_C=cfg.block_n,
                BLOCK_K=cfg.block_k,
                GROUP_B=8,
                UPCAST=False,
                PRECISION=tk._precision(dtype),
                stride_xn=1,
                stride_wn=1,
                stride_vr=1,
                stride_ym=1,
                stride_pr=1,
            ),  # fmt: skip
            cfg,
        )
        print("forward", arch, shared)
        cfg = tk._default_tiles(dtype, "grad_proj")
        shared = _compile(
            tk._grad_proj_kernel,
            arch,
            {"g_ptr": "*bf16", "p_ptr": "*bf16", "t_ptr": "*fp32"},
            dict(
                ACC_DTYPE=tl.float32,
                BLOCK_M=cfg.block_m,
                BLOCK_R=cfg.block_n,
                BLOCK_K=cfg.block_k,
                UPCAST=False,
                PRECISION=tk._precision(dtype),
                stride_gm=1,
                stride_pr=1,
                stride_tr=1,
            ),  # fmt: skip
            cfg,
        )
        print("grad_proj", arch, shared)
        cfg = tk._default_tiles(dtype, "expand")
        shared = _compile(
            tk._expand_into_kernel,
            arch,
            {"t_ptr": "*fp32", "v_ptr": "*bf16", "out_ptr": "*fp32"},
            dict(
                ACC_DTYPE=tl.float32,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                GROUP_M=8,
                ACCUMULATE=True,
                UPCAST=False,
                PRECISION="tf32",
                stride_tr=1,
                stride_vr=1,
                stride_on=1,
            ),  # fmt: skip
            cfg,
        )
        print("expand", arch, shared)


if __name__ == "__main__":
    main()
