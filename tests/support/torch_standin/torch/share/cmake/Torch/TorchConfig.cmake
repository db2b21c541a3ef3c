# Stand-in for torch's CMake package (sparkspec tests): what vLLM's CMakeLists reads from find_package(Torch).
# Real torch enables the CUDA language; this stand-in only finds nvcc, reads its version into
# CMAKE_CUDA_COMPILER_VERSION and turns TORCH_CUDA_ARCH_LIST into -gencode flags in CMAKE_CUDA_FLAGS, as
# torch's select_compute_arch.cmake does ("12.1a" -> "-gencode arch=compute_121a,code=sm_121a"; "+PTX" adds
# code=compute_XY). There is no GPU to detect here, so an empty TORCH_CUDA_ARCH_LIST is an error.
set(Torch_VERSION "2.13.0")
set(TORCH_FOUND TRUE)

if(NOT CMAKE_CUDA_COMPILER)
  find_program(CMAKE_CUDA_COMPILER nvcc HINTS "$ENV{CUDA_HOME}/bin")
endif()
if(NOT CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "Torch stand-in: nvcc not found (set CUDA_HOME or put nvcc on PATH)")
endif()
execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --version
  OUTPUT_VARIABLE _torch_nvcc_out RESULT_VARIABLE _torch_nvcc_rc)
if(NOT _torch_nvcc_rc EQUAL 0 OR NOT _torch_nvcc_out MATCHES "release [0-9.]+, V([0-9.]+)")
  message(FATAL_ERROR "Torch stand-in: ${CMAKE_CUDA_COMPILER} --version did not report a CUDA release")
endif()
set(CMAKE_CUDA_COMPILER_VERSION "${CMAKE_MATCH_1}")
set(CUDA_FOUND TRUE)
set(CUDA_VERSION "${CMAKE_CUDA_COMPILER_VERSION}")

set(_torch_arch_list "$ENV{TORCH_CUDA_ARCH_LIST}")
string(REGEX REPLACE "[ ,]+" ";" _torch_arch_list "${_torch_arch_list}")
if(NOT _torch_arch_list)
  message(FATAL_ERROR "Torch stand-in: set TORCH_CUDA_ARCH_LIST (there is no GPU to detect the arch from)")
endif()
foreach(_torch_arch IN LISTS _torch_arch_list)
  if(NOT _torch_arch MATCHES "^([0-9]+)\\.([0-9])([af]?)(\\+PTX)?$")
    message(FATAL_ERROR "Torch stand-in: unknown CUDA arch '${_torch_arch}' in TORCH_CUDA_ARCH_LIST")
  endif()
  set(_torch_code "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
  string(APPEND CMAKE_CUDA_FLAGS " -gencode arch=compute_${_torch_code},code=sm_${_torch_code}")
  if(CMAKE_MATCH_4)
    string(APPEND CMAKE_CUDA_FLAGS " -gencode arch=compute_${_torch_code},code=compute_${_torch_code}")
  endif()
endforeach()
string(STRIP "${CMAKE_CUDA_FLAGS}" CMAKE_CUDA_FLAGS)
message(STATUS "Torch stand-in ${Torch_VERSION}: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, CMAKE_CUDA_FLAGS=${CMAKE_CUDA_FLAGS}")
