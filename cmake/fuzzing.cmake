# SHOAL_BUILD_FUZZERS=ON builds the libFuzzer targets (tests/fuzz), with clang.
# Everything is compiled for fuzzing (-fsanitize=fuzzer-no-link: the
# library's own branches guide the fuzzer) under ASan+UBSan;
# SHOAL_FUZZ_COVERAGE adds clang's source-based coverage (scripts/fuzz
# reports the lines of src/ipc and src/channel a run reached).
option(SHOAL_BUILD_FUZZERS "Build the libFuzzer targets (needs clang)" OFF)
option(SHOAL_FUZZ_COVERAGE "With SHOAL_BUILD_FUZZERS: add source-based coverage" OFF)
if(SHOAL_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "SHOAL_BUILD_FUZZERS needs clang (-DCMAKE_CXX_COMPILER=clang++), not ${CMAKE_CXX_COMPILER_ID}")
  endif()
  if(NOT SHOAL_SANITIZE STREQUAL "")
    message(FATAL_ERROR "SHOAL_BUILD_FUZZERS brings its own sanitizers; leave SHOAL_SANITIZE empty")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
  if(SHOAL_FUZZ_COVERAGE)
    add_compile_options(-fprofile-instr-generate -fcoverage-mapping)
    add_link_options(-fprofile-instr-generate)
  endif()
endif()
