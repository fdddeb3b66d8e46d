// zerocore.PartitionStore: a flat group's buffers and where everything lies
// in them (store/partition_store.h). Buffers come back as DLPack arrays;
// places as spans (offset, numel) of a whole or partition-sized buffer, which
// Python turns into slices of its torch tensors: a slice shares its buffer's
// torch storage, which stage 3's saved-tensor hooks rely on, where a view
// made natively and imported through DLPack would have a storage of its own.
// The buffers are the given backend's (the engine's, which the store keeps
// alive), so on a checking backend every access the runtime makes to them is
// checked.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "dlpack_tensor.h"
#include "bound_backend.h"
#include "zerocore/error.h"
#include "zerocore/store/partition_store.h"

namespace nb = nanobind;

namespace zerocore::bindings {

namespace {

Where parse_where(const std::string& where) {
  if (where == "device") return Where::kDevice;
  if (where == "host") return Where::kHost;
  throw InvalidArgument("PartitionStore: where must be \"device\" or \"host\", got \"" + where + "\"");
}

const char* category_name(Category c) {
  return c == Category::kParam ? "param" : c == Category::kGrad ? "grad" : "optim";
}

}  // namespace

void bind_store(nb::module_& m) {
  nb::class_<Span>(m, "Span")
      .def_ro("offset", &Span::offset)
      .def_ro("numel", &Span::numel)
      .def("__iter__", [](const Span& s) { return nb::iter(nb::make_tuple(s.offset, s.numel)); });
  nb::class_<PartitionRun>(m, "PartitionRun")
      .def_ro("bucket", &PartitionRun::bucket)
      .def_ro("group", &PartitionRun::param_group)
      .def_ro("partition_offset", &PartitionRun::partition_offset)
      .def_ro("flat_offset", &PartitionRun::flat_offset)
      .def_ro("numel", &PartitionRun::numel);

  nb::class_<FlatGroupBuffer>(m, "FlatGroupBuffer",
                              "One of a flat group's buffers with its LayoutPlan and collective tag (see "
                              "flat_group_buffer.h): what UnitSchedule, BucketReducer and BucketCollectives take.")
      .def_ro("tag", &FlatGroupBuffer::tag)
      .def_ro("plan", &FlatGroupBuffer::plan)
      .def_prop_ro("buffer", [](const FlatGroupBuffer& b) { return tensor_to_ndarray(b.buffer); })
      .def(
          "with_buffer",
          [](const FlatGroupBuffer& b, nb::handle buffer) {
            return FlatGroupBuffer{b.tag, b.plan, tensor_from_dlpack(buffer, "FlatGroupBuffer.with_buffer")};
          },
          nb::arg("buffer"), "The same group and layout over another buffer (Config(deterministic=True)'s int64 grad sums).");

  nb::class_<PartitionStore>(m, "PartitionStore", "A flat group's buffers and views (see partition_store.h).")
      .def(
          "__init__",
          [](PartitionStore* self, const LayoutPlan& plan, const BoundBackend& backend, int rank,
             const std::string& dtype, const std::string& reduce_dtype, bool trainable, bool sharded,
             bool partitions_grads, bool params_on_host, bool optimizer_on_host, bool delayed,
             bool exact_sums, std::vector<std::string> state_names, std::string name) {
            new (self) PartitionStore(
                plan,
                StorePlacement{rank, parse_dtype(dtype), parse_dtype(reduce_dtype), trainable, sharded,
                               partitions_grads, params_on_host, optimizer_on_host, delayed, exact_sums,
                               std::move(state_names)},
                backend.get(), std::move(name));
          },
          nb::arg("plan"), nb::kw_only(), nb::arg("backend"), nb::arg("rank"), nb::arg("dtype"),
          nb::arg("reduce_dtype"),
          nb::arg("trainable"), nb::arg("sharded"), nb::arg("partitions_grads"), nb::arg("params_on_host"),
          nb::arg("optimizer_on_host"), nb::arg("delayed") = false, nb::arg("exact_sums") = false,
          nb::arg("state_names") = std::vector<std::string>{}, nb::arg("name") = "a flat group",
          nb::keep_alive<1, 3>(),
          "backend: the zerocore._native.Backend its buffers are allocated from (kept alive). name: what the "
          "checking backend's reports call the group (its buffers are \"<kind> of <name>\").")
      .def_prop_ro("plan", &PartitionStore::plan)
      .def_prop_ro(
          "buffers",
          [](const PartitionStore& s) {
            std::vector<std::tuple<std::string, std::string, std::string, int64_t, std::string>> out;
            for (const BufferSpec& b : s.buffers()) {
              out.emplace_back(b.kind, category_name(b.category), b.where == Where::kHost ? "host" : "device",
                               b.elems, dtype_name(b.dtype));
            }
            return out;
          },
          "(kind, category, where, elements, dtype) of each buffer kept, before allocation.")
      .def(
          "planned_bytes", [](const PartitionStore& s, const std::string& where) {
            return s.planned_bytes(parse_where(where));
          },
          nb::arg("where"))
      .def_prop_ro("segments", &PartitionStore::segments)
      .def_prop_ro("runs", &PartitionStore::runs)
      .def("segments_of", &PartitionStore::segments_of, nb::arg("param"))
      .def("allocate", &PartitionStore::allocate)
      .def_prop_ro("allocated", &PartitionStore::allocated)
      .def("has", &PartitionStore::has, nb::arg("kind"))
      .def(
          "buffer", [](const PartitionStore& s, const std::string& kind) { return tensor_to_ndarray(s.buffer(kind)); },
          nb::arg("kind"))
      .def(
          "flat_runs",
          [](const PartitionStore& s) {
            const auto array = [](const Tensor& t) { return t.data() ? nb::cast(tensor_to_ndarray(t)) : nb::none(); };
            nb::list out;
            for (const FlatRun& r : s.flat_runs()) {
              out.append(nb::make_tuple(r.param_group, array(r.param), array(r.grad), array(r.state0), array(r.state1),
                                        array(r.param_copy)));
            }
            return out;
          },
          "Per run, what the optimizer step updates (FlatRuns' columns): (param group, fp32 param, grad, state0, "
          "state1, 16-bit param copy), None where there is none (see partition_store.h).")
      .def("group_buffer", &PartitionStore::group_buffer, nb::arg("tag"), nb::arg("kind"),
           "The buffer of `kind` with the plan and `tag`, the flat group's key in the collectives.")
      .def_prop_ro("swaps_grads", &PartitionStore::swaps_grads)
      .def("swap_grads", &PartitionStore::swap_grads)
      .def("zero_grads", &PartitionStore::zero_grads,
           "Zeroes grad_full and grad_part: device memory on the backend's compute stream, host memory at once.")
      .def("param_span", &PartitionStore::param_span, nb::arg("buffer_elems"), nb::arg("param"))
      .def(
          "param_spans",
          [](const PartitionStore& s, int64_t buffer_elems, int param) {
            std::vector<std::tuple<int64_t, Span>> out;
            for (const Stretch& st : s.param_spans(buffer_elems, param)) out.emplace_back(st.param_offset, st.span);
            return out;
          },
          nb::arg("buffer_elems"), nb::arg("param"), "(first element of the param, span) of each piece.")
      .def("bucket_span", &PartitionStore::bucket_span, nb::arg("buffer_elems"), nb::arg("bucket"))
      .def("shard_span", &PartitionStore::shard_span, nb::arg("buffer_elems"), nb::arg("bucket"), nb::arg("rank"))
      .def("run_span", &PartitionStore::run_span, nb::arg("buffer_elems"), nb::arg("run"))
      .def("segment_span", &PartitionStore::segment_span, nb::arg("buffer_elems"), nb::arg("segment"));
}

}  // namespace zerocore::bindings
