include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS shoal EXPORT shoalTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/shoal DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT shoalTargets NAMESPACE shoal:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/shoal)

configure_package_config_file(cmake/shoalConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/shoalConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/shoal)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/shoalConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/shoalConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/shoalConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/shoal)
