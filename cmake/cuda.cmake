# Decides ZEROCORE_WITH_CUDA from the ZEROCORE_CUDA switch. AUTO builds the
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
