// The operator library's own translation unit: relpos_ops is the torch layer linked whole
// (CMakeLists.txt), and this file only says so. `torch.ops.load_library` runs the TORCH_LIBRARY
// registrations of torch/ops.cpp.
