// The native schedule's Python face: stage 3's UnitSchedule, the
// BucketReducer of stages 2-3 and the step's BucketCollectives, which the
// EngineCore builds (bind_engine.cpp). Python's module and autograd hooks call these
// to say what happened; every call that may wait for a collective releases
// the GIL, since the queue's thread may need it to run a transport written
// in Python.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <vector>

#include "bindings.h"
#include "dlpack_tensor.h"
#include "zerocore/schedule/bucket_collectives.h"
#include "zerocore/schedule/bucket_reducer.h"
#include "zerocore/schedule/unit_schedule.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

namespace {

// A tensor, or None where it is undefined.
nb::object maybe(const Tensor& t) { return t.data() ? nb::cast(t) : nb::none(); }

// Grad views as Python takes them: [(group, param, view)].
nb::list grad_views(const std::vector<GradView>& views) {
  nb::list out;
  for (const GradView& v : views) out.append(nb::make_tuple(v.group, v.param, nb::cast(v.view)));
  return out;
}

// A hook's Binding as Python takes it: ((address, buffer) to bind the
// unit's params to, or None when they view it already; [released units]).
nb::tuple binding(const UnitSchedule::Binding& b) {
  nb::object bind = nb::none();
  if (b.rebind) bind = nb::make_tuple(reinterpret_cast<uintptr_t>(b.buffer.data()), b.buffer);
  return nb::make_tuple(bind, b.released);
}

// A unit hook: one call, the GIL released while it may wait for a round.
template <class... Args>
auto hook(UnitSchedule::Binding (UnitSchedule::*method)(Args...)) {
  return [method](UnitSchedule& self, Args... args) {
    UnitSchedule::Binding b;
    {
      nb::gil_scoped_release release;
      b = (self.*method)(args...);
    }
    return binding(b);
  };
}

// A member call with the GIL released.
template <class Class, class Result, class... Args>
auto unlocked(Result (Class::*method)(Args...)) {
  return [method](Class& self, Args... args) {
    nb::gil_scoped_release release;
    return (self.*method)(args...);
  };
}

}  // namespace

