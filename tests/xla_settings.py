"""The XLA flags of the suite's processes: cheaper compiles, patient collectives, virtual CPU devices. Imports
nothing: a subprocess's script can build its XLA_FLAGS before JAX starts."""

from __future__ import annotations

# Compilation dominates a cold run of the suite (tiny models, many distinct programs): LLVM's cheaper settings
# cut it by about a quarter, and XLA:CPU's older elemental emitters in place of its MLIR fusion emitters by
# another third (a tiny GRPO update compiled in 3.3 s -> 1.6-2.0 s, the sampler 2.1 s -> 1.1-1.6 s); matmuls
# still call the same library kernels. XLA reads XLA_FLAGS when the first backend starts, not at `import jax`.
# Subprocesses that set their own XLA_FLAGS (virtual devices) add these.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false")


# XLA:CPU runs each virtual device's program on its own thread and meets the others at each collective; a thread
# that waits more than 40 s (the default) for the rest aborts the process. With 8 virtual devices on 2 cores beside
# a second pytest-xdist worker one device can lag that long (CI, AVX2-only EPYC: the ring-attention parity test
# died at its first collective-permute, 7 of 8 threads there). A real deadlock still ends the run: after 300 s,
# inside each subprocess's 600 s timeout, with XLA's message naming the collective.
PATIENT_COLLECTIVES_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=300"


def virtual_devices_xla_flags(devices: int, fast_compile: bool = True) -> str:
    """XLA_FLAGS for a subprocess on `devices` virtual CPU devices: patient collectives, and the suite's cheaper
    compile settings unless `fast_compile` is off (a test that measures the optimised program's memory)."""
    return " ".join([f"--xla_force_host_platform_device_count={devices}", PATIENT_COLLECTIVES_FLAGS,
                     *([FAST_COMPILE_FLAGS] if fast_compile else [])])
