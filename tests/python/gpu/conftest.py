# Imported first so that TRITON_INTERPRET is set (without a GPU) before any test imports Triton.
import gpu_testing  # noqa: F401
