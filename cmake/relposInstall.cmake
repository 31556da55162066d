# The relpos C++ package: `cmake --install BUILD --prefix P` puts
#   P/include/relpos/{core,kernels,diag,torch}/...   every header of those layers (docs/cpp.md says
#                                                    which are the public API)
#   P/lib/librelpos_{core,kernels,diag}.{a,so}       the LibTorch-free layers (BUILD_SHARED_LIBS)
#   P/lib/librelpos_torch.a                          the torch layer (LibTorch builds only)
#   P/lib/cmake/relpos/                              relposConfig.cmake, relposConfigVersion.cmake
#                                                    and the exported targets
# so that find_package(relpos CONFIG) gives relpos::kernels (core + kernels, no LibTorch),
# relpos::diag and relpos::torch. Every path in the installed files is relative to the prefix:
# the tree can be moved. Included from CMakeLists.txt when RELPOS_INSTALL is on.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(RELPOS_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/relpos)

# Headers keep their source-tree paths under include/relpos/ (list.inc: included by a header).
foreach(layer core kernels diag)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/src/${layer}/ DESTINATION include/relpos/${layer}
          COMPONENT relpos FILES_MATCHING PATTERN "*.hpp" PATTERN "list.inc")
endforeach()
install(TARGETS relpos_core relpos_kernels relpos_diag EXPORT relposKernelsTargets
        COMPONENT relpos
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT relposKernelsTargets NAMESPACE relpos:: FILE relpos-kernels-targets.cmake
        DESTINATION ${RELPOS_INSTALL_CMAKEDIR} COMPONENT relpos)

set(RELPOS_HAS_TORCH OFF)
set(RELPOS_TORCH_VERSION "")
if(TARGET relpos_torch)
  set(RELPOS_HAS_TORCH ON)
  set(RELPOS_TORCH_VERSION ${Torch_VERSION})
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/src/torch/ DESTINATION include/relpos/torch
          COMPONENT relpos FILES_MATCHING PATTERN "*.hpp" PATTERN "list.inc")
  # exported as relpos::torch_static; relposConfig.cmake wraps it into relpos::torch (whole
  # archive) as relpos_torch_whole does in the build tree
  install(TARGETS relpos_torch EXPORT relposTorchTargets COMPONENT relpos
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(EXPORT relposTorchTargets NAMESPACE relpos:: FILE relpos-torch-targets.cmake
          DESTINATION ${RELPOS_INSTALL_CMAKEDIR} COMPONENT relpos)
endif()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/relposConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/relposConfig.cmake
                              INSTALL_DESTINATION ${RELPOS_INSTALL_CMAKEDIR})
# 0.x: a new minor version may change the API (SameMinorVersion); from 1.0 on, SameMajorVersion.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/relposConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/relposConfig.cmake
              ${PROJECT_BINARY_DIR}/relposConfigVersion.cmake
        DESTINATION ${RELPOS_INSTALL_CMAKEDIR} COMPONENT relpos)
