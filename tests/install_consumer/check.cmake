# Installs the build at BUILD_DIR into WORK/prefix, then configures, builds
# and runs the consumer in SOURCE_DIR against it with find_package(shoal).
file(REMOVE_RECURSE "${WORK}")
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${WORK}/prefix"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR};-B;${WORK}/build;-G;${GENERATOR};-DCMAKE_PREFIX_PATH=${WORK}/prefix;-DCMAKE_BUILD_TYPE=Release"
    "${CMAKE_COMMAND};--build;${WORK}/build"
    "${WORK}/build/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install consumer step failed (${rc}): ${step}")
  endif()
endforeach()
# The documentation comes with it.
foreach(doc README.md architecture.md traces.md)
  if(NOT EXISTS "${WORK}/prefix/share/doc/shoal/${doc}")
    message(FATAL_ERROR "install consumer: ${doc} was not installed in share/doc/shoal")
  endif()
endforeach()
