// zerocore.PartitionStore: a flat group's buffers and every view into them
// (store/partition_store.h). A view is asked of a buffer by its kind ("full",
// "master", "state.exp_avg", ...) or of any whole or partition-sized tensor
// of the plan (a gather pool slot); views come back as DLPack arrays.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "dlpack_tensor.h"
#include "zerocore/error.h"
#include "zerocore/store/partition_store.h"

namespace nb = nanobind;

namespace zerocore::bindings {

namespace {

using Array = nb::ndarray<nb::array_api>;

// A buffer named by its kind, or a tensor of the caller's.
Tensor resolve(const PartitionStore& store, nb::handle what) {
  if (nb::isinstance<nb::str>(what)) return store.buffer(nb::cast<std::string>(what));
  return tensor_from_dlpack(what, "PartitionStore: buffer");
}

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
  nb::class_<PartitionRun>(m, "PartitionRun")
      .def_ro("bucket", &PartitionRun::bucket)
      .def_ro("group", &PartitionRun::group)
      .def_ro("partition_offset", &PartitionRun::partition_offset)
      .def_ro("flat_offset", &PartitionRun::flat_offset)
      .def_ro("numel", &PartitionRun::numel);

  nb::class_<PartitionStore>(m, "PartitionStore", "A flat group's buffers and views (see partition_store.h).")
      .def(
          "__init__",
          [](PartitionStore* self, const LayoutPlan& plan, int rank, const std::string& dtype,
             const std::string& reduce_dtype, bool trainable, bool sharded, bool partitions_grads,
             bool params_on_host, bool optimizer_on_host, bool delayed, std::vector<std::string> state_names) {
            new (self) PartitionStore(
                plan, StorePlacement{rank, parse_dtype(dtype), parse_dtype(reduce_dtype), trainable, sharded,
                                     partitions_grads, params_on_host, optimizer_on_host, delayed,
                                     std::move(state_names)});
          },
          nb::arg("plan"), nb::kw_only(), nb::arg("rank"), nb::arg("dtype"), nb::arg("reduce_dtype"),
          nb::arg("trainable"), nb::arg("sharded"), nb::arg("partitions_grads"), nb::arg("params_on_host"),
          nb::arg("optimizer_on_host"), nb::arg("delayed") = false,
          nb::arg("state_names") = std::vector<std::string>{})
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
      .def_prop_ro("swaps_grads", &PartitionStore::swaps_grads)
      .def("swap_grads", &PartitionStore::swap_grads)
      .def(
          "param_view",
          [](const PartitionStore& s, nb::handle buf, int param) {
            return tensor_to_ndarray(s.param_view(resolve(s, buf), param));
          },
          nb::arg("buffer"), nb::arg("param"))
      .def(
          "param_stretches",
          [](const PartitionStore& s, nb::handle buf, int param) {
            std::vector<std::tuple<int64_t, Array>> out;
            for (const Stretch& st : s.param_stretches(resolve(s, buf), param)) {
              out.emplace_back(st.param_offset, tensor_to_ndarray(st.view));
            }
            return out;
          },
          nb::arg("buffer"), nb::arg("param"), "(first element of the param, view) of each piece in buffer.")
      .def(
          "bucket_view",
          [](const PartitionStore& s, nb::handle buf, int bucket) {
            return tensor_to_ndarray(s.bucket_view(resolve(s, buf), bucket));
          },
          nb::arg("buffer"), nb::arg("bucket"))
      .def(
          "shard_view",
          [](const PartitionStore& s, nb::handle buf, int bucket, int rank) {
            return tensor_to_ndarray(s.shard_view(resolve(s, buf), bucket, rank));
          },
          nb::arg("buffer"), nb::arg("bucket"), nb::arg("rank"))
      .def(
          "run_view",
          [](const PartitionStore& s, nb::handle buf, int run) {
            return tensor_to_ndarray(s.run_view(resolve(s, buf), run));
          },
          nb::arg("buffer"), nb::arg("run"))
      .def(
          "segment_view",
          [](const PartitionStore& s, nb::handle buf, int segment) {
            return tensor_to_ndarray(s.segment_view(resolve(s, buf), segment));
          },
          nb::arg("buffer"), nb::arg("segment"))
      .def(
          "partition_from_whole",
          [](const PartitionStore& s, nb::handle whole, nb::handle partition) {
            s.partition_from_whole(resolve(s, whole), resolve(s, partition));
          },
          nb::arg("whole"), nb::arg("partition"));
}

}  // namespace zerocore::bindings
