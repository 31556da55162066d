# The pybind11 ABI keys of the LibTorch in this Python's torch, as compile definitions for CMake
# (a ';'-list; empty from LibTorch builds on pybind11 3, which key on their own): an extension
# shares pybind11's registered types with LibTorch's only under the same keys, which
# torch.utils.cpp_extension passes the same way.
import torch

names = ("COMPILER_TYPE", "STDLIB", "BUILD_ABI")
print(";".join(f'PYBIND11_{n}="{getattr(torch._C, "_PYBIND11_" + n)}"'
               for n in names if hasattr(torch._C, "_PYBIND11_" + n)))