void bind_schedule(nb::module_& m) {
  nb::class_<UnitSchedule>(m, "UnitSchedule",
                           "Stage 3's unit state machine over a fixed gather pool (see unit_schedule.h); EngineCore.schedule.")
      .def("pre_forward", hook(&UnitSchedule::pre_forward), "unit"_a, "marks_post_backward"_a,
           "The unit is about to run forward: (bind, released), bind being (address, buffer) where its params "
           "must view the buffer it is gathered in, or None when they view it already; released: the units "
           "whose params must stop viewing theirs.")
      .def("post_forward", hook(&UnitSchedule::post_forward), "unit"_a, "backward_follows"_a,
           "(None, released), as pre_forward.")
      .def("begin_backward", unlocked(&UnitSchedule::begin_backward))
      .def("pre_backward", hook(&UnitSchedule::pre_backward), "unit"_a,
           "The unit's backward begins: (bind, released), as pre_forward.")
      .def("post_backward", hook(&UnitSchedule::post_backward), "unit"_a, "(None, released), as pre_forward.")
      .def("take_released", &UnitSchedule::take_released,
           "The units released since the last hook or call, whose params must stop viewing their buffers.")
      .def("unbind_all", &UnitSchedule::unbind_all, "Every unit's params stopped viewing its buffer.")
      .def(
          "read",
          [](UnitSchedule& self, int unit) {
            Tensor buffer;
            {
              nb::gil_scoped_release release;  // may wait for the unit's gather
              buffer = self.read(unit);
            }
            return maybe(buffer);
          },
          "unit"_a, "The unit's buffer for a read outside its hooks (its gather waited for), or None.")
      .def("end_forward", unlocked(&UnitSchedule::end_forward), "failed"_a = false)
      .def("end_backward", unlocked(&UnitSchedule::end_backward), "failed"_a = false)
      .def("end_step", unlocked(static_cast<void (UnitSchedule::*)()>(&UnitSchedule::end_step)),
           "The end-of-step round on its own (the engine's ZeroStep carries it in its exchange instead).")
      .def("release_all", unlocked(&UnitSchedule::release_all),
           "Releases every unit no hook holds (their params changed).")
      .def("gather_into", unlocked(&UnitSchedule::gather_into), "unit"_a, "out"_a,
           "The unit's full flat params into out (a zerocore.Tensor), uncounted and outside the pool.")
      .def("gathered", &UnitSchedule::gathered, "unit"_a)
      .def("unit_elems", &UnitSchedule::unit_elems, "unit"_a)
      .def("group_offset", &UnitSchedule::group_offset, "unit"_a, "group"_a)
      .def_prop_ro("buffer_bytes", &UnitSchedule::buffer_bytes)
      .def_prop_ro("pool_slots", &UnitSchedule::pool_slots)
      .def_prop_ro("rounds", &UnitSchedule::rounds, "Rounds posted since construction.")
      .def_prop_ro("blocking_rounds", &UnitSchedule::blocking_rounds,
                   "Rounds a hook waited for at once (a unit not here, the end of a pass).")
      .def_prop_ro("round_seconds", &UnitSchedule::round_seconds, "Seconds spent waiting for rounds.");

  nb::class_<BucketReducer>(m, "BucketReducer",
                            "Stages 2-3's bucket state machine for gradient reduction (see bucket_reducer.h); "
                            "EngineCore.reducer.")
      // Taking staging may wait for a reduction in flight: the GIL is
      // released while these run.
      .def(
          "begin_backward",
          [](BucketReducer& self) {
            std::vector<GradView> views;
            {
              nb::gil_scoped_release release;
              views = self.begin_backward();
            }
            return grad_views(views);
          },
          "Stage 2, grads accumulating in place: [(group, param, view)] of the first bucket to reduce; grad_ready "
          "then hands out the views of each bucket that takes staging.")
      .def(
          "grad_ready",
          [](BucketReducer& self, int group, int param, nb::handle grad, std::optional<int> grid_exponent,
             nb::handle largest) {
            const Tensor t = tensor_from_dlpack(grad, "BucketReducer.grad_ready: grad");
            if (grid_exponent.has_value() == largest.is_none()) {
              throw nb::value_error("BucketReducer.grad_ready: grid_exponent and largest come together");
            }
            std::optional<BucketReducer::Grid> grid;
            if (grid_exponent) {
              grid = BucketReducer::Grid{*grid_exponent, tensor_from_dlpack(largest, "BucketReducer.grad_ready: largest")};
            }
            std::vector<GradView> views;
            {
              nb::gil_scoped_release release;
              views = self.grad_ready(group, param, t, grid);
            }
            return grad_views(views);
          },
          "group"_a, "param"_a, "grad"_a, "grid_exponent"_a.none() = nb::none(), "largest"_a.none() = nb::none(),
          "The param's grad is in (added, or in its view already): [(group, param, view)] of the buckets that took "
          "staging in this call (after begin_backward). grid_exponent and largest (int64 reductions): the float grad "
          "is put onto the grid of 2**grid_exponent as it is added, and largest (one float32 where the grad is) "
          "becomes the largest of itself and every |grad| (a NaN or an inf stays), with no host wait.")
      .def(
          "grad_views",
          [](BucketReducer& self, int group) {
            std::vector<Tensor> views;
            {
              nb::gil_scoped_release release;
              views = self.grad_views(group);
            }
            nb::list out;
            for (const Tensor& v : views) out.append(maybe(v));
            return out;
          },
          "group"_a, "Per param of the group, the staging piece its grad may accumulate in, or None.")
      .def("end_backward", unlocked(&BucketReducer::end_backward))
      .def("drop_late", &BucketReducer::drop_late, "Drops grads staged after their reduction (zero_grad).")
      .def("late", &BucketReducer::late, "Per bucket, whether it holds grads staged after its reduction.")
      .def("reduce_late", unlocked(&BucketReducer::reduce_late), "buckets"_a,
           "Reduces the buckets flagged (late on some rank: every rank passes the same flags) into the "
           "partitions; none is late after it. Config(deterministic=True) agrees on them before the step's "
           "exchange, which reduces them otherwise.")
      .def(
          "set_grad_partitions",
          [](BucketReducer& self, const nb::list& parts) {
            std::vector<Tensor> out;
            for (nb::handle t : parts) out.push_back(tensor_from_dlpack(t, "BucketReducer.set_grad_partitions"));
            self.set_grad_partitions(out);
          },
          "grad_parts"_a, "Where each group's reduced grads are added from now on; between backwards only.")
      .def_prop_ro("staging_bytes", &BucketReducer::staging_bytes)
      .def_prop_ro("landing_bytes", &BucketReducer::landing_bytes)
      .def_prop_ro("staging_slots", &BucketReducer::staging_slots);

  nb::class_<BucketCollectives>(m, "BucketCollectives",
                                "One in-place collective per bucket of whole flat buffers (see bucket_collectives.h): "
                                "EngineCore.grad_reduce and .param_gather.")
      .def("run", unlocked(&BucketCollectives::run), "Issues every bucket's collective and waits for them.");
}

}  // namespace zerocore::bindings
