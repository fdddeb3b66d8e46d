// The layout planner over a sweep of shapes, world sizes, alignments and
// bucket sizes: every param element owned by exactly one rank, buckets of
// constant size that split evenly, partition offsets consistent.
#include <cstdint>
#include <random>
#include <vector>

#include "check.h"
#include "zerocore/error.h"
#include "zerocore/layout.h"

using namespace zerocore;

static void check_plan(const std::vector<ParamSpec>& specs, const LayoutOptions& o) {
  const LayoutPlan plan = LayoutPlan::make(specs, o);
  const int64_t unit = int64_t(o.world_size) * o.align_elems;
  int64_t param_elems = 0;
  for (const auto& s : specs) param_elems += s.numel;
  CHECK(plan.total_elems() - plan.padding_elems() == param_elems);
  CHECK(plan.total_elems() % unit == 0);
  int64_t off = 0;
  for (size_t b = 0; b < plan.buckets().size(); ++b) {
    const Bucket& bk = plan.buckets()[b];
    CHECK(bk.offset == off && bk.numel % unit == 0 && bk.numel > 0);
    if (b + 1 < plan.buckets().size()) CHECK(bk.numel == plan.buckets()[0].numel);
    off += bk.numel;
  }
  CHECK(off == plan.total_elems());
  std::vector<std::vector<int>> owner(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    owner[i].assign(size_t(specs[i].numel), -1);
    CHECK(plan.params()[i].offset % o.align_elems == 0);
  }
  for (int r = 0; r < o.world_size; ++r) {
    int64_t last_end = 0;
    for (const Segment& s : plan.segments(r)) {
      CHECK(s.partition_offset >= last_end && s.partition_offset + s.numel <= plan.partition_elems());
      last_end = s.partition_offset + s.numel;
      CHECK(s.flat_offset == plan.params()[s.param].offset + s.param_offset);
      for (int64_t k = s.param_offset; k < s.param_offset + s.numel; ++k) {
        CHECK(owner[s.param][k] == -1);
        owner[s.param][k] = r;
      }
    }
  }
  for (const auto& row : owner) {
    for (int r : row) CHECK(r >= 0);
  }
}

int main() {
  std::mt19937 rng(42);
  for (int world = 1; world <= 8; ++world) {
    for (int64_t align : {1, 3, 16, 64}) {
      for (int64_t bucket : {0, 1, 17, 256, 100000}) {
        std::vector<ParamSpec> specs;
        const int count = 1 + int(rng() % 40);
        for (int i = 0; i < count; ++i) {
          const int kind = int(rng() % 4);
          const int64_t n = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? int64_t(rng() % 100) : int64_t(rng() % 5000);
          specs.push_back({n, int(rng() % 3)});
        }
        check_plan(specs, {world, align, bucket});
      }
    }
  }
  // Thousands of tiny params, one param much larger than a bucket.
  check_plan(std::vector<ParamSpec>(5000, ParamSpec{3, 0}), {8, 4, 512});
  check_plan({{10, 0}, {100000, 1}, {10, 0}}, {4, 8, 1000});
  // Bad options throw InvalidArgument.
  int thrown = 0;
  for (LayoutOptions bad : {LayoutOptions{0, 1, 0}, LayoutOptions{1, 0, 0}, LayoutOptions{1, 1, -1}}) {
    try {
      LayoutPlan::make({{4, 0}}, bad);
    } catch (const InvalidArgument&) {
      ++thrown;
    }
  }
  CHECK(thrown == 3);
  return test::finish("test_layout");
}
