# Installs the build tree's libkda into a scratch prefix, then configures, builds and runs
# tests/install/consumer against it with find_package(kda). Run by ctest (install_consumer):
#   cmake -DKDA_BUILD_DIR=<build> -DKDA_SOURCE_DIR=<source> -DWORK_DIR=<scratch> -P check_install.cmake
foreach(var KDA_BUILD_DIR KDA_SOURCE_DIR WORK_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "check_install.cmake: ${var} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${err}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install "${KDA_BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
run(${CMAKE_COMMAND} -S "${KDA_SOURCE_DIR}/tests/install/consumer" -B "${WORK_DIR}/build" -G Ninja
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/consumer")
