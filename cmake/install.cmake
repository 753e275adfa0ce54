include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS shoal EXPORT shoalTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# The *_test_hook.h headers are public only so that the test programs build
# against include/ alone; they are not for users and are not installed.
install(DIRECTORY include/shoal DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  PATTERN "*_test_hook.h" EXCLUDE)
install(EXPORT shoalTargets NAMESPACE shoal:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/shoal)
# The user's documentation beside the library: how to use it, the design,
# recording and replaying traces. (benchmarks.md is the project's log.)
install(FILES README.md docs/architecture.md docs/traces.md DESTINATION ${CMAKE_INSTALL_DOCDIR})

get_target_property(shoal_library_type shoal TYPE)
if(shoal_library_type STREQUAL "SHARED_LIBRARY")
  set(shoal_shared_library TRUE)
else()
  set(shoal_shared_library FALSE)
endif()
configure_package_config_file(cmake/shoalConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/shoalConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/shoal)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/shoalConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/shoalConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/shoalConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/shoal)
