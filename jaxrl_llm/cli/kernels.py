"""`python -m jaxrl_llm kernels`: build this project's C++ CPU kernels ahead of a run (into the kernel cache,
`$JAXRL_LLM_KERNEL_CACHE` or ~/.cache/jaxrl_llm/kernels) and say what this machine runs: the CPU, the compiler, each
kernel built or why not (no compiler, the compiler's first error line, no AMX), and the rollout engine's paths for a
bfloat16 and a float32 model."""

from __future__ import annotations

import platform
from collections.abc import Sequence

from jaxrl_llm.cli.errors import CommandParser
from jaxrl_llm.engine import cpu_kernel
from jaxrl_llm.engine.kernels import describe_paths
from jaxrl_llm.models.config import ModelConfig


def cpu_model() -> str:
    """The CPU's model name (`lscpu`'s "Model name", from /proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m jaxrl_llm kernels", description=__doc__)
    parser.parse_args(argv)
    print(f"CPU: {cpu_model()} (AVX-512 bf16: {'yes' if cpu_kernel.has_avx512_bf16() else 'no'})")
    print(f"compiler: {cpu_kernel.compiler_name() or 'none found ($CXX, c++, g++ or clang++)'}")
    for name, why in (("attention (decode_attention.cc)", cpu_kernel.unavailable_reason()),
                      ("sampling (inverse_cdf.cc)", cpu_kernel.sampling_unavailable_reason()),
                      ("AMX matmul (packed_matmul.cc)", cpu_kernel.packed_matmul_unavailable_reason())):
        print(f"{name}: {'built' if why is None else f'not used: {why}'}")
    model = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=32)
    for dtype in ("bfloat16", "float32"):
        print(f"the rollout engine here, a {dtype} model: {describe_paths(model.replace(dtype=dtype), platform='cpu')}")
    return 0
