# Decides ZEROCORE_WITH_NCCL: the native NCCL transport (cuda/src/nccl_*.cpp)
# is built with the CUDA part wherever nccl.h is found. The header only: the
# library is loaded at run time (dlopen), so nothing links against NCCL and a
# build machine needs no GPU. Where to look: ZEROCORE_NCCL_INCLUDE_DIR if
# given, else the nvidia-nccl-cu13 (or -cu12) pip package of the Python the
# build runs with (Python_EXECUTABLE, else the python3 on PATH), which
# torch's CUDA wheels install. Without it the transport is not built and
# zerocore.comm.nccl.unavailable_reason() says why.
set(ZEROCORE_WITH_NCCL OFF)
set(ZEROCORE_NCCL_INCLUDE_DIR "" CACHE PATH "Folder holding nccl.h (empty: the nvidia-nccl pip package's)")
set(_zc_nccl_include "${ZEROCORE_NCCL_INCLUDE_DIR}")
if(NOT _zc_nccl_include)
  set(_zc_python "${Python_EXECUTABLE}")
  if(NOT _zc_python)
    find_program(_zc_python_on_path NAMES python3 python)
    set(_zc_python "${_zc_python_on_path}")
  endif()
  if(_zc_python)
    # nvidia.nccl is a namespace package: its folder is __path__[0].
    execute_process(
      COMMAND "${_zc_python}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _zc_nccl_package OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _zc_nccl_rc)
    if(_zc_nccl_rc EQUAL 0 AND _zc_nccl_package)
      set(_zc_nccl_include "${_zc_nccl_package}/include")
    endif()
  endif()
endif()
if(_zc_nccl_include AND EXISTS "${_zc_nccl_include}/nccl.h")
  set(ZEROCORE_WITH_NCCL ON)
  set(ZEROCORE_NCCL_HEADER_DIR "${_zc_nccl_include}")
  message(STATUS "zerocore: native NCCL transport ON (nccl.h in ${_zc_nccl_include})")
elseif(ZEROCORE_NCCL_INCLUDE_DIR)
  message(FATAL_ERROR "ZEROCORE_NCCL_INCLUDE_DIR=${ZEROCORE_NCCL_INCLUDE_DIR} holds no nccl.h")
else()
  message(STATUS "zerocore: native NCCL transport OFF (no nccl.h: pip install nvidia-nccl-cu13 into the build's "
                 "Python, or set ZEROCORE_NCCL_INCLUDE_DIR)")
endif()
