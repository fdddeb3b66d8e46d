#include <nanobind/stl/vector.h>

#include <vector>

#include "bindings.h"
#include "zerocore/error.h"
#include "zerocore/layout.h"

namespace nb = nanobind;

namespace zerocore::bindings {

void bind_layout(nb::module_& m) {
  nb::class_<ParamSlot>(m, "ParamSlot")
      .def_ro("offset", &ParamSlot::offset)
      .def_ro("numel", &ParamSlot::numel)
      .def_ro("group", &ParamSlot::param_group)
      .def_ro("first_bucket", &ParamSlot::first_bucket)
      .def_ro("last_bucket", &ParamSlot::last_bucket);
  nb::class_<Bucket>(m, "Bucket")
      .def_ro("offset", &Bucket::offset)
      .def_ro("numel", &Bucket::numel)
      .def_ro("first_param", &Bucket::first_param)
      .def_ro("last_param", &Bucket::last_param);
  nb::class_<Segment>(m, "Segment")
      .def_ro("param", &Segment::param)
      .def_ro("group", &Segment::param_group)
      .def_ro("bucket", &Segment::bucket)
      .def_ro("param_offset", &Segment::param_offset)
      .def_ro("flat_offset", &Segment::flat_offset)
      .def_ro("partition_offset", &Segment::partition_offset)
      .def_ro("numel", &Segment::numel);

  nb::class_<LayoutPlan>(m, "LayoutPlan", "Flat buffer layout, buckets and rank partitions (see layout.h).")
      .def_static(
          "make",
          [](const std::vector<int64_t>& numels, std::vector<int> groups, int world_size, int64_t align_elems,
             int64_t bucket_elems) {
            if (groups.empty()) groups.assign(numels.size(), 0);
            if (groups.size() != numels.size()) {
              throw InvalidArgument("layout: groups has " + std::to_string(groups.size()) +
                                    " entries for " + std::to_string(numels.size()) + " params");
            }
            std::vector<ParamSpec> specs(numels.size());
            for (size_t i = 0; i < numels.size(); ++i) specs[i] = ParamSpec{numels[i], groups[i]};
            return LayoutPlan::make(specs, LayoutOptions{world_size, align_elems, bucket_elems});
          },
          nb::arg("numels"), nb::kw_only(), nb::arg("groups") = std::vector<int>{}, nb::arg("world_size") = 1,
          nb::arg("align_elems") = 1, nb::arg("bucket_elems") = 0)
      .def_prop_ro("world_size", &LayoutPlan::world_size)
      .def_prop_ro("align_elems", [](const LayoutPlan& p) { return p.options().align_elems; })
      .def_prop_ro("total_elems", &LayoutPlan::total_elems)
      .def_prop_ro("partition_elems", &LayoutPlan::partition_elems)
      .def_prop_ro("padding_elems", &LayoutPlan::padding_elems)
      .def_prop_ro("params", &LayoutPlan::params)
      .def_prop_ro("buckets", &LayoutPlan::buckets)
      .def_prop_ro("fingerprint", &LayoutPlan::fingerprint)
      .def("shard_offset", &LayoutPlan::shard_offset, nb::arg("bucket"), nb::arg("rank"))
      .def("shard_elems", &LayoutPlan::shard_elems, nb::arg("bucket"))
      .def("partition_offset", &LayoutPlan::partition_offset, nb::arg("bucket"))
      .def("segments", &LayoutPlan::segments, nb::arg("rank"));
}

}  // namespace zerocore::bindings
