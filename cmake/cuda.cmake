# Decides ZEROCORE_WITH_CUDA from the ZEROCORE_CUDA switch and, when ON,
# enables CUDA for the whole build. AUTO builds the
# CUDA part only when a CUDA compiler is found, so machines without nvcc
# still build everything else.
set(ZEROCORE_WITH_CUDA OFF)
string(TOUPPER "${ZEROCORE_CUDA}" _zc_cuda)
if(_zc_cuda STREQUAL "AUTO" OR _zc_cuda STREQUAL "ON")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER)
    # nvcc is often installed without being on PATH.
    foreach(_zc_nvcc IN ITEMS "$ENV{CUDA_HOME}/bin/nvcc" "/usr/local/cuda/bin/nvcc")
      if(EXISTS "${_zc_nvcc}")
        set(CMAKE_CUDA_COMPILER "${_zc_nvcc}" CACHE FILEPATH "CUDA compiler")
        break()
      endif()
    endforeach()
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(ZEROCORE_WITH_CUDA ON)
  elseif(_zc_cuda STREQUAL "ON")
    message(FATAL_ERROR "ZEROCORE_CUDA=ON but no CUDA compiler was found; "
                        "set CMAKE_CUDA_COMPILER or use ZEROCORE_CUDA=AUTO")
  endif()
elseif(NOT _zc_cuda STREQUAL "OFF")
  message(FATAL_ERROR "ZEROCORE_CUDA must be AUTO, ON or OFF (got '${ZEROCORE_CUDA}')")
endif()
message(STATUS "zerocore: CUDA kernels ${ZEROCORE_WITH_CUDA}")

if(ZEROCORE_WITH_CUDA)
  # Architectures are explicit (never "native"), so a build machine without a
  # GPU produces the same binary as one with: SASS for each listed arch plus
  # PTX, which newer GPUs JIT-compile. The language is enabled here, at the
  # top level, because targets of two directories link zerocore_cuda (cuda/
  # and python/).
  set(ZEROCORE_CUDA_ARCHITECTURES "80;90" CACHE STRING
      "CUDA architectures to build the kernels for (CMAKE_CUDA_ARCHITECTURES syntax)")
  if(ZEROCORE_CUDA_ARCHITECTURES MATCHES "native|all")
    message(FATAL_ERROR "ZEROCORE_CUDA_ARCHITECTURES must list architectures explicitly "
                        "(got '${ZEROCORE_CUDA_ARCHITECTURES}')")
  endif()
  set(CMAKE_CUDA_ARCHITECTURES "${ZEROCORE_CUDA_ARCHITECTURES}")
  # The CUDA runtime is linked statically: the wheel then needs only the
  # driver (libcuda, loaded lazily on first use), not a matching libcudart.
  # The driver must support the toolkit's major version (CUDA 13: R580 or
  # newer); with an older one device_count() is 0 and unavailable_reason()
  # says cudaErrorInsufficientDriver.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "zerocore: CUDA ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
endif()
