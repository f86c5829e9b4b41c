"""Kernel tests: the C++ CPU kernels, the CUDA kernels' argument checks and NVRTC compiles, and the host SIMT emulator
running the CUDA sources (tests/simt); kernel_tests/gpu needs a CUDA device."""
