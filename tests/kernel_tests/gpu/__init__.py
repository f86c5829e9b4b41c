"""GPU tests: marked gpu, skipped without a CUDA device; scripts/device_check.sh runs this folder."""
