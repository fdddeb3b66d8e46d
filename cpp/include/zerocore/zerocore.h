// The public C++ API of zerocore, for trainers that embed the runtime.
#pragma once
#include "zerocore/arena.h"
#include "zerocore/comm.h"
#include "zerocore/cpu_features.h"
#include "zerocore/cpu_optim.h"
#include "zerocore/cpu_reduce.h"
#include "zerocore/dtype.h"
#include "zerocore/error.h"
#include "zerocore/half.h"
#include "zerocore/layout.h"
#include "zerocore/tensor.h"
#include "zerocore/thread_pool.h"
